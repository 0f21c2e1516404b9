"""The routed combine of the Stable LatentMoE (model.md §5.8 step 5).

Owns: ``combine_routed`` (u = sum_j w_j e_j in selection order). Does not own: routing
(``router.py``), the expert MLPs (composed from ``bf16`` / ``mxfp4`` matmuls and
``activations.situ`` in ``libk3.model.forward``), fetching experts (``libk3.stream``), the
routed_expert_norm / up-projection / shared-path sum (``libk3.model.forward``).

Why ``combine_routed`` takes all k expert outputs at once: a prefill that runs each
expert over the tokens routed to it finishes experts in expert order, not in each token's
selection order. Keeping e_j per (token, pick) and summing afterwards keeps the f32
accumulation order of model.md §7.2 (selection order) whatever order experts were computed in.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import team


@njit(cache=True, parallel=True)
def combine_routed(expert_out, weights, out):
    """out[t, i] = sum_j weights[t, j] * expert_out[t, j, i], f32, from +0, j = 0..k-1
    (selection order). expert_out: [T, k, L] float32; weights: [T, k] float32 (router
    output); out: [T, L] float32, written. model.md §5.8 step 5.
    Must not become: an accumulation in expert-id or completion order, or f64."""
    T, k, L = expert_out.shape
    if weights.shape[0] != T or weights.shape[1] != k or out.shape[0] != T or out.shape[1] != L:
        raise ValueError("combine_routed: expert_out [T, k, L], weights [T, k], out [T, L]")
    nt = team.narrow(T * k * L * 8)
    for t in prange(T):
        o = out[t]
        for i in range(L):
            o[i] = np.float32(0.0)
        for j in range(k):
            wj = weights[t, j]
            e = expert_out[t, j]
            for i in range(L):
                o[i] += wj * e[i]
    team.widen(nt)
