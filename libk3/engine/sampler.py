"""Choosing the token at a position from its logits: greedy, or seeded temperature/top-p.

Owns: the decision rule only. Greedy is the first index of the maximum logit (model.md §5.9).
Sampling is exact and keyed by position: the candidates are the smallest prefix, in order
of (probability descending, id ascending), of the float64 softmax of logits/temperature
whose mass reaches top_p; the token is the candidate with the largest logits/temperature
plus a Gumbel noise drawn for (seed, position, token id) (the Gumbel-max rule, which draws
exactly from the candidates' renormalised softmax). Which settings are valid is
``settings.py``'s rule.

Why keyed by position and not by step: the noise of a position is fixed before any model
runs, so the token there depends only on the logits of that position. A draft model that
picks its proposals with the same noise, and a verify pass that accepts a proposal when it
equals the pick from the target's logits, then give the very tokens plain sampling gives,
at every verify width, budget and thread count (dspark.md §6.2); and the same seed gives
the same tokens whether positions are decoded one at a time, in a verify block or in a
lockstep batch.
"""

from __future__ import annotations

import collections

import numpy as np

from .settings import seed_problem, temperature_problem, top_p_problem

NOISE_KEPT = 16             # positions whose noise is kept (a draft and its verify share it)


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
        why = temperature_problem(temperature) or top_p_problem(top_p) or seed_problem(seed)
        if why:
            raise ValueError(why)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.seed = int(seed)
        self._noise = collections.OrderedDict()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __call__(self, logits: np.ndarray, position: int) -> int:
        """The token at ``position`` (0-based in the sequence) given its logits row."""
        logits = np.asarray(logits, dtype=np.float64)
        if self.greedy:
            return int(np.argmax(logits))
        z = logits / self.temperature
        if self.top_p < 1.0:
            p = np.exp(z - z.max())
            p /= p.sum()
            order = np.lexsort((np.arange(p.size), -p))
            cum = np.cumsum(p[order])
            cand = order[:int(np.searchsorted(cum, self.top_p * cum[-1]) + 1)]
        else:
            cand = np.arange(z.size)
        score = z[cand] + self.noise(position, z.size)[cand]
        return int(cand[int(np.argmax(score))])

    def noise(self, position: int, n: int) -> np.ndarray:
        """Gumbel noise of ``position`` for ids 0..n-1: -log(-log(u)), u uniform in (0, 1)
        from PCG64 seeded by (seed, position)."""
        key = (int(position), n)
        g = self._noise.get(key)
        if g is None:
            u = np.random.Generator(np.random.PCG64([self.seed, int(position)])).random(n)
            with np.errstate(divide="ignore"):
                g = -np.log(-np.log(u))               # u = 0 gives -inf: never chosen
            self._noise[key] = g
            if len(self._noise) > NOISE_KEPT:
                self._noise.popitem(last=False)
        else:
            self._noise.move_to_end(key)
        return g
