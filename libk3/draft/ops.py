"""Allocating wrappers over the out-parameter kernels the draft's forward pass calls.

Owns: output allocation and reshaping for the kernels only the draft uses
(``rope_interleaved``, ``silu_mul``, ``logistic_unit``); the rest are the target's wrappers
(``libk3.model.ops``), re-exported so ``forward.py`` reads ``K.op(...)`` throughout.
Does not own: any arithmetic (``libk3.kernels``).
"""

from __future__ import annotations

import numpy as np

from ..kernels import activations, logistic, rope as _rope
from ..model.ops import bf16_matmul, mla_attention, rmsnorm  # noqa: F401 (re-exported)


def _c(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def rope(x, positions, inv_freq, amplitude):
    """x (T, H, rope) or (T, rope) rotated in interleaved pairs, row t at positions[t]
    (dspark.md §5.4); the same shape back."""
    x = _c(x)
    x3 = x.reshape(x.shape[0], -1, x.shape[-1])
    out = np.empty_like(x3)
    _rope.rope_interleaved(x3, np.ascontiguousarray(positions, np.int64),
                           np.ascontiguousarray(inv_freq, np.float64), float(amplitude), out)
    return out.reshape(x.shape)


def silu_mul(gate, up):
    """SiLU(gate) * up, elementwise, for (T, n) float32 arrays."""
    gate, up = _c(gate), _c(up)
    out = np.empty_like(gate)
    activations.silu_mul(gate.reshape(-1), up.reshape(-1), out.reshape(-1))
    return out


def logistic_unit(w, x, bias) -> float:
    """sigmoid(w . x + bias) in float64 for one weight row w (float32 or BF16 bits)."""
    return float(logistic.logistic_unit(w, _c(x), float(bias)))
