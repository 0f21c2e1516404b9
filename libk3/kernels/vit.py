"""The image tower's attention: the 2D rotary split into heads and the bidirectional
attention over all patches of one image (formats/model/vision.md §5.3, §5.4).

Owns: ``split_heads`` (one third of the ``wqkv`` output, rotated or not, laid out head by
head) and ``attention`` (softmax(q kᵀ · scale) v per head, no mask). Does not own: the
rotation angles (``libk3.model.vision`` computes them once per image, vision.md §5.3),
the projections, norms and MLP (``bf16.py``, ``norms.py``, ``activations.py``).

WHY not ``rope.rope_interleaved``: its angle is position × frequency in float64, one
position per row; the tower turns pair 2i by the patch's column and pair 2i + 1 by its
row, with float32 angles (the release's), so the per-patch cos and sin come in as tables.
WHY not ``mla.mla_attention``: that one is causal over a latent cache; here every patch
sees every patch of its image and keys are plain per-head vectors.

Numerics (formats/model/vision.md §7.2, formats/model/numerics.md section 13): scores are ``dot16``
sums (numerics.md section 2) of the float32 q and k, rounded once, times f32(scale);
``softmax_f32`` (numerics.md section 5); the mix a[j] = f32(sum over keys s in increasing
order of f64(p_s) · f64(v[s, j])). Tasks are (head, QUERIES queries); sums never split,
so results are identical at any thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import team
from ._dot import dot16_x4
from .activations import softmax_f32

# Queries per task (a multiple of 4): each key and value row is read once for all of them.
QUERIES = 16


@njit(cache=True, parallel=True)
def split_heads(qkv, part, cos, sin, rotate, out):
    """out[h, l, :] = rotated slice ``part`` (0 q, 1 k, 2 v) of qkv[l] for head h.

    qkv: [L, 3 Q] float32 (the ``wqkv`` output, q | k | v, head h at columns hd h … of each).
    cos, sin: [L, hd / 2] float32, pair k of patch l turns by the angle whose cos and sin
    they hold (vision.md §5.3). rotate: False copies (v). out: [H, L, hd] float32, written.
    For pair k, a = x[2k], b = x[2k + 1]: out[2k] = f32(f32(a c) − f32(b s)),
    out[2k + 1] = f32(f32(a s) + f32(b c)) (formats/model/numerics.md section 10 step 3).
    Must not become: half-split pairs, or the row and column angles swapped (the caller's
    table decides which pair is which; this kernel only pairs neighbours)."""
    H, L, hd = out.shape
    half = hd // 2
    Q = H * hd
    if qkv.shape[0] != L or qkv.shape[1] != 3 * Q or cos.shape[0] != L \
            or cos.shape[1] != half or sin.shape[0] != L or sin.shape[1] != half:
        raise ValueError("split_heads: qkv [L, 3 H hd], cos and sin [L, hd / 2], out [H, L, hd]")
    base = part * Q
    nt = team.narrow(L * Q * 4)
    for row in prange(H * L):
        h = row // L
        l = row - h * L
        src = base + h * hd
        if rotate:
            for k in range(half):
                a = qkv[l, src + 2 * k]
                b = qkv[l, src + 2 * k + 1]
                c = cos[l, k]
                s = sin[l, k]
                out[h, l, 2 * k] = a * c - b * s
                out[h, l, 2 * k + 1] = a * s + b * c
        else:
            for j in range(hd):
                out[h, l, j] = qkv[l, src + j]
    team.widen(nt)


@njit(cache=True, parallel=True)
def attention(q, k, v, scale, out):
    """Bidirectional attention of every query over every key of its head.

    q, k, v: [H, L, hd] float32, C-contiguous. scale: float, 1 / sqrt(hd).
    out: [L, H hd] float32, written (head h at columns h hd …, the ``wo`` input order).
    Per (h, query l): score_s = f32(dot16(q[h, l], k[h, s])) · f32(scale) for s = 0 … L − 1;
    p = softmax_f32(score); out[l, h hd + j] = f32(Σ_s f64(p_s) f64(v[h, s, j])), s increasing.
    Must not become: a causal mask, a float32 mix over thousands of keys, an L × L score
    matrix per head (15 GB at the largest grid), or sums split across threads."""
    H, L, hd = q.shape
    if k.shape[0] != H or k.shape[1] != L or k.shape[2] != hd or v.shape[0] != H \
            or v.shape[1] != L or v.shape[2] != hd or out.shape[0] != L \
            or out.shape[1] != H * hd:
        raise ValueError("attention: q, k, v are [H, L, hd] and out [L, H hd]")
    sc = np.float32(scale)
    blocks = (L + QUERIES - 1) // QUERIES
    nt = team.narrow(H * L * L * hd * 4)
    for task in prange(H * blocks):
        h = task // blocks
        l0 = QUERIES * (task - h * blocks)
        # A short last block repeats its last query; the repeat is computed, never written.
        ls = np.empty(QUERIES, dtype=np.int64)
        for i in range(QUERIES):
            ls[i] = min(l0 + i, L - 1)
        qw = np.empty((QUERIES, hd), dtype=np.float64)          # queries widened once
        prob = np.empty((QUERIES, L), dtype=np.float32)
        acc = np.zeros((QUERIES, hd), dtype=np.float64)
        for i in range(QUERIES):
            for j in range(hd):
                qw[i, j] = np.float64(q[h, ls[i], j])
        kh = k[h]
        for s in range(L):
            ks = kh[s]
            for g in range(0, QUERIES, 4):
                a0, a1, a2, a3 = dot16_x4(qw[g], qw[g + 1], qw[g + 2], qw[g + 3], ks)
                prob[g, s] = np.float32(a0) * sc
                prob[g + 1, s] = np.float32(a1) * sc
                prob[g + 2, s] = np.float32(a2) * sc
                prob[g + 3, s] = np.float32(a3) * sc
        for i in range(QUERIES):
            softmax_f32(prob[i], L)
        # Four keys per pass over each accumulator row (the same additions in the same
        # order, s increasing): a quarter of the accumulator loads and stores.
        vh = v[h]
        L4 = L - L % 4
        for s in range(0, L4, 4):
            v0, v1, v2, v3 = vh[s], vh[s + 1], vh[s + 2], vh[s + 3]
            for i in range(QUERIES):
                pr = prob[i]
                p0, p1 = np.float64(pr[s]), np.float64(pr[s + 1])
                p2, p3 = np.float64(pr[s + 2]), np.float64(pr[s + 3])
                ai = acc[i]
                for j in range(hd):
                    ai[j] = (((ai[j] + p0 * np.float64(v0[j])) + p1 * np.float64(v1[j]))
                             + p2 * np.float64(v2[j])) + p3 * np.float64(v3[j])
        for s in range(L4, L):
            vs = vh[s]
            for i in range(QUERIES):
                p = np.float64(prob[i, s])
                ai = acc[i]
                for j in range(hd):
                    ai[j] += p * np.float64(vs[j])
        for i in range(QUERIES):
            if l0 + i < L:
                for j in range(hd):
                    out[ls[i], h * hd + j] = np.float32(acc[i, j])
    team.widen(nt)
