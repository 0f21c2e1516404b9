"""Synthetic DSpark drafts: a complete draft directory for a synthetic target
(formats/synthetic-checkpoint.md, "Drafts").

Owns: the draft's ``config.json`` (the published draft's keys, dspark.md §2.1, with the
preset's dimensions from ``presets.DRAFTS`` and the target's sizes), and its one
``model.safetensors`` holding exactly the tensors of dspark.md §3.1, all BF16, bare
names, in the order of the inventory: the embedding copy is the target's embedding
bytes, every other tensor is drawn from its own generator. Does not own: the inventory
(``DraftConfig.tensor_shapes``, which the reader checks against too), the value streams
(``libk3.synth.values``) or the target (``libk3.synth.checkpoint``).

Why these scales: every projection is N(0, 1/fan_in), so with an O(1) input (each one
but the context projection reads a normed row, and that one is normed after) its outputs
are O(1); norm gains are 1 + 0.1 N(0,1), not all ones, so a gain applied to the wrong
rows shows; the Markov W1 is a lookup table (row = previous token), N(0,1), and W2
N(0, 1/rank), so the Markov bias is O(1) beside the target's logits and can change the
argmax; the confidence head is N(0, 1/fan_in) with an N(0, 0.25) bias, so its logistic
unit is neither always 0 nor always 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .. import names
from ..config import K3Config, config_from_dict, load_config
from ..draft.config import draft_config_from_dict
from ..errors import CheckpointError, ConfigError, UsageError
from ..io.atomic import building_dir, write_json
from ..io.checkpoint import Checkpoint
from ..io.safetensors import read_header, write_shard
from ..k3_dims import DSPARK
from .presets import DRAFTS, PRESETS
from .values import encode, normal_rows, tensor_rng

DRAFT_DIR = "draft"                  # where ``k3-pack synth --draft`` puts a target's draft
DRAFT_FILE = "model.safetensors"
EMBED = "embed_tokens.weight"
# The mask token takes a special-token slot of the target's vocabulary, as the published
# draft's 163837 does (dspark.md §2.1): the third from the end.
MASK_FROM_END = 3
_EMBED_CHUNK = 1 << 26               # bytes of the target's embedding copied per read


def preset_of(target: K3Config) -> str:
    """The synthetic preset whose architecture ``target`` has (every config field but
    its source); ConfigError naming the target's config when none does."""
    want = target.fingerprint()
    for name, (flat, *_) in PRESETS.items():
        if config_from_dict(dict(flat), source=f"<preset {name}>").fingerprint() == want:
            return name
    raise ConfigError("the target has the dimensions of no synthetic preset",
                      path=target.source,
                      hint="synthetic drafts are made for `k3-pack synth` checkpoints")


def draft_config_doc(target: K3Config, preset: str) -> dict:
    """The draft's config.json for a target of ``preset``: the published draft's keys
    (``k3_dims.DSPARK``), the preset's dimensions, and the sizes the target fixes
    (dspark.md §2.3)."""
    doc = dict(DSPARK, **DRAFTS[preset])
    doc.update(hidden_size=target.hidden_size, target_hidden_size=target.hidden_size,
               target_num_hidden_layers=target.num_hidden_layers,
               vocab_size=target.vocab_size,
               mask_token_id=target.vocab_size - MASK_FROM_END,
               num_target_layers=len(doc["target_layer_ids"]))
    return doc


def synth_draft(target_dir, out_dir, seed: int = 0, preset: str | None = None) -> Path:
    """Write the synthetic draft of the synthetic target ``target_dir`` into ``out_dir``
    (absent or empty). ``preset`` defaults to the one whose dimensions the target has.

    Built in a hidden sibling directory and renamed into place at the end, so ``out_dir``
    only ever appears complete. Returns the Path of ``out_dir``."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise UsageError("destination exists and is not empty; refusing to overwrite",
                         path=out)
    with building_dir(out) as tmp:
        write_draft(target_dir, tmp, seed=seed, preset=preset)
    return out


def write_draft(target_dir, dest, seed: int = 0, preset: str | None = None) -> None:
    """Every file of the draft into the existing, empty directory ``dest``."""
    dest = Path(dest)
    target = load_config(target_dir)
    if preset is None:
        preset = preset_of(target)
    doc = draft_config_doc(target, preset)
    cfg = draft_config_from_dict(doc, source=f"<draft of preset {preset}>")
    cfg.check_against(target)
    shapes = cfg.tensor_shapes()
    if PRESETS[preset][2]:          # sparse: every tensor a hole, like the target's
        write_shard(dest / DRAFT_FILE, [(n, "BF16", s, None) for n, s in shapes.items()])
    else:
        with Checkpoint.open(target_dir, config=target, validate=False) as ckpt:
            write_shard(dest / DRAFT_FILE, [
                (n, "BF16", s, _embedding_bytes(ckpt, s) if n == EMBED
                 else (lambda n=n, s=s: _encoded(n, s, seed)))
                for n, s in shapes.items()])
    write_json(dest / "config.json", doc)


def _embedding_bytes(ckpt: Checkpoint, shape: tuple):
    """The target's embedding bytes, in chunks (the draft's copy is the same tensor,
    dspark.md §3.1)."""
    ent = ckpt.entry(names.EMBED)
    if ent.dtype != "BF16" or ent.shape != tuple(shape):
        raise CheckpointError("the target's embedding cannot be the draft's copy",
                              path=ent.path, tensor=ent.name,
                              expected=f"{list(shape)} BF16",
                              found=f"{list(ent.shape)} {ent.dtype}")

    def chunks():
        for start in range(0, ent.nbytes, _EMBED_CHUNK):
            n = min(_EMBED_CHUNK, ent.nbytes - start)
            yield ckpt.read_span(ent.path, ent.offset + start, n)
    return chunks


def _recipe(name: str, shape: tuple):
    """(offset, scale) of the N(offset, scale^2) values of tensor ``name``; see the
    module docstring."""
    if name.endswith("norm.weight") or name.startswith("fc_norm."):
        return 1.0, 0.1
    if name == "markov_head.markov_w1.weight":
        return 0.0, 1.0
    if name == "confidence_head.proj.bias":
        return 0.0, 0.5
    return 0.0, 1.0 / math.sqrt(shape[-1])


def _encoded(name: str, shape: tuple, seed: int):
    offset, scale = _recipe(name, shape)

    def values():
        for _, v in normal_rows(tensor_rng(seed, name), shape, scale):
            if offset:
                v += np.float32(offset)
            yield v
    return encode(values(), "BF16")


def draft_summary(draft_dir) -> dict:
    """Tensor count, taps, apparent and on-disk bytes of a synthetic draft directory."""
    d = Path(draft_dir)
    shard = d / DRAFT_FILE
    doc = json.loads((d / "config.json").read_text(encoding="utf-8"))
    return {"path": str(d), "tensors": len(read_header(shard)),
            "target_layer_ids": doc["target_layer_ids"],
            "apparent_bytes": shard.stat().st_size, "disk_bytes": shard.stat().st_blocks * 512}
