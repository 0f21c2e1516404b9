"""What tensors a K3 checkpoint must hold, with their shapes and allowed dtypes.

Owns: the expected inventory derived from a config (model.md §3.4 and §4.1): every
model-level, trunk and routed-expert tensor, its shape and the dtypes k3 accepts; and the
168-tensor inventory of the image tower and projector derived from a ``VisionConfig``
(formats/model/vision.md §3) with the check of a checkpoint's image tensors against it (every
name present with its exact shape and a float dtype, nothing else under
``vision_tower.`` or ``mm_projector.``; the float dtypes are the language model's, for
the same reason). Does not own: reading headers (``libk3.io.safetensors``,
``libk3.io.checkpoint``) or choosing dtypes for synthetic files (``libk3.synth``).

Every float tensor, matrix or vector, may be BF16, F16 or F32: the release stores
matrices as BF16, but safetensors allows any float dtype and other writers use F32 (the
public engine's test generator writes the router ``gate.weight`` as F32), so each is
computed with exactly the dtype its header gives (``libk3.io.dtypes.matrix_operand``).
Routed experts are MXFP4 (U8) only. A spec's ``kind`` says how the forward pass uses the
tensor: a MATRIX goes to the dense kernels, a VECTOR is widened to float32.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .. import names
from ..config import MXFP4_GROUP, K3Config
from ..errors import CheckpointError
from ..vision_config import VisionConfig

MATRIX, VECTOR, PACKED = "matrix", "vector", "packed"
FLOAT = ("BF16", "F16", "F32")
DTYPES = {MATRIX: FLOAT, VECTOR: FLOAT, PACKED: ("U8",)}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple
    kind: str          # MATRIX, VECTOR or PACKED

    @property
    def dtypes(self) -> tuple:
        """The dtypes a checkpoint may store this tensor in."""
        return DTYPES[self.kind]


def a_log_width(cfg: K3Config) -> int:
    """A_log is stored per head, zero-padded (real: 96 heads in a [128] vector). We accept
    any width >= num_heads; synth pads to max(num_heads, head_dim) like the release."""
    return max(cfg.num_heads, cfg.head_dim)


def model_level(cfg: K3Config) -> list:
    E, V = cfg.hidden_size, cfg.vocab_size
    return [
        TensorSpec(names.EMBED, (V, E), MATRIX),
        TensorSpec(names.LM_HEAD, (V, E), MATRIX),
        TensorSpec(names.NORM, (E,), VECTOR),
        TensorSpec(names.OUTPUT_ATTN_RES_NORM, (E,), VECTOR),
        TensorSpec(names.OUTPUT_ATTN_RES_PROJ, (1, E), VECTOR),
    ]


def _suffix_shapes(cfg: K3Config, L: int) -> dict:
    """suffix -> (shape, kind) for every trunk tensor of layer L."""
    E = cfg.hidden_size
    out = {
        "input_layernorm.weight": ((E,), VECTOR),
        "post_attention_layernorm.weight": ((E,), VECTOR),
        "self_attention_res_norm.weight": ((E,), VECTOR),
        "mlp_res_norm.weight": ((E,), VECTOR),
        "self_attention_res_proj.weight": ((1, E), VECTOR),
        "mlp_res_proj.weight": ((1, E), VECTOR),
    }
    if cfg.is_mla(L):
        H, qk, r_q, r_kv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
        out.update({
            "self_attn.q_a_proj.weight": ((r_q, E), MATRIX),
            "self_attn.q_a_layernorm.weight": ((r_q,), VECTOR),
            "self_attn.q_b_proj.weight": ((H * qk, r_q), MATRIX),
            "self_attn.kv_a_proj_with_mqa.weight": ((r_kv + cfg.qk_rope_head_dim, E), MATRIX),
            "self_attn.kv_a_layernorm.weight": ((r_kv,), VECTOR),
            "self_attn.kv_b_proj.weight": ((H * (cfg.qk_nope_head_dim + cfg.v_head_dim), r_kv), MATRIX),
            "self_attn.g_proj.weight": ((H * cfg.v_head_dim, E), MATRIX),
            "self_attn.o_proj.weight": ((E, H * cfg.v_head_dim), MATRIX),
        })
    else:
        P, H, D, K = cfg.kda_dim, cfg.num_heads, cfg.head_dim, cfg.short_conv_kernel_size
        out.update({
            "self_attn.q_proj.weight": ((P, E), MATRIX),
            "self_attn.k_proj.weight": ((P, E), MATRIX),
            "self_attn.v_proj.weight": ((P, E), MATRIX),
            "self_attn.q_conv1d.weight": ((P, 1, K), VECTOR),
            "self_attn.k_conv1d.weight": ((P, 1, K), VECTOR),
            "self_attn.v_conv1d.weight": ((P, 1, K), VECTOR),
            "self_attn.f_a_proj.weight": ((D, E), MATRIX),
            "self_attn.f_b_proj.weight": ((P, D), MATRIX),
            "self_attn.A_log": (None, VECTOR),   # (n,) with n >= num_heads, see a_log_width
            "self_attn.dt_bias": ((P,), VECTOR),
            "self_attn.b_proj.weight": ((H, E), MATRIX),
            "self_attn.g_proj.weight": ((P, E), MATRIX),
            "self_attn.o_norm.weight": ((D,), VECTOR),
            "self_attn.o_proj.weight": ((E, P), MATRIX),
        })
    if cfg.is_dense(L):
        I = cfg.intermediate_size
        out.update({
            "mlp.gate_proj.weight": ((I, E), MATRIX),
            "mlp.up_proj.weight": ((I, E), MATRIX),
            "mlp.down_proj.weight": ((E, I), MATRIX),
        })
    else:
        N, lat, S = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.shared_width
        out.update({
            "block_sparse_moe.gate.weight": ((N, E), MATRIX),
            "block_sparse_moe.gate.e_score_correction_bias": ((N,), VECTOR),
            "block_sparse_moe.routed_expert_down_proj.weight": ((lat, E), MATRIX),
            "block_sparse_moe.routed_expert_norm.weight": ((lat,), VECTOR),
            "block_sparse_moe.routed_expert_up_proj.weight": ((E, lat), MATRIX),
        })
        if cfg.num_shared_experts > 0:
            out.update({
                "block_sparse_moe.shared_experts.gate_proj.weight": ((S, E), MATRIX),
                "block_sparse_moe.shared_experts.up_proj.weight": ((S, E), MATRIX),
                "block_sparse_moe.shared_experts.down_proj.weight": ((E, S), MATRIX),
            })
    return out


def layer_trunk(cfg: K3Config, L: int) -> list:
    """TensorSpecs of layer L's non-expert tensors. A_log's shape is None: any (n,) with
    n >= num_heads is legal (checked with its zero padding by the reader)."""
    return [TensorSpec(names.layer(L, sfx), shape, kind)
            for sfx, (shape, kind) in _suffix_shapes(cfg, L).items()]


def expert_shapes(cfg: K3Config) -> dict:
    """(w, part) -> logical packed shape of one routed expert's tensors (model.md §4.1)."""
    lat, inter, g = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, MXFP4_GROUP
    return {
        ("w1", "weight_packed"): (inter, lat // 2), ("w1", "weight_scale"): (inter, lat // g),
        ("w2", "weight_packed"): (lat, inter // 2), ("w2", "weight_scale"): (lat, inter // g),
        ("w3", "weight_packed"): (inter, lat // 2), ("w3", "weight_scale"): (inter, lat // g),
    }


def experts_mxfp4_ok(cfg: K3Config) -> list:
    """Problems that make MXFP4 experts impossible for this config (group 32 must divide
    both expert widths)."""
    errs = []
    for key in ("routed_expert_hidden_size", "moe_intermediate_size"):
        v = getattr(cfg, key)
        if v % MXFP4_GROUP:
            errs.append(f"{key}={v} is not a multiple of the MXFP4 group {MXFP4_GROUP}")
    return errs


def expert_specs(cfg: K3Config, L: int, e: int) -> list:
    shapes = expert_shapes(cfg)
    return [TensorSpec(names.expert(L, e, w, p), shapes[(w, p)], PACKED)
            for w, p in names.EXPERT_PARTS]


# ---- counting and naming the inventory without listing it -----------------------------

def count(cfg: K3Config) -> int:
    """How many language_model tensors ``cfg`` implies, without listing them."""
    per_kind = {}
    n = len(model_level(cfg))
    for L in range(cfg.num_hidden_layers):
        kind = (cfg.is_mla(L), cfg.is_dense(L))
        if kind not in per_kind:
            per_kind[kind] = len(layer_trunk(cfg, L))
        n += per_kind[kind]
    return n + len(cfg.moe_layers) * cfg.num_experts * len(names.EXPERT_PARTS)


def expected_names(cfg: K3Config):
    """Every tensor name ``cfg`` implies, lazily, in validation order."""
    for spec in model_level(cfg):
        yield spec.name
    for L in range(cfg.num_hidden_layers):
        for spec in layer_trunk(cfg, L):
            yield spec.name
    for L in cfg.moe_layers:
        for e in range(cfg.num_experts):
            yield from names.expert_names(L, e)


def is_expected_expert(cfg: K3Config, name: str) -> bool:
    key = names.parse_layer_key(name)
    if key is None:
        return False
    L, suffix = key
    parsed = names.parse_expert_suffix(suffix)
    return (parsed is not None and L in cfg.moe_layers and parsed[0] < cfg.num_experts
            and name == names.expert(L, *parsed))


# ---- the image tower and projector (formats/model/vision.md §3) ------------------------------

_SHOW = 5


def vision_specs(vcfg: VisionConfig) -> list:
    """TensorSpecs of the tower and projector, in the order the synthetic writer lays
    them out (formats/model/vision.md §3.1)."""
    D, Q, I = vcfg.vt_hidden_size, vcfg.qkv_hidden_size, vcfg.vt_intermediate_size
    p, M, T = vcfg.patch_size, vcfg.merged_width, vcfg.text_hidden_size
    specs = [TensorSpec(names.VISION_PATCH_EMBED, (D, 3, p, p), MATRIX),
             TensorSpec(names.VISION_POS_EMB,
                        (vcfg.init_pos_emb_height, vcfg.init_pos_emb_width, D), VECTOR)]
    block = {"norm0.weight": ((D,), VECTOR), "wqkv.weight": ((3 * Q, D), MATRIX),
             "wo.weight": ((D, Q), MATRIX), "norm1.weight": ((D,), VECTOR),
             "mlp.fc0.weight": ((I, D), MATRIX), "mlp.fc1.weight": ((D, I), MATRIX)}
    for b in range(vcfg.vt_num_hidden_layers):
        specs += [TensorSpec(names.vision_block(b, sfx), *block[sfx])
                  for sfx in names.VISION_BLOCK]
    specs += [TensorSpec(names.VISION_FINAL_NORM, (D,), VECTOR),
              TensorSpec(names.PROJECTOR_PROJ0, (M, M), MATRIX),
              TensorSpec(names.PROJECTOR_PROJ2, (T, M), MATRIX),
              TensorSpec(names.PROJECTOR_POST_NORM, (T,), VECTOR)]
    return specs


def check_vision_tensors(entries: dict, vcfg: VisionConfig, model_dir) -> None:
    """Raise CheckpointError unless ``entries`` (name -> TensorEntry of every image tensor
    in the shards) are exactly ``vision_specs(vcfg)`` with their shapes and float dtypes.
    The message names the first offending tensor and the shard (or directory) holding it."""
    specs = vision_specs(vcfg)
    missing = [s.name for s in specs if s.name not in entries]
    if missing:
        raise CheckpointError(
            f"{len(missing)} image tensor(s) vision_config requires are missing, e.g. "
            + ", ".join(missing[:_SHOW]), path=Path(model_dir), tensor=missing[0],
            hint=f"check that {vcfg.source} belongs to this checkpoint")
    for spec in specs:
        ent = entries[spec.name]
        if tuple(ent.shape) != spec.shape or ent.dtype not in spec.dtypes:
            raise CheckpointError(
                "image tensor has the wrong shape or dtype", path=ent.path,
                tensor=spec.name, expected=f"{list(spec.shape)} {'/'.join(spec.dtypes)}",
                found=f"{list(ent.shape)} {ent.dtype}",
                hint=f"shapes follow {Path(vcfg.source).name}'s vision_config")
    known = {s.name for s in specs}
    extra = sorted(n for n in entries if n not in known)
    if extra:
        raise CheckpointError(
            f"{len(extra)} image tensor(s) vision_config does not describe, e.g. "
            + ", ".join(extra[:_SHOW]), path=entries[extra[0]].path, tensor=extra[0],
            hint=f"check that {vcfg.source} belongs to this checkpoint")
