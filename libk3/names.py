"""Every checkpoint key string k3 uses, built in one place (model.md §3.4).

Owns: the tensor-name templates and the tensor inventory per layer kind, for the language
model and for the image tower and projector (formats/model/vision.md §3). Does not own: shapes
(``libk3.io.inventory``) or reading.
"""

from __future__ import annotations

import re

PREFIX = "language_model.model."

EMBED = "language_model.model.embed_tokens.weight"
LM_HEAD = "language_model.lm_head.weight"
NORM = "language_model.model.norm.weight"
OUTPUT_ATTN_RES_NORM = "language_model.model.output_attn_res_norm.weight"
OUTPUT_ATTN_RES_PROJ = "language_model.model.output_attn_res_proj.weight"
MODEL_LEVEL = (EMBED, LM_HEAD, NORM, OUTPUT_ATTN_RES_NORM, OUTPUT_ATTN_RES_PROJ)

# Suffixes after ``layers.{L}.`` (model.md §3.4). Order is the order our synthetic writer lays
# them out in a layer's trunk run; readers never depend on it.
LAYER_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attention_res_norm.weight",
    "mlp_res_norm.weight",
    "self_attention_res_proj.weight",
    "mlp_res_proj.weight",
)
KDA = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight",
    "self_attn.f_a_proj.weight", "self_attn.f_b_proj.weight",
    "self_attn.A_log", "self_attn.dt_bias",
    "self_attn.b_proj.weight", "self_attn.g_proj.weight",
    "self_attn.o_norm.weight", "self_attn.o_proj.weight",
)
MLA = (
    "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
    "self_attn.kv_b_proj.weight", "self_attn.g_proj.weight", "self_attn.o_proj.weight",
)
DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
MOE = (
    "block_sparse_moe.gate.weight", "block_sparse_moe.gate.e_score_correction_bias",
    "block_sparse_moe.routed_expert_down_proj.weight",
    "block_sparse_moe.routed_expert_norm.weight",
    "block_sparse_moe.routed_expert_up_proj.weight",
    "block_sparse_moe.shared_experts.gate_proj.weight",
    "block_sparse_moe.shared_experts.up_proj.weight",
    "block_sparse_moe.shared_experts.down_proj.weight",
)
# The six tensors of one routed expert, in the order observed in the release (model.md §4.1).
EXPERT_PARTS = (
    ("w1", "weight_packed"), ("w1", "weight_scale"),
    ("w2", "weight_packed"), ("w2", "weight_scale"),
    ("w3", "weight_packed"), ("w3", "weight_scale"),
)


def layer_prefix(L: int) -> str:
    return f"language_model.model.layers.{L}."


def layer(L: int, suffix: str) -> str:
    """Full key of a per-layer tensor, e.g. ``layer(3, "self_attn.A_log")``."""
    return f"language_model.model.layers.{L}.{suffix}"


def expert(L: int, e: int, w: str, part: str) -> str:
    """Full key of one routed-expert tensor, e.g. ``expert(1, 0, "w1", "weight_packed")``."""
    return f"language_model.model.layers.{L}.block_sparse_moe.experts.{e}.{w}.{part}"


def expert_names(L: int, e: int) -> tuple[str, ...]:
    return tuple(expert(L, e, w, p) for w, p in EXPERT_PARTS)


# The image tower and projector (formats/model/vision.md §3): bare names, no ``language_model.``.
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
VISION_PATCH_EMBED = "vision_tower.patch_embed.proj.weight"
VISION_POS_EMB = "vision_tower.patch_embed.pos_emb.weight"
VISION_FINAL_NORM = "vision_tower.encoder.final_layernorm.weight"
# Suffixes after ``vision_tower.encoder.blocks.{b}.``, in the order the writer lays them out.
VISION_BLOCK = ("norm0.weight", "wqkv.weight", "wo.weight", "norm1.weight",
                "mlp.fc0.weight", "mlp.fc1.weight")
PROJECTOR_PROJ0 = "mm_projector.proj.0.weight"
PROJECTOR_PROJ2 = "mm_projector.proj.2.weight"
PROJECTOR_POST_NORM = "mm_projector.post_norm.weight"
PROJECTOR = (PROJECTOR_PROJ0, PROJECTOR_PROJ2, PROJECTOR_POST_NORM)


def vision_block(b: int, suffix: str) -> str:
    """Full key of a tower block tensor, e.g. ``vision_block(0, "wqkv.weight")``."""
    return f"vision_tower.encoder.blocks.{b}.{suffix}"


def is_vision(name: str) -> bool:
    """True for a tensor of the image tower or projector."""
    return name.startswith(VISION_PREFIXES)


_LAYER_RE = re.compile(r"^language_model\.model\.layers\.(\d+)\.(.*)$")
_EXPERT_RE = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight_packed|weight_scale)$")


def parse_layer_key(name: str):
    """(L, suffix) for a per-layer key, else None."""
    m = _LAYER_RE.match(name)
    if not m:
        return None
    return int(m.group(1)), m.group(2)


def parse_expert_suffix(suffix: str):
    """(e, w, part) when a layer suffix names a routed-expert tensor, else None."""
    m = _EXPERT_RE.match(suffix)
    if not m:
        return None
    return int(m.group(1)), m.group(2), m.group(3)
