"""Building blocks of the Stable LatentMoE body (model.md §5.7, §5.8).

Owns: ``situ_mlp`` (W_down . SiTU(W_gate x, W_up x) with dense BF16 or f32 weights: the
dense layer-0 MLP, the fused shared expert, f32 test experts), ``expert_mxfp4`` (the same
for one packed routed expert), ``combine_routed`` (u = sum_j w_j e_j in selection order).
Does not own: routing (``router.py``), fetching experts (``libk3.stream``), the
routed_expert_norm / up-projection / shared-path sum (composed in ``libk3.model``).

The first two are plain Python compositions of the numba kernels (they allocate their
small intermediates per call: [T, 3072] at most for an expert); every row of every
matrix runs inside numba, Python only loops over the selected experts. Bit-identity of
prefill and decode carries over from ``bf16.matmul`` / ``mxfp4.matmul``.

Why ``combine_routed`` takes all k expert outputs at once: a prefill that runs each
expert over the tokens routed to it finishes experts in expert order, not in each token's
selection order. Keeping e_j per (token, pick) and summing afterwards keeps the f32
accumulation order of model.md §7.2 (selection order) whatever order experts were computed in.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import activations, bf16, mxfp4


def situ_mlp(w_gate, w_up, w_down, x, beta1, beta2, out):
    """out = W_down . SiTU(W_gate x, W_up x) for each row of x.

    w_gate, w_up: [F, D]; w_down: [D_out, F]; uint16 BF16 bits or float32.
    x: [T, D] float32. out: [T, D_out] float32, written. Returns out."""
    T = x.shape[0]
    F = w_gate.shape[0]
    g = np.empty((T, F), dtype=np.float32)
    u = np.empty((T, F), dtype=np.float32)
    bf16.matmul(w_gate, x, g)
    bf16.matmul(w_up, x, u)
    a = g.reshape(-1)
    activations.situ(a, u.reshape(-1), beta1, beta2, a)
    bf16.matmul(w_down, g, out)
    return out


def expert_mxfp4(w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                 z, beta1, beta2, out):
    """out = W2 . SiTU(W1 z, W3 z) for one MXFP4 routed expert (w1 gate, w3 up, w2 down).

    w1/w3: packed [F, L/2] + scales [F, L/32]; w2: packed [L, F/2] + scales [L, F/32]
    (uint8). z: [T, L] float32, the latent of the tokens routed here. out: [T, L]
    float32, written. Returns out."""
    T = z.shape[0]
    F = w1_packed.shape[0]
    g = np.empty((T, F), dtype=np.float32)
    u = np.empty((T, F), dtype=np.float32)
    mxfp4.matmul(w1_packed, w1_scale, z, g)
    mxfp4.matmul(w3_packed, w3_scale, z, u)
    a = g.reshape(-1)
    activations.situ(a, u.reshape(-1), beta1, beta2, a)
    mxfp4.matmul(w2_packed, w2_scale, g, out)
    return out


@njit(cache=True, parallel=True)
def combine_routed(expert_out, weights, out):
    """out[t, i] = sum_j weights[t, j] * expert_out[t, j, i], f32, from +0, j = 0..k-1
    (selection order). expert_out: [T, k, L] float32; weights: [T, k] float32 (router
    output); out: [T, L] float32, written. model.md §5.8 step 5.
    Must not become: an accumulation in expert-id or completion order, or f64."""
    T, k, L = expert_out.shape
    if weights.shape[0] != T or weights.shape[1] != k or out.shape[0] != T or out.shape[1] != L:
        raise ValueError("combine_routed: expert_out [T, k, L], weights [T, k], out [T, L]")
    for t in prange(T):
        o = out[t]
        for i in range(L):
            o[i] = np.float32(0.0)
        for j in range(k):
            wj = weights[t, j]
            e = expert_out[t, j]
            for i in range(L):
                o[i] += wj * e[i]
