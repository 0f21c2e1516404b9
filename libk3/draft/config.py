"""The DSpark draft's configuration: one frozen dataclass, built by one strict function.

Owns: reading a draft's ``config.json`` (formats/model/dspark.md §2), refusing what k3 does not
implement (a NoPE or gated MLA, a non-SiLU MLP, a non-vanilla Markov head, a
``rope_interleave`` key), checking it against the target's ``K3Config`` (dspark.md §2.3),
the tensor inventory the config implies (dspark.md §3) and the derived numbers of the
draft's math: YaRN rotation frequencies and the softmax scale (dspark.md §5.4). Does not
own: reading tensors (``libk3.draft.checkpoint``) or any arithmetic on activations.

Why so strict: a draft whose taps, names or rotation are slightly wrong still loads and
runs and only accepts nothing (formats/model/dspark.md §8); an error at load time is the only
place the mistake can be seen.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from ..config import MAX_SIZE, K3Config, coerce, key_problems
from ..errors import ConfigError

# Every draft norm (q_a and kv_a included) uses rms_norm_eps (formats/model/dspark.md §2.1).
DRAFT_TAP_FORMS = ("prefix", "attn_res")
# Drafted tokens per pass when the config does not say (anchor + 6 mask rows, dspark.md §5.2).
DEFAULT_BLOCK = 7
# YaRN keeps acceptance up to about this many times its original window (dspark.md §7).
TRAINED_CONTEXT_FACTOR = 3


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Every field but ``source`` and the derived ones is a config.json key
    (dspark.md §2.1)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_factor: float
    rope_original_max_positions: int
    rope_beta_fast: float
    rope_beta_slow: float
    rope_mscale: float
    rope_mscale_all_dim: float
    max_position_embeddings: int
    target_layer_ids: tuple            # 0-based, strictly ascending = concatenation order
    target_hidden_size: int
    target_num_hidden_layers: int
    mask_token_id: int
    markov_rank: int
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    fc_norm: bool                      # the variant's per-tap RMSNorm (dspark.md §2.2)
    aux_hidden_stream: str             # "prefix" (raw running sum) or "attn_res"
    block_size: int                    # drafted tokens per pass (the checkpoint's 7 or 8 -> 7)
    source: str

    # ---- derived numbers (formats/model/dspark.md §5.4) -------------------------------------
    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Floats per position and layer in the draft's context cache (latent | k_pe)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def trained_context(self) -> int:
        """Positions past which drafting is turned off (acceptance collapses, dspark.md §7)."""
        return TRAINED_CONTEXT_FACTOR * self.rope_original_max_positions

    def softmax_scale(self) -> float:
        """qk_head^-1/2 times YaRN's mscale(factor, mscale_all_dim) squared
        (dspark.md §5.4)."""
        m = _yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
        return self.qk_head_dim ** -0.5 * m * m

    def rope_inv_freq(self) -> tuple:
        """The ``qk_rope_head_dim // 2`` rotation frequencies of DeepSeek-style YaRN
        (dspark.md §5.4), as Python floats (float64), pair i rotating by position *
        inv_freq[i]."""
        dim, base = self.qk_rope_head_dim, self.rope_theta
        half = dim // 2
        extra = [base ** (-(2 * i) / dim) for i in range(half)]
        if self.rope_factor <= 1.0:
            return tuple(extra)

        def correction(rotations):
            return dim * math.log(self.rope_original_max_positions
                                  / (rotations * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(correction(self.rope_beta_fast)), 0)
        high = min(math.ceil(correction(self.rope_beta_slow)), dim - 1)
        if high == low:
            high += 0.001                       # the published formula's guard
        out = []
        for i in range(half):
            r = min(max((i - low) / (high - low), 0.0), 1.0)
            out.append(extra[i] * (1.0 - r) + extra[i] / self.rope_factor * r)
        return tuple(out)

    def rope_amplitude(self) -> float:
        """cos/sin multiplier: mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
        return (_yarn_mscale(self.rope_factor, self.rope_mscale)
                / _yarn_mscale(self.rope_factor, self.rope_mscale_all_dim))

    # ---- the tensors this config implies (formats/model/dspark.md §3) -----------------------
    def tensor_shapes(self) -> dict:
        """{bare tensor name: shape} of every tensor a draft checkpoint holds, no more."""
        E, V, R = self.hidden_size, self.vocab_size, self.markov_rank
        H, qk, v = self.num_attention_heads, self.qk_head_dim, self.v_head_dim
        out = {
            "embed_tokens.weight": (V, E),
            "context_proj.weight": (E, self.n_taps * self.target_hidden_size),
            "context_norm.weight": (E,),
            "final_norm.weight": (E,),
            "markov_head.markov_w1.weight": (V, R),
            "markov_head.markov_w2.weight": (V, R),
        }
        if self.enable_confidence_head:
            w = E + (R if self.confidence_head_with_markov else 0)
            out["confidence_head.proj.weight"] = (1, w)
            out["confidence_head.proj.bias"] = (1,)
        if self.fc_norm:
            for i in range(self.n_taps):
                out[f"fc_norm.{i}.weight"] = (self.target_hidden_size,)
        for i in range(self.num_hidden_layers):
            p = f"layers.{i}."
            out.update({
                p + "input_layernorm.weight": (E,),
                p + "post_attention_layernorm.weight": (E,),
                p + "self_attn.q_a_proj.weight": (self.q_lora_rank, E),
                p + "self_attn.q_a_layernorm.weight": (self.q_lora_rank,),
                p + "self_attn.q_b_proj.weight": (H * qk, self.q_lora_rank),
                p + "self_attn.kv_a_proj_with_mqa.weight": (self.cache_width, E),
                p + "self_attn.kv_a_layernorm.weight": (self.kv_lora_rank,),
                p + "self_attn.kv_b_proj.weight": (H * (self.qk_nope_head_dim + v),
                                                    self.kv_lora_rank),
                p + "self_attn.o_proj.weight": (E, H * v),
                p + "mlp.gate_proj.weight": (self.intermediate_size, E),
                p + "mlp.up_proj.weight": (self.intermediate_size, E),
                p + "mlp.down_proj.weight": (E, self.intermediate_size),
            })
        return out

    def check_against(self, target: K3Config) -> None:
        """Refuse a draft made for another target (formats/model/dspark.md §2.3)."""
        problems = []

        def differs(what, mine, theirs):
            if mine != theirs:
                problems.append(f"{what} {mine} but the target has {theirs}")
        differs("target_hidden_size", self.target_hidden_size, target.hidden_size)
        differs("hidden_size", self.hidden_size, target.hidden_size)
        differs("target_num_hidden_layers", self.target_num_hidden_layers,
                target.num_hidden_layers)
        differs("vocab_size", self.vocab_size, target.vocab_size)
        if self.target_layer_ids and self.target_layer_ids[-1] >= target.num_hidden_layers:
            problems.append(f"target_layer_ids {list(self.target_layer_ids)} name a layer "
                            f"past the target's last ({target.num_hidden_layers - 1})")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the target's "
                            f"vocabulary 0..{target.vocab_size - 1}")
        if problems:
            raise ConfigError("draft does not match the target model: " + "; ".join(problems),
                              path=self.source, hint="use the draft made for this checkpoint")


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1.0 else 1.0


# (field, config key, kind, default or _REQUIRED); kinds as ``config.coerce``
_REQUIRED = object()
_KEYS = (
    ("hidden_size", "hidden_size", "int", _REQUIRED),
    ("intermediate_size", "intermediate_size", "int", _REQUIRED),
    ("num_hidden_layers", "num_hidden_layers", "int", _REQUIRED),
    ("num_attention_heads", "num_attention_heads", "int", _REQUIRED),
    ("q_lora_rank", "q_lora_rank", "int", _REQUIRED),
    ("kv_lora_rank", "kv_lora_rank", "int", _REQUIRED),
    ("qk_nope_head_dim", "qk_nope_head_dim", "int", _REQUIRED),
    ("qk_rope_head_dim", "qk_rope_head_dim", "int", _REQUIRED),
    ("v_head_dim", "v_head_dim", "int", _REQUIRED),
    ("vocab_size", "vocab_size", "int", _REQUIRED),
    ("rms_norm_eps", "rms_norm_eps", "float", _REQUIRED),
    ("max_position_embeddings", "max_position_embeddings", "int", _REQUIRED),
    ("target_layer_ids", "target_layer_ids", "list", _REQUIRED),
    ("target_hidden_size", "target_hidden_size", "int", _REQUIRED),
    ("target_num_hidden_layers", "target_num_hidden_layers", "int", _REQUIRED),
    ("mask_token_id", "mask_token_id", "int", _REQUIRED),
    ("markov_rank", "markov_rank", "int", _REQUIRED),
    ("enable_confidence_head", "enable_confidence_head", "bool", _REQUIRED),
    ("confidence_head_with_markov", "confidence_head_with_markov", "bool", _REQUIRED),
    ("fc_norm", "fc_norm", "bool", False),
    ("aux_hidden_stream", "aux_hidden_stream", "str", "prefix"),
    ("block_size", "block_size", "int", DEFAULT_BLOCK),
)
# rope_parameters members -> fields (rope_theta may also sit at the root)
_ROPE_KEYS = (
    ("rope_factor", "factor", "float"),
    ("rope_original_max_positions", "original_max_position_embeddings", "int"),
    ("rope_beta_fast", "beta_fast", "float"),
    ("rope_beta_slow", "beta_slow", "float"),
    ("rope_mscale", "mscale", "float"),
    ("rope_mscale_all_dim", "mscale_all_dim", "float"),
)
# keys whose presence with this value means a model k3 does not implement (dspark.md §2.1)
_REFUSED = (
    ("mla_use_nope", True, "a NoPE draft (k3 implements the rotated DSpark MLA)"),
    ("mla_use_output_gate", True, "an output-gated draft MLA"),
)


def draft_config_from_dict(doc, source: str = "<dict>") -> DraftConfig:
    """Build and validate a draft config from a parsed config.json; one ConfigError lists
    every problem, naming the file."""
    if not isinstance(doc, dict):
        raise ConfigError("draft config is not a JSON object", path=source)
    values, missing, bad, refused = {}, [], [], []
    for field, key, kind, default in _KEYS:
        if key not in doc:
            if default is _REQUIRED:
                missing.append(key)
            else:
                values[field] = default
            continue
        v = coerce(doc[key], kind)
        if v is None:
            bad.append(f"{key}={doc[key]!r} is not a valid {kind}")
        else:
            values[field] = v
    rope = doc.get("rope_parameters", doc.get("rope_scaling"))
    if not isinstance(rope, dict):
        missing.append("rope_parameters")
        rope = {}
    theta = rope.get("rope_theta", doc.get("rope_theta"))
    if theta is None:
        missing.append("rope_theta")
    elif coerce(theta, "float") is None or theta <= 0:
        bad.append(f"rope_theta={theta!r} is not a positive float")
    else:
        values["rope_theta"] = float(theta)
    if rope and rope.get("rope_type", rope.get("type")) != "yarn":
        refused.append(f"rope_type {rope.get('rope_type', rope.get('type'))!r} "
                       "(k3 implements DeepSeek YaRN)")
    for field, key, kind in _ROPE_KEYS:
        if rope and key not in rope:
            missing.append(f"rope_parameters.{key}")
        elif rope:
            v = coerce(rope[key], kind)
            if v is None:
                bad.append(f"rope_parameters.{key}={rope[key]!r} is not a valid {kind}")
            else:
                values[field] = v
    for key, value, what in _REFUSED:
        if doc.get(key) == value:
            refused.append(f"{key}: {what}")
    if "rope_interleave" in doc:
        refused.append("rope_interleave (the draft's rotation is fixed: interleaved pairs; "
                       "the key is read by some tools as half-split)")
    act = doc.get("hidden_act", "silu")
    if act != "silu":
        refused.append(f"hidden_act {act!r} (the draft MLP is SiLU-gated)")
    head = doc.get("markov_head_type", "vanilla")
    if head != "vanilla":
        refused.append(f"markov_head_type {head!r} (k3 implements the vanilla head)")
    if values.get("aux_hidden_stream") not in (None,) + DRAFT_TAP_FORMS:
        refused.append(f"aux_hidden_stream {values['aux_hidden_stream']!r} "
                       f"(one of {', '.join(DRAFT_TAP_FORMS)})")
    problems = key_problems(missing, bad)
    if refused:
        problems.append("not implemented by k3: " + "; ".join(refused))
    if problems:
        raise ConfigError("; ".join(problems), path=source)
    if values["block_size"] == DEFAULT_BLOCK + 1:   # verify-width convention, dspark.md §2.1
        values["block_size"] = DEFAULT_BLOCK
    cfg = DraftConfig(source=source, **values)
    _check_structure(cfg, doc)
    return cfg


def _check_structure(cfg: DraftConfig, doc: dict) -> None:
    problems = []
    taps = cfg.target_layer_ids
    n = doc.get("num_target_layers", len(taps))
    if n != len(taps):
        problems.append(f"num_target_layers {n} but target_layer_ids has {len(taps)}")
    if not taps:
        problems.append("target_layer_ids is empty")
    if any(b <= a for a, b in zip(taps, taps[1:])) or any(t < 0 for t in taps):
        problems.append(f"target_layer_ids {list(taps)} are not strictly ascending layers")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} is outside 0..{cfg.vocab_size - 1}")
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "v_head_dim", "vocab_size", "markov_rank", "block_size",
                 "rope_original_max_positions", "target_hidden_size"):
        if not 0 < getattr(cfg, name) <= MAX_SIZE:
            problems.append(f"{name} must be 1 .. {MAX_SIZE}, found {getattr(cfg, name)}")
    if not 0 < cfg.qk_rope_head_dim <= MAX_SIZE or cfg.qk_rope_head_dim % 2:
        problems.append(f"qk_rope_head_dim {cfg.qk_rope_head_dim} must be positive and even "
                        "(rotation pairs)")
    if not cfg.rms_norm_eps > 0:
        problems.append(f"rms_norm_eps must be positive, found {cfg.rms_norm_eps}")
    if cfg.rope_factor <= 0:
        problems.append(f"rope_parameters.factor must be positive, found {cfg.rope_factor}")
    if not 0 < cfg.rope_beta_slow < cfg.rope_beta_fast:
        problems.append("rope_parameters need 0 < beta_slow < beta_fast, found "
                        f"{cfg.rope_beta_slow} and {cfg.rope_beta_fast}")
    if problems:
        raise ConfigError("inconsistent draft config: " + "; ".join(problems), path=cfg.source)


def load_draft_config(path) -> DraftConfig:
    """Read and validate ``path`` (a config.json, or a draft directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("draft config.json not found", path=p) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read draft config: {e}", path=p) from None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"draft config is not valid JSON ({e})", path=p) from None
    return draft_config_from_dict(doc, source=str(p))
