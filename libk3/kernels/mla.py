"""Gated-MLA attention in the absorbed (latent) form over a latent cache (model.md §5.6).

Owns: ``mla_attention``: for each new query position, the per-head scores against the
cached normalised latents and raw k_rope, the causal softmax, the latent mix and the
W_UV expansion. Does not own: the projections and latent RMSNorm that fill the cache and
the queries, the output gate and o_proj (``bf16.py``, ``norms.py``, ``activations.py``,
composed in ``libk3.model``), the cache itself (the caller appends a position's latent
and k_rope BEFORE calling for that position).

WHY the absorbed form: the cache holds 576 floats per position (latent 512 + k_rope 64)
instead of 96 x 256 expanded k_nope | v: 43x less memory (model.md §6). W_UK folds into the
query (q_bar_h = W_UK_h^T q_nope_h); W_UV is applied after the mix.

Numerics (formats/model/numerics.md section 7), per new position t (absolute position p_t)
and head h, with W_UK_h = rows h*(nope+v) .. +nope of kv_b_proj and W_UV_h the next v rows:
  q_bar[c] = f32( f64 sum_d widen(W_UK_h[d, c]) * q_nope[d] )   (sequential in d)
  score(s) = f32( dot16(latent[s], q_bar) + dot16(k_rope[s], q_rope) ) * f32(scale)
             (two fixed-order f64 dots, latent part first, added in f64, one rounding,
             then the f32 multiply), for s = 0..p_t (causal)
  e_s = expf(score(s) - max), z = f64 sum_s e_s (increasing s), p_s = f32(e_s / z)
  a_bar[c] = sum_s p_s * latent[s, c]   (f32, from +0, increasing s)
  out[j]   = f32( dot16(W_UV_h[j], a_bar) )
A position's result depends only on its query and cache rows 0..p_t, so prefill of T
positions and T single-position decode calls give identical bits. Heads run in
parallel in groups of four that share each cache-row load (``dot16_x4``, with the
queries widened to f64 once; bench/README.md, "Arithmetic"); positions and sums never split across threads. Each score keeps dot16's order
whichever operand is passed as w: the products are exact and commute.
"""

from __future__ import annotations


import numpy as np
from numba import njit, prange

from . import team

from ._dot import dot16, dot16_x4
from ._simd import widen_f32
from .activations import softmax_f32


@njit(cache=True, parallel=True)
def mla_attention(q_nope, q_rope, positions, latent, k_rope, kv_b, scale, out):
    """Causal MLA attention of T new positions over a latent cache (absorbed form).

    q_nope: [T, H, nope] float32. q_rope: [T, H, rope] float32 (K3: never rotated).
    positions: [T] int64, the absolute position of each query; cache rows 0..p are
    attended (p <= Tc - 1). latent: [Tc, r] float32, C-contiguous, RMS-normalised
    latents. k_rope: [Tc, rope] float32, C-contiguous, used as given (K3: raw, neither
    normalised nor rotated; the DSpark draft passes q_rope and k_rope already rotated).
    kv_b: [H * (nope + v), r] uint16 BF16 bits or float32 (kv_b_proj; per head nope
    W_UK rows then v W_UV rows). scale: float, (nope + rope)^-0.5 (192^-0.5 in K3).
    out: [T, H, v] float32, written.
    Must not become: scale over nope only, k_rope rotated or normalised in here, per-head
    key slices, attention to positions after p_t, different arithmetic in prefill and
    decode."""
    T, H, nope = q_nope.shape
    rope = q_rope.shape[2]
    Tc, r = latent.shape
    v = out.shape[2]
    if q_rope.shape[0] != T or q_rope.shape[1] != H or positions.shape[0] != T \
            or k_rope.shape[0] != Tc or k_rope.shape[1] != rope \
            or kv_b.shape[0] != H * (nope + v) or kv_b.shape[1] != r \
            or out.shape[0] != T or out.shape[1] != H:
        raise ValueError("mla_attention: q_nope [T, H, nope], q_rope [T, H, rope], "
                         "latent [Tc, r], k_rope [Tc, rope], kv_b [H*(nope+v), r], out [T, H, v]")
    for t in range(T):
        if positions[t] < 0 or positions[t] >= Tc:
            raise ValueError("mla_attention: a position lies outside the cache")
    sc = np.float32(scale)
    zero = np.float32(0.0)
    span = positions[T - 1] + 1 if T > 0 else 0        # cache rows the last query reads
    nt = team.narrow(T * (kv_b.nbytes + H * span * (r + rope) * 8))
    for grp in prange((H + 3) // 4):
        # Four heads per task share every cache-row load (dot16_x4). A short last group
        # repeats its last head; the repeat is computed and never written.
        hs = (min(4 * grp, H - 1), min(4 * grp + 1, H - 1),
              min(4 * grp + 2, H - 1), min(4 * grp + 3, H - 1))
        qb64 = np.empty(r, dtype=np.float64)
        qbar = np.empty((4, r), dtype=np.float64)      # f32-rounded values, held as f64
        qr = np.empty((4, rope), dtype=np.float64)     # (widened once, reused Tc times)
        abar = np.empty((4, r), dtype=np.float32)
        prob = np.empty((4, Tc), dtype=np.float32)
        for t in range(T):
            for i in range(4):
                row0 = hs[i] * (nope + v)
                for c in range(r):
                    qb64[c] = 0.0
                for d in range(nope):
                    wk = kv_b[row0 + d]
                    qd = np.float64(q_nope[t, hs[i], d])
                    for c in range(r):
                        qb64[c] += np.float64(widen_f32(wk[c])) * qd
                for c in range(r):
                    qbar[i, c] = np.float64(np.float32(qb64[c]))
                for c in range(rope):
                    qr[i, c] = np.float64(q_rope[t, hs[i], c])
            n = positions[t] + 1
            for s in range(n):
                a0, a1, a2, a3 = dot16_x4(qbar[0], qbar[1], qbar[2], qbar[3], latent[s])
                b0, b1, b2, b3 = dot16_x4(qr[0], qr[1], qr[2], qr[3], k_rope[s])
                prob[0, s] = np.float32(a0 + b0) * sc
                prob[1, s] = np.float32(a1 + b1) * sc
                prob[2, s] = np.float32(a2 + b2) * sc
                prob[3, s] = np.float32(a3 + b3) * sc
            for i in range(4):
                softmax_f32(prob[i], n)
                for c in range(r):
                    abar[i, c] = zero
            for s in range(n):
                ls = latent[s]
                for i in range(4):
                    ps = prob[i, s]
                    ab = abar[i]
                    for c in range(r):
                        ab[c] += ps * ls[c]
            for i in range(4):
                if 4 * grp + i < H:
                    row0 = hs[i] * (nope + v) + nope
                    for j in range(v):
                        out[t, hs[i], j] = np.float32(dot16(kv_b[row0 + j], abar[i]))
    team.widen(nt)
