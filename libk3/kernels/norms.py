"""Row-wise RMSNorm and L2Norm (model.md §5.0, §7.2).

Owns: ``rmsnorm`` (with gain: layer norms, final norm, KDA ``o_norm``, MLA latent norms,
``routed_expert_norm``), ``l2norm`` (KDA q, k). The AttnRes key norm (no gain) is
inlined in ``attnres.py``.
All work on a 2-D [rows, n] float32 array; a per-head norm is the same call on the
[T * H, D] view of a [T, H * D] array. Does not own: which eps a norm uses (the caller
passes ``rms_norm_eps``, ``MLA_LATENT_NORM_EPS`` or ``L2NORM_EPS`` from ``libk3.config``).

Numerics (formats/model/numerics.md section 4): ss = sum of f64(x_i)^2 sequentially in
increasing i; inv = f32(1 / sqrt(ss / n + eps)) computed in f64 (eps taken as the f64 value
of the Python float); y_i = f32(f32(w_i * x_i) * inv). Rows are independent, so ``prange``
over rows keeps results identical at any thread count.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import team


@njit(cache=True, inline="always")
def _sumsq(x):
    ss = 0.0
    for i in range(x.shape[0]):
        v = np.float64(x[i])
        ss += v * v
    return ss


@njit(cache=True, parallel=True)
def rmsnorm(x, w, eps, out):
    """out[r, i] = (w[i] * x[r, i]) * f32(1 / sqrt(mean_i x[r, i]^2 + eps)).

    x, out: [rows, n] float32 (out may be x). w: [n] float32. eps: float. model.md §5.0.
    Must not become: eps outside the root, sum instead of mean, an f32 sum of squares,
    or w * (x * inv) (a different rounding from the contract's (w * x) * inv)."""
    rows, n = x.shape
    if w.shape[0] != n or out.shape[0] != rows or out.shape[1] != n:
        raise ValueError("rmsnorm: x, out are [rows, n] and w is [n]")
    nt = team.narrow(rows * n * 8)
    for r in prange(rows):
        inv = np.float32(1.0 / math.sqrt(_sumsq(x[r]) / n + eps))
        for i in range(n):
            out[r, i] = (w[i] * x[r, i]) * inv
    team.widen(nt)


@njit(cache=True, parallel=True)
def l2norm(x, eps, out):
    """out[r, i] = x[r, i] * f32(1 / sqrt(sum_i x[r, i]^2 + eps)); eps = L2NORM_EPS (1e-6).

    x, out: [rows, n] float32 (out may be x). model.md §5.0 (KDA q and k per head).
    Must not become: mean instead of sum (that is RMSNorm), eps outside the root."""
    rows, n = x.shape
    if out.shape[0] != rows or out.shape[1] != n:
        raise ValueError("l2norm: x, out are [rows, n]")
    nt = team.narrow(rows * n * 8)
    for r in prange(rows):
        inv = np.float32(1.0 / math.sqrt(_sumsq(x[r]) + eps))
        for i in range(n):
            out[r, i] = x[r, i] * inv
    team.widen(nt)
