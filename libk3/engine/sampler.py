"""Choosing the next token from logits: greedy or seeded temperature/top-p sampling.

Owns: the decision rule only. Greedy is the first index of the maximum logit (model.md §5.9).
Sampling is deterministic for a seed: float64 softmax of logits/temperature, candidates
sorted by (probability descending, id ascending), the smallest prefix whose mass reaches
top_p, one uniform draw from ``numpy.random.Generator(PCG64(seed))`` per step. Also owns
the rules for those three settings (``temperature_problem`` and friends), which the
options and batch lines apply before any run.

Why temperatures in (0, 2^-126) are refused: logits are float32 (|logit| < 2^128), so for
T >= 2^-126, the smallest normal float32, logits / T stays below 2^254 and the float64
softmax is exact; a smaller T (e.g. the subnormal 1e-320) overflows to inf, and
inf - inf makes every probability NaN.
"""

from __future__ import annotations

import math

import numpy as np

MIN_TEMPERATURE = 2.0 ** -126
SEED_LIMIT = 2 ** 64                 # seeds are 0 .. 2^64 - 1


def _number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def temperature_problem(t) -> str | None:
    """Why ``t`` is not a temperature (0 = greedy, or finite and >= 2^-126), or None."""
    if _number(t) and math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE):
        return None
    return f"temperature must be 0 (greedy) or a finite number >= 2^-126, got {t!r}"


def top_p_problem(p) -> str | None:
    """Why ``p`` is not a top-p mass in (0, 1], or None."""
    if _number(p) and math.isfinite(p) and 0 < p <= 1:
        return None
    return f"top_p must be a number in (0, 1], got {p!r}"


def seed_problem(s) -> str | None:
    """Why ``s`` is not a seed (an integer 0 .. 2^64 - 1), or None."""
    if isinstance(s, (int, np.integer)) and not isinstance(s, bool) and 0 <= s < SEED_LIMIT:
        return None
    return f"seed must be an integer 0 .. 2^64 - 1, got {s!r}"


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
