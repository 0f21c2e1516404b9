"""The rules for a generation request's settings: tokens to generate, temperature, top_p,
seed and token ids. Each ``*_problem`` returns why a value is refused, or None.

Owns: what values the options, batch lines and server requests accept (one rule each,
applied before any run). Imports neither numpy nor the model, so option parsing and
``--help`` stay light; numpy's scalar types are accepted through the
``numbers`` ABCs they register with.

Why temperatures in (0, 2^-126) are refused: logits are float32 (|logit| < 2^128), so for
T >= 2^-126, the smallest normal float32, logits / T stays below 2^254 and the float64
softmax is exact; a smaller T (e.g. the subnormal 1e-320) overflows to inf, and
inf - inf makes every probability NaN.
"""

from __future__ import annotations

import math
import numbers

from ..config import K3_CONTEXT as MAX_POSITIONS

MIN_TEMPERATURE = 2.0 ** -126
SEED_LIMIT = 2 ** 64                 # seeds are 0 .. 2^64 - 1


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def gen_problem(n) -> str | None:
    """Why ``n`` is not a number of tokens to generate (0 .. the trained context), or None."""
    if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_POSITIONS:
        return None
    return f"gen must be an integer 0 .. {MAX_POSITIONS:,} (the trained context), got {n!r}"


def token_ids_problem(ids, vocab_size: int) -> str | None:
    """Why ``ids`` is not a list (or tuple) of token ids 0 .. vocab_size - 1, or None."""
    if isinstance(ids, (list, tuple)) and all(type(i) is int and 0 <= i < vocab_size
                                              for i in ids):
        return None
    return f"token ids must be integers 0..{vocab_size - 1}, got {str(ids)[:60]}"


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
    if _integer(s) and 0 <= s < SEED_LIMIT:
        return None
    return f"seed must be an integer 0 .. 2^64 - 1, got {s!r}"
