"""What image tensors a K3 checkpoint with ``vision_config`` must hold, and the check.

Owns: the 168-tensor inventory of the tower and projector derived from a
``VisionConfig`` (formats/vision.md §3), and checking a checkpoint's image tensors against
it: every name present with its exact shape and a float dtype, nothing else under
``vision_tower.`` or ``mm_projector.``. Does not own: the language-model inventory
(``libk3.io.inventory``), reading headers or bytes (``libk3.io.checkpoint``).

The dtypes accepted are the language model's float ones (``inventory.FLOAT``), for the
same reason: the release stores BF16, safetensors allows any float, and each tensor is
computed with the dtype its header gives.
"""

from __future__ import annotations

from pathlib import Path

from .. import names
from ..errors import CheckpointError
from ..vision_config import VisionConfig
from .inventory import MATRIX, VECTOR, TensorSpec

_SHOW = 5


def vision_specs(vcfg: VisionConfig) -> list:
    """TensorSpecs of the tower and projector, in the order the synthetic writer lays
    them out (formats/vision.md §3.1)."""
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
