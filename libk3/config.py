"""The K3 model configuration: one frozen dataclass, built by one strict function.

Owns: reading ``config.json`` in both shapes of model.md §2 (released
nested, and flat for small test models), the alias table, and structural validation.
Does not own: tensor shapes (``libk3.io.inventory``) or anything about files other than
config.json.

Why so strict: a reader that defaults an empty ``full_attn_layers`` runs every layer as
KDA and still produces fluent text (model.md §2.2). So an absent required key is an error,
never a default; every gap is collected and reported in one message naming the file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from pathlib import Path

from .errors import ConfigError

# eps of q_a_layernorm and kv_a_layernorm: the official model code builds these two norms
# with the norm class default 1e-6, the public C engine with rms_norm_eps (1e-5). We follow
# the official code (model.md §5.0, §10); the reference and synth use this constant.
MLA_LATENT_NORM_EPS = 1e-6
# L2Norm eps of KDA q and k, hard-coded in the model (model.md §5.0).
L2NORM_EPS = 1e-6
# Router renormalisation epsilon (model.md §5.8 step 3).
ROUTER_RENORM_EPS = 1e-20
# MXFP4 group size (model.md §4.2).
MXFP4_GROUP = 32
# Plausibility bounds, checked before anything is sized from the config. Layers and
# experts: trace records and expert keys hold them in 16 bits (formats/trace.md); K3 has
# 93 and 896. Any width or count: 2^24, over 100 times K3's largest (vocab 163,840).
MAX_LAYERS = MAX_EXPERTS = 0xFFFF
MAX_SIZE = 1 << 24


@dataclasses.dataclass(frozen=True)
class K3Config:
    """Every field is a config.json key (primary spelling of model.md §2.1); none has a default."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    num_heads: int                 # KDA heads (flat alias kda_num_heads)
    head_dim: int                  # KDA d_k = d_v (flat alias kda_head_dim)
    short_conv_kernel_size: int
    gate_lower_bound: float
    full_attn_layers: tuple        # 1-based MLA layer indices
    num_attention_heads: int       # MLA heads
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    routed_expert_hidden_size: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    moe_renormalize: bool
    latent_moe_use_norm: bool
    first_k_dense_replace: int
    intermediate_size: int
    attn_res_block_size: int
    activation_situ_beta: float
    activation_situ_linear_beta: float
    tie_word_embeddings: bool
    source: str                    # the file it was read from

    # ---- layer map (model.md §2.4) --------------------------------------------------
    def is_mla(self, L: int) -> bool:
        return (L + 1) in self._mla_set

    def is_dense(self, L: int) -> bool:
        return L < self.first_k_dense_replace

    def is_boundary(self, L: int) -> bool:
        return L % self.attn_res_block_size == 0

    @functools.cached_property
    def _mla_set(self) -> frozenset:
        return frozenset(self.full_attn_layers)

    @property
    def layer_map(self) -> str:
        """'K'/'M' per layer, 0-based, e.g. 'KKKMKKKMKKKMM' for tiny."""
        return "".join("M" if self.is_mla(L) else "K" for L in range(self.num_hidden_layers))

    @property
    def moe_layers(self) -> range:
        return range(self.first_k_dense_replace, self.num_hidden_layers)

    # ---- derived widths ---------------------------------------------------------------
    @property
    def kda_dim(self) -> int:          # P = H * D
        return self.num_heads * self.head_dim

    @property
    def qk_head_dim(self) -> int:      # 192 for the real model
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:  # latent + shared key slice, 576 for the real model
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_width(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert's six MXFP4 tensors (model.md §4.1)."""
        lat, inter = self.routed_expert_hidden_size, self.moe_intermediate_size
        per_matrix = lat * inter // 2 + lat * inter // MXFP4_GROUP
        return 3 * per_matrix

    def fingerprint(self) -> str:
        """sha256 of the architecture (every field but ``source``), for state/pack identity."""
        d = dataclasses.asdict(self)
        d.pop("source")
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def to_flat_dict(self) -> dict:
        """The flat config.json shape (model.md §2.3) for this config."""
        d = dataclasses.asdict(self)
        d.pop("source")
        out = {}
        for key, value in d.items():
            out[_FLAT_NAME.get(key, key)] = list(value) if isinstance(value, tuple) else value
        return out


# (field, location in the nested shape, flat aliases, type, required?)
# location: "lin" = text_config.linear_attn_config, "text" = text_config.
_INT, _FLOAT, _BOOL, _LIST, _STR = "int", "float", "bool", "list", "str"
_KEYS = (
    ("hidden_size", "text", (), _INT, True),
    ("num_hidden_layers", "text", (), _INT, True),
    ("vocab_size", "text", (), _INT, True),
    ("rms_norm_eps", "text", (), _FLOAT, True),
    ("num_heads", "lin", ("kda_num_heads",), _INT, True),
    ("head_dim", "lin", ("kda_head_dim",), _INT, True),
    ("short_conv_kernel_size", "lin", (), _INT, True),
    ("gate_lower_bound", "lin", (), _FLOAT, True),
    ("full_attn_layers", "lin", (), _LIST, True),
    ("num_attention_heads", "text", (), _INT, True),
    ("q_lora_rank", "text", (), _INT, True),
    ("kv_lora_rank", "text", (), _INT, True),
    ("qk_nope_head_dim", "text", (), _INT, True),
    ("qk_rope_head_dim", "text", (), _INT, True),
    ("v_head_dim", "text", (), _INT, True),
    ("mla_use_output_gate", "text", (), _BOOL, False),
    ("num_experts", "text", (), _INT, True),
    ("num_experts_per_token", "text", (), _INT, True),
    ("num_shared_experts", "text", (), _INT, True),
    ("routed_expert_hidden_size", "text", (), _INT, True),
    ("moe_intermediate_size", "text", (), _INT, True),
    ("routed_scaling_factor", "text", (), _FLOAT, True),
    ("moe_renormalize", "text", (), _BOOL, False),
    ("latent_moe_use_norm", "text", (), _BOOL, False),
    ("first_k_dense_replace", "text", (), _INT, True),
    ("intermediate_size", "text", (), _INT, True),
    ("attn_res_block_size", "text", (), _INT, True),
    ("activation_situ_beta", "text", ("situ_beta",), _FLOAT, True),
    ("activation_situ_linear_beta", "text", ("situ_linear_beta",), _FLOAT, True),
    ("tie_word_embeddings", "text", (), _BOOL, False),
)
# Genuinely optional booleans and their defaults (model.md §2.1, "D" rows; model.md §2.3 for tie).
_BOOL_DEFAULTS = {"mla_use_output_gate": True, "moe_renormalize": True,
                  "latent_moe_use_norm": True, "tie_word_embeddings": False}
_FLAT_NAME = {"num_heads": "kda_num_heads", "head_dim": "kda_head_dim",
              "activation_situ_beta": "situ_beta",
              "activation_situ_linear_beta": "situ_linear_beta"}


def _lookup(doc: dict, location: str, names: tuple):
    """Find a key: linear_attn_config first for KDA keys (model.md §2.2 trap), then
    text_config, then the root; primary spelling or alias. Returns (found, value)."""
    text = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else {}
    lin = text.get("linear_attn_config") if isinstance(text.get("linear_attn_config"), dict) else {}
    rootlin = doc.get("linear_attn_config") if isinstance(doc.get("linear_attn_config"), dict) else {}
    scopes = [lin, rootlin, text, doc] if location == "lin" else [text, doc]
    for scope in scopes:
        for name in names:
            if name in scope:
                return True, scope[name]
    return False, None


def coerce(value, kind):
    """Return the typed value or None when ill-typed (bool is not an int here): kinds
    "int", "float" (finite), "bool", "str" and "list" (of ints, as a tuple)."""
    if kind == _INT:
        if isinstance(value, bool):
            return None
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return None
    if kind == _FLOAT:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        v = float(value)
        return v if math.isfinite(v) else None
    if kind == _BOOL:
        return value if isinstance(value, bool) else None
    if kind == _STR:
        return value if isinstance(value, str) else None
    if kind == _LIST:
        if not isinstance(value, list):
            return None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return None
        return tuple(value)
    raise AssertionError(kind)


def key_problems(missing, bad) -> list:
    """The config errors of keys: one entry for the missing, one for the ill-typed."""
    problems = []
    if missing:
        problems.append("missing required key(s): " + ", ".join(missing))
    if bad:
        problems.append("ill-typed: " + "; ".join(bad))
    return problems


def config_from_dict(doc: dict, source: str = "<dict>") -> K3Config:
    """Build and validate a config from a parsed config.json (nested, flat, or flat
    wrapped in a ``"config"`` member). Raises one ConfigError listing every problem."""
    if not isinstance(doc, dict):
        raise ConfigError("config is not a JSON object", path=source)
    if "config" in doc and isinstance(doc["config"], dict) and "text_config" not in doc \
            and "hidden_size" not in doc:
        doc = doc["config"]
    values, missing, bad = {}, [], []
    for field, location, aliases, kind, required in _KEYS:
        found, raw = _lookup(doc, location, (field,) + aliases)
        if not found:
            if required:
                missing.append(field if not aliases else f"{field} (or {'/'.join(aliases)})")
                continue
            values[field] = _BOOL_DEFAULTS[field]
            continue
        v = coerce(raw, kind)
        if v is None:
            bad.append(f"{field}={raw!r} is not a valid {kind}")
            continue
        values[field] = v
    problems = key_problems(missing, bad)
    if problems:
        raise ConfigError("; ".join(problems) + " (k3 refuses to substitute defaults)",
                          path=source)
    cfg = K3Config(source=source, **values)
    _check_structure(cfg, doc, source)
    return cfg


def _check_structure(cfg: K3Config, doc: dict, source: str) -> None:
    _check_plausible(cfg, source)
    errs = []
    n = cfg.num_hidden_layers
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_heads", "head_dim",
                "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "v_head_dim", "num_experts", "routed_expert_hidden_size",
                "moe_intermediate_size", "intermediate_size"):
        if getattr(cfg, key) <= 0:
            errs.append(f"{key}={getattr(cfg, key)} must be > 0")
    if cfg.qk_rope_head_dim < 0:
        errs.append(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be >= 0")
    if cfg.num_shared_experts < 0:
        errs.append(f"num_shared_experts={cfg.num_shared_experts} must be >= 0")
    if not cfg.rms_norm_eps > 0:
        errs.append(f"rms_norm_eps={cfg.rms_norm_eps} must be > 0")
    bad_idx = [i for i in cfg.full_attn_layers if not 1 <= i <= n]
    if bad_idx:
        errs.append(f"full_attn_layers entries {bad_idx} are outside 1..{n} "
                    "(the list is ONE-based)")
    if len(set(cfg.full_attn_layers)) != len(cfg.full_attn_layers):
        errs.append("full_attn_layers has duplicate entries")
    if len(cfg.full_attn_layers) >= n and n > 0:
        errs.append(f"full_attn_layers has {len(cfg.full_attn_layers)} entries, "
                    f"must be fewer than num_hidden_layers={n}")
    found, kda_layers = _lookup(doc, "lin", ("kda_layers",))
    if found:
        expect = sorted(set(range(1, n + 1)) - set(cfg.full_attn_layers))
        if (not isinstance(kda_layers, list) or not all(type(i) is int for i in kda_layers)
                or sorted(kda_layers) != expect):        # [null, null] must not reach sorted
            errs.append("kda_layers is not the exact complement of full_attn_layers")
    found, full_rank = _lookup(doc, "lin", ("use_full_rank_gate",))
    if found and full_rank is not True:
        errs.append("use_full_rank_gate must be true (k3 supports only the full-rank KDA gate)")
    if not cfg.mla_use_output_gate:
        errs.append("mla_use_output_gate=false is not supported (K3 MLA is gated)")
    if not 1 <= cfg.num_experts_per_token <= cfg.num_experts:
        errs.append(f"num_experts_per_token={cfg.num_experts_per_token} must lie in "
                    f"1..num_experts={cfg.num_experts}")
    if cfg.attn_res_block_size < 1:
        errs.append(f"attn_res_block_size={cfg.attn_res_block_size} must be >= 1")
    if cfg.short_conv_kernel_size < 1:
        errs.append(f"short_conv_kernel_size={cfg.short_conv_kernel_size} must be >= 1")
    if not 0 <= cfg.first_k_dense_replace <= n:
        errs.append(f"first_k_dense_replace={cfg.first_k_dense_replace} outside 0..{n}")
    if cfg.activation_situ_beta <= 0 or cfg.activation_situ_linear_beta <= 0:
        errs.append("SiTU betas must be > 0")
    quant = _quantization_config(doc)
    if quant is not None:
        errs.extend(_check_quantization(quant))
    if errs:
        raise ConfigError("; ".join(errs), path=source)


def _check_plausible(cfg: K3Config, source: str) -> None:
    """Refuse sizes no checkpoint could have before anything loops or allocates by them
    (a config of 10^9 layers must not build 10^9 of anything)."""
    errs = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        limit = {"num_hidden_layers": MAX_LAYERS, "num_experts": MAX_EXPERTS}.get(f.name, MAX_SIZE)
        if type(v) is int and v > limit:
            errs.append(f"{f.name}={v} is implausible (at most {limit})")
    if len(cfg.full_attn_layers) > MAX_LAYERS:
        errs.append(f"full_attn_layers has {len(cfg.full_attn_layers)} entries "
                    f"(at most {MAX_LAYERS})")
    if errs:
        raise ConfigError("; ".join(errs), path=source)


def _quantization_config(doc: dict):
    text = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else {}
    for scope in (text, doc):
        q = scope.get("quantization_config")
        if q is not None:
            return q
    return None


def _check_quantization(q) -> list:
    """Assert the MXFP4 scheme when a quantization_config is present (model.md §2.1)."""
    if not isinstance(q, dict):
        return ["quantization_config is not an object"]
    errs = []
    fmt = q.get("format")
    if fmt is not None and fmt != "mxfp4-pack-quantized":
        errs.append(f"quantization_config.format={fmt!r}, k3 reads only 'mxfp4-pack-quantized'")
    groups = q.get("config_groups")
    if isinstance(groups, dict):
        for gname, group in groups.items():
            w = group.get("weights") if isinstance(group, dict) else None
            if not isinstance(w, dict):
                continue
            if w.get("num_bits", 4) != 4:
                errs.append(f"quantization group {gname}: num_bits={w.get('num_bits')}, expected 4")
            if w.get("type", "float") != "float":
                errs.append(f"quantization group {gname}: type={w.get('type')!r}, expected 'float'")
            if w.get("group_size", MXFP4_GROUP) != MXFP4_GROUP:
                errs.append(f"quantization group {gname}: group_size={w.get('group_size')}, "
                            f"expected {MXFP4_GROUP}")
    return errs


def _read_doc(path):
    """(parsed config.json, its path) for a config.json or a model directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError("no config.json (k3 never falls back to built-in values)", path=p)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 ({e.reason} at byte {e.start})", path=p) from None
    except (ValueError, RecursionError) as e:      # JSONDecodeError is a ValueError
        raise ConfigError(f"not valid JSON: {str(e)[:200] or type(e).__name__}",
                          path=p) from None
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror}", path=p) from None
    return doc, p


def load_config(path) -> K3Config:
    """Read ``path`` (a config.json, or a model directory holding one)."""
    doc, p = _read_doc(path)
    return config_from_dict(doc, source=str(p))


# The release's text_config.max_position_embeddings (model.md §2.1). k3's arithmetic needs no
# context length (no positional encoding, a fixed KDA state, an MLA cache that grows), so
# it only bounds what a prompt may be; a config without the key (the synthetic ones) is
# held to the release's.
K3_CONTEXT = 1_048_576


def context_length(path) -> int:
    """The model's context in tokens: ``max_position_embeddings`` of config.json
    (text_config, then the root; a positive int), else ``K3_CONTEXT``."""
    doc, p = _read_doc(path)
    if isinstance(doc, dict) and isinstance(doc.get("config"), dict) \
            and "text_config" not in doc and "hidden_size" not in doc:
        doc = doc["config"]                 # flat, wrapped (as in config_from_dict)
    found, raw = _lookup(doc if isinstance(doc, dict) else {}, "text", ("max_position_embeddings",))
    if not found:
        return K3_CONTEXT
    v = coerce(raw, _INT)
    if v is None or v < 1:
        raise ConfigError(f"max_position_embeddings={raw!r} is not a positive int", path=p)
    return v
