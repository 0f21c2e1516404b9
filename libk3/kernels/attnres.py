"""The AttnRes aggregator: a softmax-weighted mix of residual sources (model.md §5.2, §7.2).

Owns: ``attnres``, one aggregation over the sources (completed block snapshots oldest
first, then the running partial sum) for T independent tokens. Does not own: the
bookkeeping of which sources exist (model.md §5.3, ``libk3.model``), folding the gain and
projection into f (done once at load, in f32, by the caller).

Numerics (formats/model/numerics.md section 6), per token:
  key_s[i] = f32(v_s[i] * inv_s), inv_s = f32(1 / sqrt(f64 sum_i v_s[i]^2 / E + eps))
  score_s  = f32(f64 sum_i f64(key_s[i]) * f64(f[i]))        (sequential in i)
  e_s = expf(score_s - max_s score_s) (f32); z = f64 sum_s e_s; p_s = f32(e_s / z)
  out[i]   = sum_s p_s * v_s[i], f32, from +0, sources in order.
Work is split over (token, source) pairs for the scores and over (token, 1024-element
chunk) for the mix, so one decode token still uses every thread; no single sum is split.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import team

from .activations import softmax_f32

_CHUNK = 1024


@njit(cache=True, inline="always")
def _source(blocks, n_blocks, prefix, s, t):
    """Row t of source s: blocks[s] for s < n_blocks, else the partial sum."""
    if s < n_blocks:
        return blocks[s, t]
    return prefix[t]


@njit(cache=True, parallel=True)
def attnres(blocks, n_blocks, prefix, f, eps, out):
    """out[t] = sum_s softmax_s((v_s[t] / rms(v_s[t])) . f) * v_s[t].

    blocks: [>= n_blocks, T, E] float32, snapshots oldest first. n_blocks: int >= 0.
    prefix: [T, E] float32, the running partial sum (always the last source).
    f: [E] float32, norm gain * projection (folded in f32). eps: rms_norm_eps.
    out: [T, E] float32, written (must not alias a source).
    Must not become: a mix of the normalised keys instead of the raw sources (off by
    ~0.2 on attnres.json), the gain applied to the values, sum instead of mean in the
    key norm, an emptiness guard that drops the partial sum."""
    T, E = prefix.shape
    S = n_blocks + 1
    if n_blocks < 0 or (n_blocks > 0 and (blocks.shape[0] < n_blocks or blocks.shape[1] != T
                                          or blocks.shape[2] != E)) \
            or f.shape[0] != E or out.shape[0] != T or out.shape[1] != E:
        raise ValueError("attnres: blocks [>=n_blocks, T, E], prefix and out [T, E], f [E]")
    scores = np.empty((T, S), dtype=np.float32)
    nt = team.narrow(T * S * E * 8)
    for ts in prange(T * S):
        t = ts // S
        s = ts % S
        v = _source(blocks, n_blocks, prefix, s, t)
        ss = 0.0
        for i in range(E):
            x = np.float64(v[i])
            ss += x * x
        inv = np.float32(1.0 / math.sqrt(ss / E + eps))
        acc = 0.0
        for i in range(E):
            acc += np.float64(v[i] * inv) * np.float64(f[i])
        scores[t, s] = np.float32(acc)
    p = scores
    for t in range(T):
        softmax_f32(p[t], S)
    chunks = (E + _CHUNK - 1) // _CHUNK
    for tc in prange(T * chunks):
        t = tc // chunks
        lo = (tc % chunks) * _CHUNK
        hi = min(lo + _CHUNK, E)
        o = out[t]
        for i in range(lo, hi):
            o[i] = np.float32(0.0)
        for s in range(S):
            v = _source(blocks, n_blocks, prefix, s, t)
            ps = p[t, s]
            for i in range(lo, hi):
                o[i] += ps * v[i]
    team.widen(nt)
