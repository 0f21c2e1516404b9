"""The strict checkpoint reader on image tensors (formats/model/vision.md §3.3), on copies of
fixtures/tiny with one defect each."""

from __future__ import annotations

import json
import shutil

import pytest

from libk3 import names
from libk3.errors import CheckpointError
from libk3.io.checkpoint import Checkpoint
from libk3.io.safetensors import read_header, write_shard
from libk3.pack.schema import MANIFEST_FILE, TRUNK_FILE

from .scripts import k3pack_here

INDEX = "model.safetensors.index.json"


def _mutated(tiny_dir, dst, edit):
    """A copy of the fixture whose image shard's tensors, as a list of
    [name, dtype, shape, bytes], went through ``edit``; the index follows."""
    shutil.copytree(tiny_dir, dst, ignore=shutil.ignore_patterns("draft"))
    idx = json.loads((dst / INDEX).read_text())
    shard = dst / idx["weight_map"][names.VISION_PATCH_EMBED]
    blob = shard.read_bytes()
    tensors = [[e.name, e.dtype, tuple(e.shape), blob[e.offset:e.offset + e.nbytes]]
               for e in read_header(shard)]
    tensors = edit(tensors)
    write_shard(shard, [tuple(t) for t in tensors])
    wm = {n: f for n, f in idx["weight_map"].items() if not names.is_vision(n)}
    wm.update({t[0]: shard.name for t in tensors})
    idx["weight_map"] = wm
    (dst / INDEX).write_text(json.dumps(idx))
    return dst, shard


def _drop(victim):
    return lambda ts: [t for t in ts if t[0] != victim]


def _transpose(victim):
    def edit(ts):
        for t in ts:
            if t[0] == victim:
                t[2] = t[2][::-1]
        return ts
    return edit


def _as_u8(victim):
    def edit(ts):
        for t in ts:
            if t[0] == victim:
                t[1], t[3] = "U8", t[3][:len(t[3]) // 2]
        return ts
    return edit


def _extra(ts):
    return ts + [["mm_projector.rot_proj.weight", "BF16", (4, 4), bytes(32)]]


WQKV = names.vision_block(1, "wqkv.weight")
WO = names.vision_block(0, "wo.weight")


@pytest.mark.parametrize("case,edit,victim", [
    ("missing", _drop(WO), WO),
    ("transposed", _transpose(WQKV), WQKV),
    ("mistyped", _as_u8(names.PROJECTOR_POST_NORM), names.PROJECTOR_POST_NORM),
    ("extra", _extra, "mm_projector.rot_proj.weight"),
])
def test_checkpoint_vision_tensor_defect_refused_naming_tensor_and_file(
        tiny_dir, tmp_path, case, edit, victim):
    """Catches a reader that skips image tensors when vision_config is present: a missing,
    transposed, integer-typed or unknown one must be one line naming it and its file."""
    d, shard = _mutated(tiny_dir, tmp_path / case, edit)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    msg = e.value.one_line()
    assert f"tensor {victim}" in msg and "\n" not in msg, msg
    assert str(d if case == "missing" else shard) in msg, msg
    assert e.value.exit_code == 3


def test_checkpoint_vision_tensor_defect_control(tiny_dir, tmp_path):
    """Control: the same rewrite with no edit opens, with the image config read; without
    vision_config the defective tower is ignored (a text model)."""
    d, _ = _mutated(tiny_dir, tmp_path / "same", lambda ts: ts)
    with Checkpoint.open(d) as ck:
        assert ck.vision_config.vt_num_hidden_layers == 2
        assert names.VISION_PATCH_EMBED not in ck           # not in the language model's table
    d, _ = _mutated(tiny_dir, tmp_path / "text", _transpose(WQKV))
    doc = json.loads((d / "config.json").read_text())
    del doc["vision_config"]
    (d / "config.json").write_text(json.dumps(doc))
    with Checkpoint.open(d) as ck:
        assert ck.vision_config is None


def test_checkpoint_vision_defect_exits_3_from_k3_pack(tiny_dir, tmp_path):
    """Catches a tool that lets an image-tensor error through as a traceback or another
    exit code; control: the fixture itself packs."""
    d, _ = _mutated(tiny_dir, tmp_path / "bad", _transpose(WQKV))
    p = k3pack_here(d, tmp_path / "bad.pack", "--quiet")
    assert p.returncode == 3 and WQKV in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    ok = k3pack_here(tiny_dir, tmp_path / "ok.pack", "--quiet")
    assert ok.returncode == 0, ok.stderr
    manifest = (tmp_path / "ok.pack" / MANIFEST_FILE).read_text()
    assert "vision_tower" not in manifest and "mm_projector" not in manifest
    trunk = (tmp_path / "ok.pack" / TRUNK_FILE).read_bytes()
    with Checkpoint.open(tiny_dir) as ck:                   # no image tensor's bytes copied
        tower = ck.read_span(ck.vision_entry(names.VISION_PATCH_EMBED).path,
                             ck.vision_entry(names.VISION_PATCH_EMBED).offset, 64).tobytes()
    assert tower not in trunk
