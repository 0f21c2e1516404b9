"""Predicting a MoE layer's experts one layer early, so their reads can start sooner.

Owns: ``predict_experts``: layer L's router (model.md §5.8 steps 1-3: its gate weight,
its e_score_correction_bias, the same sigmoid biased top-k selection) applied to
rmsnorm(AttnRes(blocks + [prefix], layer L's mlp_res vectors), layer L's
post_attention_layernorm) (model.md §5.2, §5.3), where blocks and prefix are the
completed AttnRes blocks and the running block sum as they leave layer L - 1 (its output,
after its residual). Does not own: reading the guessed experts (``libk3.stream.experts``)
or what the layer computes with: the real router decides, so a wrong guess costs bytes,
never a different value.

Why this input: it is how layer L forms its router's input, short of the one term not
known yet (its own attention output, added to the running sum), and every weight it
needs is layer L's own, held with the trunk.
"""

from __future__ import annotations

import numpy as np

from . import ops as K
from ..config import K3Config


def predict_experts(cfg: K3Config, lw, blocks: list, prefix: np.ndarray):
    """(T, top_k) int64 expert ids layer L (weights ``lw``) is predicted to route each
    token to, best first, from the AttnRes ``blocks`` and the running sum ``prefix``
    (T, E) that leave layer L - 1; None when the scores are not all finite (the real
    router refuses those itself)."""
    eps = cfg.rms_norm_eps
    x = K.attn_res(blocks + [prefix], K.fold_attn_res(lw["mlp_res_norm.weight"],
                   lw["mlp_res_proj.weight"]), eps)
    h = K.rmsnorm(x, lw["post_attention_layernorm.weight"], eps)
    logits = K.bf16_matmul(lw["block_sparse_moe.gate.weight"], h)
    bias = lw["block_sparse_moe.gate.e_score_correction_bias"]
    if not (np.isfinite(logits).all() and np.isfinite(bias).all()):
        return None
    ids, _ = K.route(logits, bias, cfg.num_experts_per_token, cfg.moe_renormalize,
                     cfg.routed_scaling_factor)
    return ids


def ranked(ids: np.ndarray) -> np.ndarray:
    """The distinct ids of a (T, k) prediction, most tokens first, then first use (token
    order, each token's best first): what a capped read-ahead takes first."""
    flat = ids.reshape(-1)
    flat = flat[flat >= 0]
    uniq, first, counts = np.unique(flat, return_index=True, return_counts=True)
    return uniq[np.lexsort((first, -counts))]
