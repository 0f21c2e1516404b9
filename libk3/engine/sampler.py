"""Choosing the next token from logits: greedy or seeded temperature/top-p sampling.

Owns: the decision rule only. Greedy is the first index of the maximum logit (model.md §5.9).
Sampling is deterministic for a seed: float64 softmax of logits/temperature, candidates
sorted by (probability descending, id ascending), the smallest prefix whose mass reaches
top_p, one uniform draw from ``numpy.random.Generator(PCG64(seed))`` per step. Which
settings are valid is ``settings.py``'s rule.
"""

from __future__ import annotations

import numpy as np

from .settings import seed_problem, temperature_problem, top_p_problem


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
        why = temperature_problem(temperature) or top_p_problem(top_p) or seed_problem(seed)
        if why:
            raise ValueError(why)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.seed = int(seed)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float64)
        if self.greedy:
            return int(np.argmax(logits))
        z = logits / self.temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.lexsort((np.arange(p.size), -p))
        cum = np.cumsum(p[order])
        keep = int(np.searchsorted(cum, self.top_p * cum[-1]) + 1)
        cand = order[:keep]
        cp = np.cumsum(p[cand])
        r = self.rng.random() * cp[-1]
        return int(cand[min(int(np.searchsorted(cp, r, side="right")), keep - 1)])
