"""The sigmoid top-k router of the LatentMoE (model.md §5.8 steps 1-3).

Owns: turning router logits into (expert ids, weights) per token. Does not own: the
logits themselves (``bf16.matvec`` of the full-width x with ``gate.weight``), the experts.

Traps: the correction bias steers SELECTION only; the weights come from the UNBIASED
sigmoid scores. Ties go to the lowest index (repeated arg-max with strict >), and ids are
listed in descending biased score. Renormalisation sums in f64 (model.md §7.2).

Selection without marking picks: pick j is the arg-max of biased scores among experts
that come strictly after pick j-1 in the order (score descending, index ascending), i.e.
b[e] < b[prev] or (b[e] == b[prev] and e > prev). That is exactly the repeated arg-max
with the previous picks masked out (O(k * N), 16 x 896 per token).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import team

from ..config import ROUTER_RENORM_EPS
from .activations import sigmoid1


@njit(cache=True, parallel=True)
def router_topk(logits, bias, top_k, renormalize, scaling, idx_out, w_out):
    """Sigmoid scores, biased top-k selection, unbiased renormalised weights.

    logits: [T, N] float32. bias: [N] float32 (e_score_correction_bias). top_k: int <= N.
    renormalize: bool (moe_renormalize). scaling: float (routed_scaling_factor).
    idx_out: [T, top_k] int64, written, descending biased score, ties to lowest id.
    w_out: [T, top_k] float32, written, aligned with idx_out:
      s = f32 sigmoid(logits); w_j = s[idx_j];
      if renormalize: inv = f32(1 / (f64 sum_j w_j (in pick order) + 1e-20)); w_j = w_j * inv;
      w_j = w_j * f32(scaling).
    Must not become: selection on unbiased scores, weights from biased scores, softmax
    instead of sigmoid, ties to the highest index, a missing renormalisation."""
    T, N = logits.shape
    if bias.shape[0] != N or top_k < 1 or top_k > N or idx_out.shape[0] != T \
            or idx_out.shape[1] != top_k or w_out.shape[0] != T or w_out.shape[1] != top_k:
        raise ValueError("router_topk: logits [T, N], bias [N], idx_out and w_out [T, top_k]")
    sc = np.float32(scaling)
    biased = np.empty((T, N), dtype=np.float32)
    nt = team.narrow(T * N * team.TRANSCENDENTAL)
    for t in prange(T):
        for e in range(N):
            biased[t, e] = sigmoid1(logits[t, e]) + bias[e]
        prev = -1
        prev_b = np.float32(0.0)
        for j in range(top_k):
            best = -1
            best_b = np.float32(0.0)
            for e in range(N):
                b = biased[t, e]
                if prev >= 0 and not (b < prev_b or (b == prev_b and e > prev)):
                    continue
                if best < 0 or b > best_b:
                    best = e
                    best_b = b
            idx_out[t, j] = best
            w_out[t, j] = sigmoid1(logits[t, best])
            prev = best
            prev_b = best_b
        if renormalize:
            total = 0.0
            for j in range(top_k):
                total += np.float64(w_out[t, j])
            inv = np.float32(1.0 / (total + ROUTER_RENORM_EPS))
            for j in range(top_k):
                w_out[t, j] = w_out[t, j] * inv
        for j in range(top_k):
            w_out[t, j] = w_out[t, j] * sc
    team.widen(nt)
