"""Predicting a MoE layer's experts one layer early, so their reads can start sooner.

Owns: ``predict_experts``: layer L's router (model.md §5.8 steps 1-3: its gate weight,
its e_score_correction_bias, the same sigmoid biased top-k selection) applied to
rmsnorm(AttnRes(blocks + [prefix], layer L's mlp_res vectors), layer L's
post_attention_layernorm) (model.md §5.2, §5.3), where blocks and prefix are the
completed AttnRes blocks and the running block sum after layer L - 1's attention
sublayer, before its MLP or MoE (the forward asks right after it has started layer L - 1's
expert reads, so the guesses queue behind them and land while L - 1's experts and L's
attention compute). Does not own: reading the guessed experts (``libk3.stream.experts``)
or what the layer computes with: the real router decides, so a wrong guess costs bytes,
never a different value.

Why this input: it is how layer L forms its router's input, short of the two terms not
known yet (layer L - 1's MLP/MoE output and layer L's attention output, both added to the
running sum), and every weight it needs is layer L's own, held with the trunk. Asking a
sublayer earlier than layer L - 1's output gives the reads that much more time to land.
"""

from __future__ import annotations

import numpy as np

from . import ops as K
from ..config import K3Config


def predict_experts(cfg: K3Config, lw, blocks: list, prefix: np.ndarray):
    """(T, top_k) int64 expert ids layer L (weights ``lw``) is predicted to route each
    token to, best first, from the AttnRes ``blocks`` and the running sum ``prefix``
    (T, E) after layer L - 1's attention; None when the scores are not all finite (the real
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
