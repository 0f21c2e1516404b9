"""A model's sizes as the budget sees them (``ModelSizes``): trunk layers, model-level
tensors, experts, per-sequence state, and a draft model's share.

Owns: those byte counts, exactly from a checkpoint's headers or bounded from a config.
Does not own: what to do with them (``plan``, ``admission``).
"""

from __future__ import annotations

import dataclasses
import math

from .. import names
from ..config import K3Config
from ..io import inventory
from ..io.dtypes import bound_extra_bytes
from ..io.direct import window_bytes

@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """Byte sizes that decide budgets. ``exact`` is True when read from shard headers,
    False when derived from a config alone (small vectors then count as F32)."""

    layer_bytes: tuple             # trunk run of each layer, unpadded
    embed_bytes: int
    lm_head_bytes: int
    vectors_bytes: int             # final norm + output aggregator norm and projection
    expert_bytes: int              # one routed expert's six MXFP4 tensors
    num_experts: int
    top_k: int
    moe_layers: int
    bf16_trunk_bytes: int          # the trunk matrices' bytes the dense (bf16.py) kernels read
    state_bytes: int               # KDA recurrent state and conv history, all KDA layers
    kv_bytes_per_position: int     # MLA latent + rope cache over all MLA layers (f32)
    exact: bool
    draft_bytes: int = 0           # a draft model's weights and verify tape (``with_draft``)

    @property
    def trunk_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def model_level_bytes(self) -> int:
        return self.embed_bytes + self.lm_head_bytes + self.vectors_bytes

    @property
    def resident_bytes(self) -> int:
        """Model-level bytes kept in RAM: lm_head and vectors (the embedding is read by
        rows; module docstring), and a draft model's when one runs."""
        return self.lm_head_bytes + self.vectors_bytes + self.draft_bytes

    @property
    def expert_slot_bytes(self) -> int:
        """One cache slot: the expert widened to its enclosing aligned window, as the
        cache reads it (``window_bytes``, the one slot-size formula)."""
        return window_bytes(self.expert_bytes)

    @property
    def total_experts(self) -> int:
        return self.moe_layers * self.num_experts

    @property
    def experts_bytes(self) -> int:
        return self.total_experts * self.expert_bytes

    @property
    def cache_all_bytes(self) -> int:
        """Cache that holds every routed expert at once."""
        return self.total_experts * self.expert_slot_bytes

    @property
    def active_expert_bytes(self) -> int:
        """Expert bytes one token multiplies (top_k per MoE layer)."""
        return self.moe_layers * self.top_k * self.expert_bytes

    @classmethod
    def from_config(cls, cfg: K3Config) -> "ModelSizes":
        """Sizes implied by a config: matrices BF16 (the release's dtype), small vectors
        counted as F32 (a dtype is only known from the header; F32 is the upper bound
        for a vector). ``from_checkpoint`` counts the stored dtypes exactly."""
        layers, bf16 = [], 0
        for L in range(cfg.num_hidden_layers):
            total = 0
            for spec in inventory.layer_trunk(cfg, L):
                shape = spec.shape if spec.shape is not None else (inventory.a_log_width(cfg),)
                n = math.prod(shape)
                if spec.kind == inventory.MATRIX:
                    total += 2 * n
                    bf16 += 2 * n
                else:
                    total += 4 * n
            layers.append(total)
        E, V = cfg.hidden_size, cfg.vocab_size
        return cls(tuple(layers), 2 * V * E, 2 * V * E, 4 * 3 * E, cfg.expert_bytes,
                   cfg.num_experts, cfg.num_experts_per_token, len(cfg.moe_layers), bf16,
                   _state_bytes(cfg), _kv_per_position(cfg), exact=False)

    @classmethod
    def from_checkpoint(cls, ckpt) -> "ModelSizes":
        """Exact sizes from an opened ``libk3.io.checkpoint.Checkpoint``, in the stored
        dtypes; a tensor held widened once bound (F16) counts its widened copy too."""
        cfg = ckpt.config
        layers, bf16 = [], 0
        for L in range(cfg.num_hidden_layers):
            run = ckpt.layer_trunk_run(L)
            layers.append(run.nbytes + sum(bound_extra_bytes(dt, nb)
                                           for _, nb, dt, _ in run.tensors.values()))
            matrices = {s.name for s in inventory.layer_trunk(cfg, L) if s.kind == inventory.MATRIX}
            bf16 += sum(nb + bound_extra_bytes(dt, nb)
                        for name, (_, nb, dt, _) in run.tensors.items() if name in matrices)
        vec = sum(ckpt.entry(n).nbytes for n in
                  (names.NORM, names.OUTPUT_ATTN_RES_NORM, names.OUTPUT_ATTN_RES_PROJ))
        head = ckpt.entry(names.LM_HEAD)
        return cls(tuple(layers), ckpt.entry(names.EMBED).nbytes,
                   head.nbytes + bound_extra_bytes(head.dtype, head.nbytes), vec, cfg.expert_bytes,
                   cfg.num_experts, cfg.num_experts_per_token, len(cfg.moe_layers), bf16,
                   _state_bytes(cfg), _kv_per_position(cfg), exact=True)

    def to_json(self) -> dict:
        return {"trunk_bytes": self.trunk_bytes, "layers": len(self.layer_bytes),
                "largest_layer_bytes": max(self.layer_bytes, default=0),
                "model_level_bytes": self.model_level_bytes,
                "resident_bytes": self.resident_bytes, "expert_bytes": self.expert_bytes,
                "experts_total": self.total_experts, "experts_bytes": self.experts_bytes,
                "expert_slot_bytes": self.expert_slot_bytes, "top_k": self.top_k,
                "state_bytes": self.state_bytes,
                "kv_bytes_per_position": self.kv_bytes_per_position, "exact": self.exact}


def _state_bytes(cfg: K3Config) -> int:
    """KDA S [H, D, D] and conv history [3, K-1, P] per KDA layer, f32 (model.md §6)."""
    kda = sum(1 for L in range(cfg.num_hidden_layers) if not cfg.is_mla(L))
    per = cfg.num_heads * cfg.head_dim ** 2 + 3 * (cfg.short_conv_kernel_size - 1) * cfg.kda_dim
    return 4 * kda * per


def _kv_per_position(cfg: K3Config) -> int:
    """Latent [kv_lora] + rope [qk_rope] per MLA layer and position, f32 (model.md §6)."""
    mla = sum(1 for L in range(cfg.num_hidden_layers) if cfg.is_mla(L))
    return 4 * mla * cfg.mla_cache_width


# ---- budgets -----------------------------------------------------------------------------


def verify_tape_bytes(cfg: K3Config) -> int:
    """What a verify pass records per fed token to commit without a second pass
    (dspark.md §6.3): per KDA layer the pre-conv q, k, v, the convolved q, k, v, the
    decay (each kda_dim floats) and beta (one per head), f32."""
    kda_layers = sum(1 for L in range(cfg.num_hidden_layers) if not cfg.is_mla(L))
    return kda_layers * (7 * cfg.kda_dim + cfg.num_heads) * 4


def with_draft(sizes: ModelSizes, cfg: K3Config, weight_bytes: int, kv_per_position: int,
               cap: int) -> ModelSizes:
    """``sizes`` with a draft model beside the target: its weights resident, the verify
    tape of a pass of ``cap`` proposals and the anchor, and its context row per position
    (``kv_per_position`` bytes) with every sequence's MLA cache."""
    return dataclasses.replace(
        sizes, draft_bytes=weight_bytes + (cap + 1) * verify_tape_bytes(cfg),
        kv_bytes_per_position=sizes.kv_bytes_per_position + kv_per_position)


def sequence_bytes(sizes: ModelSizes, positions: int) -> int:
    """What one sequence holds: its recurrent state (KDA S and conv history, every KDA
    layer) and its MLA cache for ``positions`` positions (formats/presets.md 2, 5)."""
    return sizes.state_bytes + positions * sizes.kv_bytes_per_position
