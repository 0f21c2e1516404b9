"""The image-input configuration of a K3 checkpoint: one frozen value, built strictly.

Owns: reading ``vision_config`` (in config.json, beside ``text_config``), the root key
``media_placeholder_token_id`` and ``preprocessor_config.json``'s ``media_proc_cfg``
(formats/model/vision.md §2), and checking their structure (formats/model/vision.md §2.4). Does not own:
the language-model keys (``libk3.config``), tensor shapes (``libk3.io.inventory``),
preprocessing or the tower's arithmetic.

Why as strict as the language-model reader: a tower read with a guessed head count or a
defaulted fill stage still yields rows, and the language model still answers fluently
about the wrong picture. So every key k3 reads is required, every gap is reported in one
message naming the file, and only the values k3 implements are accepted. A config.json
without ``vision_config`` is a text model: ``load_vision_config`` returns None and nothing
here is required.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .config import MAX_LAYERS, MAX_SIZE, K3Config, coerce, key_problems
from .errors import ConfigError

PREPROCESSOR_FILE = "preprocessor_config.json"
# The tower's 2D rotary position code has this many positions per side, so no image may
# be more patches wide or tall (vision.md §2.4).
MAX_PATCHES_ONE_SIDE = 512
FILL_STAGES = ("after_resize", "before_resize")
# The epsilon of the tower's 2 B + 1 RMS norms: the release builds them without one, and
# PyTorch then uses float32's machine epsilon for BF16 and float32 input (formats/model/vision.md §7.1).
VIT_NORM_EPS = 2.0 ** -23

# The one value k3 accepts for each of these keys (formats/model/vision.md §2.1).
_FIXED = {"pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
          "norm_type": "rmsnorm", "mlp_type": "mlp2", "merge_type": "sd2_tpool",
          "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu",
          "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False}


@dataclasses.dataclass(frozen=True)
class Chessboard:
    """``transparent_bg_config`` with pattern ``chessboard`` (formats/model/vision.md §2.2)."""

    square_size: int
    on_top_left: bool
    white_value: int
    gray_value: int


@dataclasses.dataclass(frozen=True)
class MediaProcConfig:
    """The ``media_proc_cfg`` keys of preprocessor_config.json k3 reads."""

    patch_size: int
    merge_kernel_size: int
    in_patch_limit: int
    patch_limit_on_one_side: int
    image_mean: tuple
    image_std: tuple
    background: Chessboard
    transparent_bg_fill_stage: str
    source: str


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Every field is a ``vision_config`` key (or a root key of config.json); none has a
    default. ``media`` is preprocessor_config.json's part."""

    vt_num_hidden_layers: int
    vt_hidden_size: int
    vt_num_attention_heads: int
    qkv_hidden_size: int
    vt_intermediate_size: int
    patch_size: int
    init_pos_emb_height: int
    init_pos_emb_width: int
    merge_kernel_size: tuple          # (m, m)
    mm_hidden_size: int
    text_hidden_size: int
    projector_ln_eps: float
    media_placeholder_token_id: int
    media: MediaProcConfig
    source: str

    @property
    def vt_head_dim(self) -> int:     # 128 for the release: qkv / heads, not D / heads
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def patch_inputs(self) -> int:    # 3 channels x patch x patch
        return 3 * self.patch_size * self.patch_size

    @property
    def merged_width(self) -> int:    # one merged row: m * m patches of D
        m0, m1 = self.merge_kernel_size
        return m0 * m1 * self.vt_hidden_size


_INT, _FLOAT, _BOOL, _STR, _LIST = "int", "float", "bool", "str", "list"
# vision_config keys k3 reads: (key, kind). Values of _FIXED keys are checked after typing.
_VISION_KEYS = (
    ("vt_num_hidden_layers", _INT), ("vt_hidden_size", _INT),
    ("vt_num_attention_heads", _INT), ("qkv_hidden_size", _INT),
    ("vt_intermediate_size", _INT), ("patch_size", _INT),
    ("init_pos_emb_height", _INT), ("init_pos_emb_width", _INT),
    ("merge_kernel_size", _LIST), ("mm_hidden_size", _INT), ("text_hidden_size", _INT),
    ("projector_ln_eps", _FLOAT),
    ("pos_emb_type", _STR), ("pos_emb_interpolation_mode", _STR), ("norm_type", _STR),
    ("mlp_type", _STR), ("merge_type", _STR), ("mm_projector_type", _STR),
    ("projector_hidden_act", _STR),
    ("attn_bias", _BOOL), ("linear_bias", _BOOL), ("patch_embed_proj_bias", _BOOL),
)
_MEDIA_KEYS = (
    ("patch_size", _INT), ("merge_kernel_size", _INT), ("in_patch_limit", _INT),
    ("patch_limit_on_one_side", _INT), ("image_mean", "triple"), ("image_std", "triple"),
    ("transparent_bg_config", "object"), ("transparent_bg_fill_stage", _STR),
)
_CHESSBOARD_KEYS = (
    ("pattern", _STR), ("chessboard_square_size", _INT),
    ("chessboard_square_on_top_left", _BOOL), ("chessboard_white_value", _INT),
    ("chessboard_gray_value", _INT),
)


def _typed(scope: dict, keys, prefix: str = ""):
    """(values, missing, ill-typed) of ``keys`` in ``scope``."""
    values, missing, bad = {}, [], []
    for key, kind in keys:
        if key not in scope:
            missing.append(prefix + key)
            continue
        raw = scope[key]
        if kind == "triple":
            v = None
            if isinstance(raw, list) and len(raw) == 3:
                items = tuple(coerce(x, _FLOAT) for x in raw)
                v = None if None in items else items
        elif kind == "object":
            v = raw if isinstance(raw, dict) else None
        else:
            v = coerce(raw, kind)
        if v is None:
            want = "list of 3 numbers" if kind == "triple" else kind
            bad.append(f"{prefix}{key}={raw!r} is not a valid {want}")
            continue
        values[key] = v
    return values, missing, bad


def _refuse(problems: list, source: str) -> None:
    if problems:
        raise ConfigError("; ".join(problems) + " (k3 refuses to substitute defaults)",
                          path=source)


def media_from_dict(doc, source: str = "<dict>") -> MediaProcConfig:
    """Build and check ``media_proc_cfg`` from a parsed preprocessor_config.json."""
    cfg = doc.get("media_proc_cfg") if isinstance(doc, dict) else None
    if not isinstance(cfg, dict):
        raise ConfigError('no "media_proc_cfg" object', path=source)
    values, missing, bad = _typed(cfg, _MEDIA_KEYS, "media_proc_cfg.")
    if "fixed_output_tokens" not in cfg:
        missing.append("media_proc_cfg.fixed_output_tokens")
    bg = values.get("transparent_bg_config")
    board = {}
    if bg is not None:
        board, m2, b2 = _typed(bg, _CHESSBOARD_KEYS, "transparent_bg_config.")
        missing += m2
        bad += b2
    _refuse(key_problems(missing, bad), source)
    errs = []
    if cfg["fixed_output_tokens"] is not None:
        errs.append(f"fixed_output_tokens={cfg['fixed_output_tokens']!r} must be null "
                    "(k3 sizes images by the patch budget only)")
    for key in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side"):
        if not 1 <= values[key] <= MAX_SIZE:
            errs.append(f"{key}={values[key]} must lie in 1..{MAX_SIZE}")
    if values["patch_limit_on_one_side"] > MAX_PATCHES_ONE_SIDE:
        errs.append(f"patch_limit_on_one_side={values['patch_limit_on_one_side']} exceeds "
                    f"{MAX_PATCHES_ONE_SIDE}, the tower's rotary table")
    if not all(s > 0 for s in values["image_std"]):
        errs.append(f"image_std={list(values['image_std'])} must be > 0")
    if values["transparent_bg_fill_stage"] not in FILL_STAGES:
        errs.append(f"transparent_bg_fill_stage={values['transparent_bg_fill_stage']!r} "
                    f"is not one of {', '.join(FILL_STAGES)}")
    if board["pattern"] != "chessboard":
        errs.append(f"transparent_bg_config.pattern={board['pattern']!r}: k3 reads only "
                    "'chessboard'")
    if board["chessboard_square_size"] < 1:
        errs.append("chessboard_square_size must be >= 1")
    for key in ("chessboard_white_value", "chessboard_gray_value"):
        if not 0 <= board[key] <= 255:
            errs.append(f"{key}={board[key]} must lie in 0..255")
    if errs:
        raise ConfigError("; ".join(errs), path=source)
    background = Chessboard(board["chessboard_square_size"],
                            board["chessboard_square_on_top_left"],
                            board["chessboard_white_value"], board["chessboard_gray_value"])
    return MediaProcConfig(
        patch_size=values["patch_size"], merge_kernel_size=values["merge_kernel_size"],
        in_patch_limit=values["in_patch_limit"],
        patch_limit_on_one_side=values["patch_limit_on_one_side"],
        image_mean=values["image_mean"], image_std=values["image_std"],
        background=background,
        transparent_bg_fill_stage=values["transparent_bg_fill_stage"], source=source)


def vision_from_dict(doc: dict, text: K3Config, media: MediaProcConfig,
                     source: str = "<dict>") -> VisionConfig:
    """Build and check the vision config from a parsed config.json holding
    ``vision_config`` (``text``: its language model; ``media``: its preprocessor)."""
    vis = doc.get("vision_config")
    if not isinstance(vis, dict):
        raise ConfigError("vision_config is not a JSON object", path=source)
    values, missing, bad = _typed(vis, _VISION_KEYS, "vision_config.")
    placeholder = _typed(doc, (("media_placeholder_token_id", _INT),))
    values.update(placeholder[0])
    _refuse(key_problems(missing + placeholder[1], bad + placeholder[2]), source)
    fixed = {k: values.pop(k) for k in _FIXED}
    errs = [f"{k}={v!r} is not supported (k3 implements {_FIXED[k]!r})"
            for k, v in fixed.items() if v != _FIXED[k]]
    for key, v in values.items():
        if type(v) is int and not 1 <= v <= MAX_SIZE and key != "media_placeholder_token_id":
            errs.append(f"{key}={v} must lie in 1..{MAX_SIZE}")
    if values["vt_num_hidden_layers"] > MAX_LAYERS:
        errs.append(f"vt_num_hidden_layers={values['vt_num_hidden_layers']} is implausible "
                    f"(at most {MAX_LAYERS})")
    merge = values["merge_kernel_size"]
    if len(merge) != 2 or merge[0] != merge[1] or merge[0] < 1:
        errs.append(f"merge_kernel_size={list(merge)} must be a square [m, m] with m >= 1")
    heads, qkv = values["vt_num_attention_heads"], values["qkv_hidden_size"]
    if heads >= 1 and (qkv % heads or (qkv // heads) % 4):
        errs.append(f"qkv_hidden_size={qkv} must split into {heads} heads of a multiple "
                    "of 4 (the 2D rotary code takes each head in quarters)")
    if values["mm_hidden_size"] != values["vt_hidden_size"]:
        errs.append(f"mm_hidden_size={values['mm_hidden_size']} must equal "
                    f"vt_hidden_size={values['vt_hidden_size']}")
    if values["text_hidden_size"] != text.hidden_size:
        errs.append(f"text_hidden_size={values['text_hidden_size']} must equal the language "
                    f"model's hidden_size={text.hidden_size}")
    if not values["projector_ln_eps"] > 0:
        errs.append(f"projector_ln_eps={values['projector_ln_eps']} must be > 0")
    token = values["media_placeholder_token_id"]
    if not 0 <= token < text.vocab_size:
        errs.append(f"media_placeholder_token_id={token} is outside the vocabulary "
                    f"0..{text.vocab_size - 1}")
    if values["patch_size"] != media.patch_size:
        errs.append(f"patch_size={values['patch_size']} differs from {media.source}'s "
                    f"{media.patch_size}")
    if len(merge) == 2 and merge[0] != media.merge_kernel_size:
        errs.append(f"merge_kernel_size={list(merge)} differs from {media.source}'s "
                    f"{media.merge_kernel_size}")
    if errs:
        raise ConfigError("; ".join(errs), path=source)
    return VisionConfig(media=media, source=source, **values)


def _read_json(p: Path, what: str):
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"missing, but config.json has vision_config ({what})",
                          path=p) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 ({e.reason} at byte {e.start})", path=p) from None
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"not valid JSON: {str(e)[:200] or type(e).__name__}",
                          path=p) from None
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror}", path=p) from None


def load_vision_config(model_dir, text: K3Config) -> VisionConfig | None:
    """The vision config of the model directory ``model_dir`` (its config.json and, when
    that has ``vision_config``, its preprocessor_config.json), or None for a text model."""
    d = Path(model_dir)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        return None                   # a config handed over directly: a text model
    doc = _read_json(cfg_path, "config")
    if not isinstance(doc, dict) or "vision_config" not in doc:
        return None
    proc_path = d / PREPROCESSOR_FILE
    media = media_from_dict(_read_json(proc_path, "the image preprocessing"),
                            source=str(proc_path))
    return vision_from_dict(doc, text, media, source=str(cfg_path))
