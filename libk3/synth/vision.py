"""The image tower and projector of a synthetic K3 checkpoint (formats/model/vision.md §3.3).

Owns: each preset's ``vision_config`` document and root placeholder key, the published
``preprocessor_config.json`` (the same in every preset: preprocessing has no width to
shrink), and the 168 image tensors with their values. Does not own: the language model's
tensors, shard layout or file writing (``libk3.synth.checkpoint``), the inventory
(``libk3.io.inventory``).

Why these values: a check of the tower must see every wrong reading. The patch embedding,
``wqkv`` and ``fc0`` are drawn at twice 1/sqrt(fan-in), so attention is neither flat nor
one-hot and the GELU inputs reach the range where its tanh and erf forms differ most; the
position table is as large as the patch embedding's output, so resizing it matters; norm
gains are 1 plus small noise; everything else is 1/sqrt(fan-in).

Every tensor draws from its own generator seeded by (seed, crc32(name)), as the language
model's do, so adding the tower leaves every language-model byte unchanged.
"""

from __future__ import annotations

import numpy as np

from .. import names
from ..io.inventory import vision_specs
from ..k3_dims import MEDIA_PLACEHOLDER_SLOT, MEDIA_PROC
from ..vision_config import PREPROCESSOR_FILE, VisionConfig, media_from_dict, vision_from_dict
from .presets import VISIONS
from .values import encode, normal_rows, tensor_rng

_WIDE = (names.VISION_PATCH_EMBED, "wqkv.weight", "mlp.fc0.weight")   # 2 / sqrt(fan-in)


def preprocessor_doc() -> dict:
    """preprocessor_config.json as published (formats/model/vision.md §2.2)."""
    return {"media_proc_cfg": dict(MEDIA_PROC)}


def root_keys(preset: str, n_ranks: int) -> dict:
    """The config.json root keys of the image input: vision_config and the placeholder id."""
    return {"vision_config": dict(VISIONS[preset]),
            "media_placeholder_token_id": n_ranks + MEDIA_PLACEHOLDER_SLOT}


def preset_vision(preset: str, text, n_ranks: int) -> VisionConfig:
    """The checked VisionConfig the preset writes (``text``: its K3Config)."""
    media = media_from_dict(preprocessor_doc(), source=f"<preset {preset} {PREPROCESSOR_FILE}>")
    return vision_from_dict(root_keys(preset, n_ranks), text, media,
                            source=f"<preset {preset} config.json>")


def _values(name: str, shape: tuple, seed: int):
    """Yield float32 chunks (row-major) of one image tensor's synthetic values."""
    rng = tensor_rng(seed, name)
    if len(shape) == 1:                                       # norm gains
        for _, v in normal_rows(rng, shape, 0.1):
            yield v + np.float32(1.0)
        return
    if name == names.VISION_POS_EMB:                          # (H, W, D) table
        for _, v in normal_rows(rng, shape, 1.0):
            yield v
        return
    rows = (shape[0], int(np.prod(shape[1:])))                # the conv weight as [D, 3 p p]
    scale = (2.0 if name.endswith(_WIDE) else 1.0) / np.sqrt(rows[1])
    for _, v in normal_rows(rng, rows, scale):
        yield v


def vision_tensors(vcfg: VisionConfig, seed: int, sparse: bool, part: str) -> list:
    """(name, dtype, shape, data) of the tower (``part`` "vision") or the projector
    ("projector") or both ("all"), BF16, in the inventory's order; data None when sparse."""
    out = []
    for spec in vision_specs(vcfg):
        is_proj = spec.name.startswith("mm_projector.")
        if part != "all" and is_proj != (part == "projector"):
            continue
        data = None if sparse else (lambda s=spec: encode(_values(s.name, s.shape, seed), "BF16"))
        out.append((spec.name, "BF16", spec.shape, data))
    return out
