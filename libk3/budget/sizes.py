"""A model's sizes as the budget sees them (``ModelSizes``): trunk layers, model-level
tensors, experts, per-sequence state, and a draft model's share.

Owns: those byte counts, exactly from a checkpoint's headers or bounded from a config,
and the activations one forward pass holds per token (``activation_peak``).
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
    activation_token_bytes: int = 0   # a forward pass's activations per token (its peak)
    beside_bytes: int = 0          # what the front end holds beside the model (``with_beside``)

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
                   _state_bytes(cfg), _kv_per_position(cfg), exact=False,
                   activation_token_bytes=activation_peak(cfg, 1)[0])

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
                   _state_bytes(cfg), _kv_per_position(cfg), exact=True,
                   activation_token_bytes=activation_peak(cfg, 1)[0])

    def to_json(self) -> dict:
        return {"trunk_bytes": self.trunk_bytes, "layers": len(self.layer_bytes),
                "largest_layer_bytes": max(self.layer_bytes, default=0),
                "model_level_bytes": self.model_level_bytes,
                "resident_bytes": self.resident_bytes, "expert_bytes": self.expert_bytes,
                "experts_total": self.total_experts, "experts_bytes": self.experts_bytes,
                "expert_slot_bytes": self.expert_slot_bytes, "top_k": self.top_k,
                "state_bytes": self.state_bytes,
                "kv_bytes_per_position": self.kv_bytes_per_position,
                "activation_token_bytes": self.activation_token_bytes, "exact": self.exact}


def _state_bytes(cfg: K3Config) -> int:
    """KDA S [H, D, D] and conv history [3, K-1, P] per KDA layer, f32 (model.md §6)."""
    kda = sum(1 for L in range(cfg.num_hidden_layers) if not cfg.is_mla(L))
    per = cfg.num_heads * cfg.head_dim ** 2 + 3 * (cfg.short_conv_kernel_size - 1) * cfg.kda_dim
    return 4 * kda * per


def _kv_per_position(cfg: K3Config) -> int:
    """Latent [kv_lora] + rope [qk_rope] per MLA layer and position, f32 (model.md §6)."""
    mla = sum(1 for L in range(cfg.num_hidden_layers) if cfg.is_mla(L))
    return 4 * mla * cfg.mla_cache_width


def activation_peak(cfg: K3Config, tokens: int, all_logits: bool = False,
                    expert_share: float = 1.0) -> tuple:
    """(bytes, stage): the peak of the arrays one forward pass of ``tokens`` tokens holds
    (``libk3.model.forward``, ``libk3.model.ops``: every one f32 with a row per token, so
    the peak is linear in ``tokens``) and the stage where it falls.

    Per token, in floats, at each layer L (nb = AttnRes blocks after L's boundary; the
    layer loop holds nb blocks, the layer input p unless it is the block's first, the
    previous layer's attention input, x_a and h):
      KDA   11 P + H + E    q^ k^ v^ (projections), z (decay), q k v (conv, l2norm),
                            alpha, then o (normed), gate, gate * o; the o_proj output
      MLA   Q + Hq + (r + rope) + r + max(Hq + Hv, 3 Hv) + E
                            cq, q, c, latent; at the attention the q_nope / q_rope
                            copies and out, or out, gate, gate * out; the o_proj output
      dense 3 I             gate, up, SiTU (layer 0)
      MoE   3k + (k + 1) Lt + E + max(share max(Lt + 3M, 2Lt + M), 2Lt, Lt + 2E)
                            ids and weights, z, the shared experts' output, the
                            per-(token, pick) expert outputs [T, k, Lt], then one
                            expert's rows (its share of the pass: ``expert_share``, 1 =
                            every token), or u and its norm, or y and y + y_s (the shared
                            experts before: 3k + Lt + 3S)
      head  max(2 nb + 3, nb + 4 + V / E with all_logits) x E: blocks, prefix, the
                            output mixture, or its norm and the [T, vocab] logits (only
                            the last row's without all_logits)
    The MLP half of a layer holds 2 arrays more than the attention (a and the new prefix,
    one in a block's first layer) plus x_m and h; the AttnRes mixture that makes x_m
    stacks the nb blocks once more. E hidden, P = KDA heads x head dim, H KDA heads, Q
    q_lora, Hq = MLA heads x (nope + rope), Hv = MLA heads x v, r kv_lora, I dense
    intermediate, S shared intermediate, Lt latent (routed_expert_hidden), M
    moe_intermediate, k top_k, V vocab. Not counted: the router's [T, N] scores (below
    the MoE peak: freed before z), the MLA kernel's per-thread scratch (no T), the 1-row
    embedding reads. bench/prefill.py compares it with tracemalloc's peak."""
    E, P, H = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_heads
    Q, Hm = cfg.q_lora_rank, cfg.num_attention_heads
    Hq, Hv = Hm * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), Hm * cfg.v_head_dim
    r, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    I, Lt, M, k = (cfg.intermediate_size, cfg.routed_expert_hidden_size,
                   cfg.moe_intermediate_size, cfg.num_experts_per_token)
    S = cfg.num_shared_experts * cfg.moe_intermediate_size
    best, where, nb = 0, "", 0
    for L in range(cfg.num_hidden_layers):
        first = cfg.is_boundary(L)
        nb += first
        held = nb + (not first) + (L >= 2) + (L >= 1)   # blocks, p, previous x_a, x_a
        if cfg.is_mla(L):
            attn, kind = Q + Hq + (r + rope) + r + max(Hq + Hv, 3 * Hv) + E, "MLA"
        else:
            attn, kind = 11 * P + H + E, "KDA"
        mlp_held = held + (1 if first else 2) + 2
        stages = [((held + 1) * E + attn, f"{kind} attention, layer {L}"),
                  ((mlp_held + nb) * E, f"AttnRes mixture, layer {L}")]
        if cfg.is_dense(L):
            stages.append((mlp_held * E + 3 * I, f"dense MLP, layer {L}"))
        else:
            routed = 3 * k + (k + 1) * Lt + E + max(expert_share * max(Lt + 3 * M, 2 * Lt + M),
                                                     2 * Lt, Lt + 2 * E)
            shared = 3 * k + Lt + 3 * S
            stages.append((mlp_held * E + max(routed, shared), f"MoE, layer {L}"))
        for v, name in stages:
            if v > best:
                best, where = v, name
    head = max(2 * nb + 3, nb + 3 + (1 + cfg.vocab_size / E if all_logits else 0)) * E
    if head > best:
        best, where = head, "head" + (" (all_logits)" if all_logits else "")
    return int(tokens * 4 * best), where


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


def with_beside(sizes: ModelSizes, nbytes: int) -> ModelSizes:
    """``sizes`` with ``nbytes`` more held beside the model by the run's front end (a
    server's kept turns and its request reader): counted in the overhead like the
    resident tensors, so admission, ``auto`` and the batch width leave room for it."""
    return dataclasses.replace(sizes, beside_bytes=sizes.beside_bytes + int(nbytes))


def vision_bytes(vcfg, used: bool = True) -> int:
    """What the image tower and projector hold once read (formats/presets.md "Images"):
    matrices as BF16 bits, vectors and the position table float32; 0 for a text model or
    a run that reads no image."""
    if vcfg is None or not used:
        return 0
    return sum(math.prod(s.shape) * (2 if s.kind == inventory.MATRIX else 4)
               for s in inventory.vision_specs(vcfg))


def sequence_bytes(sizes: ModelSizes, positions: int) -> int:
    """What one sequence holds: its recurrent state (KDA S and conv history, every KDA
    layer) and its MLA cache for ``positions`` positions (formats/presets.md 2, 5)."""
    return sizes.state_bytes + positions * sizes.kv_bytes_per_position
