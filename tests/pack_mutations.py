"""One-mutation-per-case damaged packs (and one damaged checkpoint) for the pack integrity
tests: each case names what it breaks and whether k3-run and k3-pack verify must refuse
it. ``make_case`` copies a good pack (and, for checkpoint cases, the model) and applies
one mutation; the unmutated ``control`` case must be accepted by both.

Layer 4 of the tiny fixture is a KDA + MoE layer; record 3 of its expert index is an
expert of MoE layer 1. Offsets are chosen so a change stays plausible (aligned where a
check could be fooled by alignment alone).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np

MANIFEST, INDEX, TRUNK = "trunk.json", "experts.idx", "trunk.bin"
RECORD = np.dtype([("shard", "<u2"), ("layer", "<u2"), ("expert", "<u4"),
                   ("offset", "<u8"), ("nbytes", "<u8"), ("sub", "<u4", (6,))])


def _man(fn):
    def apply(d: Path, model: Path):
        doc = json.loads((d / MANIFEST).read_text())
        fn(doc)
        (d / MANIFEST).write_text(json.dumps(doc))
    return apply


def _lay(fn, L=4):
    return _man(lambda doc: fn(doc["layers"][L]))


def _ten(fn, sfx="self_attn.q_proj.weight", L=4):
    return _lay(lambda lay: fn(lay["tensors"], sfx), L)


def _raw_manifest(text: bytes):
    def apply(d: Path, model: Path):
        (d / MANIFEST).write_bytes(text)
    return apply


def _index_parts(d: Path):
    blob = (d / INDEX).read_bytes()
    hlen = int.from_bytes(blob[8:12], "little")
    return blob[:8], json.loads(blob[12:12 + hlen]), blob[12 + hlen:]


def _write_index(d: Path, magic: bytes, head, body: bytes, hlen=None):
    h = json.dumps(head).encode()
    (d / INDEX).write_bytes(magic + struct.pack("<I", len(h) if hlen is None else hlen) + h + body)


def _head(fn):
    def apply(d: Path, model: Path):
        magic, head, body = _index_parts(d)
        fn(head)
        _write_index(d, magic, head, body)
    return apply


def _rec(field, fn, i=3):
    def apply(d: Path, model: Path):
        magic, head, body = _index_parts(d)
        rec = np.frombuffer(body, RECORD).copy()
        rec[i][field] = fn(rec[i][field])
        _write_index(d, magic, head, rec.tobytes())
    return apply


def _swap_records(d: Path, model: Path):
    magic, head, body = _index_parts(d)
    rec = np.frombuffer(body, RECORD).copy()
    rec[[3, 4]] = rec[[4, 3]]
    _write_index(d, magic, head, rec.tobytes())


def _index_bytes(fn):
    def apply(d: Path, model: Path):
        (d / INDEX).write_bytes(fn((d / INDEX).read_bytes()))
    return apply


def _flip_trunk(layer: int, where: str = "middle"):
    def apply(d: Path, model: Path):
        lay = json.loads((d / MANIFEST).read_text())["layers"][layer]
        off = lay["file_off"] + (lay["nbytes"] // 2 if where == "middle" else lay["nbytes"])
        with open(d / TRUNK, "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0x04]))
    return apply


def _nan_in_trunk(d: Path, model: Path):
    """A NaN in layer 6's q_proj, with the layer's CRC updated (a pack made from a
    checkpoint that holds the NaN)."""
    doc = json.loads((d / MANIFEST).read_text())
    lay = doc["layers"][6]
    t = lay["tensors"]["self_attn.q_proj.weight"]
    with open(d / TRUNK, "r+b") as f:
        f.seek(lay["file_off"] + t["off"] + 2 * 37)
        f.write(struct.pack("<H", 0x7FC0))
        f.seek(lay["file_off"])
        lay["crc32"] = _crc(f.read(lay["nbytes"]))
    (d / MANIFEST).write_text(json.dumps(doc))


def _crc(b: bytes) -> int:
    import zlib
    return zlib.crc32(b)


def _resize_trunk(delta: int):
    def apply(d: Path, model: Path):
        size = (d / TRUNK).stat().st_size
        with open(d / TRUNK, "r+b") as f:
            f.truncate(size + delta)
    return apply


def _remove(name: str, as_dir: bool = False):
    def apply(d: Path, model: Path):
        (d / name).unlink()
        if as_dir:
            (d / name).mkdir()
    return apply


def _other_checkpoint(d: Path, model: Path):
    """The same layout and sizes, other weights: one expert region of one shard changed
    (a different fine-tune of the same architecture looks like this)."""
    shard = sorted(model.glob("*.safetensors"))[2]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.seek(size // 2)
        chunk = bytearray(f.read(4096))
        f.seek(size // 2)
        f.write(bytes(b ^ 0x01 for b in chunk))


def _source_shard_size(doc):
    first = doc["source"]["shards"][0]
    if isinstance(first, dict):
        first["size"] += 4096
    else:
        first[1] += 4096


def _swap_tensor_offsets(lay):
    t = lay["tensors"]
    t["self_attn.q_proj.weight"]["off"], t["self_attn.k_proj.weight"]["off"] = \
        t["self_attn.k_proj.weight"]["off"], t["self_attn.q_proj.weight"]["off"]


def _deep_json(d: Path, model: Path):
    (d / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)


# (name, "refuse" | "accept", text every refusal must contain (the file it names, or
# what it reports), mutation(pack_dir, model_dir) or None)
CASES = [
    ("control", "accept", None, None),
    # trunk.json: the document
    ("manifest_truncated_json", "refuse", MANIFEST, lambda d, m: (d / MANIFEST).write_bytes(
        (d / MANIFEST).read_bytes()[:200])),
    ("manifest_empty", "refuse", MANIFEST, _raw_manifest(b"")),
    ("manifest_is_a_list", "refuse", MANIFEST, _raw_manifest(b"[]")),
    ("manifest_not_utf8", "refuse", MANIFEST, _raw_manifest(b"{\"format\": \"\xff\"}")),
    ("manifest_deeply_nested", "refuse", MANIFEST, _deep_json),
    ("manifest_version_99", "refuse", MANIFEST, _man(lambda doc: doc.update(version=99))),
    ("manifest_version_1", "refuse", MANIFEST, _man(lambda doc: doc.update(version=1))),
    ("manifest_version_is_string", "refuse", MANIFEST, _man(lambda doc: doc.update(version="2"))),
    ("manifest_format_other", "refuse", MANIFEST, _man(lambda doc: doc.update(format="gguf"))),
    ("manifest_align_512", "refuse", MANIFEST, _man(lambda doc: doc.update(align=512))),
    ("manifest_no_layers_key", "refuse", MANIFEST, _man(lambda doc: doc.pop("layers"))),
    ("manifest_layers_is_object", "refuse", MANIFEST, _man(lambda doc: doc.update(layers={}))),
    ("manifest_unknown_key", "refuse", MANIFEST, _man(lambda doc: doc.update(extra=1))),
    ("manifest_trunk_bytes_plus_page", "refuse", MANIFEST,
     _man(lambda doc: doc.update(trunk_bytes=doc["trunk_bytes"] + 4096))),
    ("manifest_trunk_file_parent", "refuse", MANIFEST, _man(lambda doc: doc.update(trunk_file="../trunk.bin"))),
    ("manifest_trunk_file_absolute", "refuse", MANIFEST, _man(lambda doc: doc.update(trunk_file="/etc/hostname"))),
    ("manifest_expert_index_parent", "refuse", MANIFEST,
     _man(lambda doc: doc.update(expert_index="../experts.idx"))),
    ("manifest_model_level_offset", "refuse", MANIFEST, _man(lambda doc: doc["model_level"][
        "language_model.lm_head.weight"].update(offset=doc["model_level"][
            "language_model.lm_head.weight"]["offset"] + 2))),
    ("manifest_model_level_missing", "refuse", MANIFEST, _man(lambda doc: doc.update(model_level={}))),
    ("manifest_fingerprint_changed", "refuse", MANIFEST,
     _man(lambda doc: doc["source"].update(config_fingerprint="0" * 64))),
    ("manifest_source_shard_size", "refuse", "different checkpoint", _man(_source_shard_size)),
    ("manifest_source_sample_changed", "refuse", "model-00004-of-000014.safetensors", _man(lambda doc: doc["source"]["shards"][3].update(
        sampled_sha256="0" * 64))),
    ("manifest_config_changed", "refuse", MANIFEST, _man(lambda doc: doc["config"].update(vocab_size=1024))),
    # trunk.json: the layer table
    ("layers_missing_last", "refuse", MANIFEST, _man(lambda doc: doc["layers"].pop())),
    ("layers_duplicate", "refuse", MANIFEST, _man(lambda doc: doc["layers"].__setitem__(4, doc["layers"][3]))),
    ("layer_index_wrong", "refuse", MANIFEST, _lay(lambda lay: lay.update(layer=5))),
    ("layer_file_off_gap", "refuse", MANIFEST, _lay(lambda lay: lay.update(file_off=lay["file_off"] + 4096))),
    ("layer_file_off_unaligned", "refuse", MANIFEST, _lay(lambda lay: lay.update(file_off=lay["file_off"] + 2))),
    ("layer_file_off_string", "refuse", MANIFEST, _lay(lambda lay: lay.update(file_off=str(lay["file_off"])))),
    ("layer_file_off_bool", "refuse", MANIFEST, _man(lambda doc: doc["layers"][0].update(file_off=False))),
    ("layer_nbytes_plus_2", "refuse", MANIFEST, _lay(lambda lay: lay.update(nbytes=lay["nbytes"] + 2))),
    ("layer_nbytes_minus_2", "refuse", MANIFEST, _lay(lambda lay: lay.update(nbytes=lay["nbytes"] - 2))),
    ("layer_nbytes_huge", "refuse", MANIFEST, _lay(lambda lay: lay.update(nbytes=10**30))),
    ("layer_padded_plus_page", "refuse", MANIFEST, _lay(lambda lay: lay.update(padded=lay["padded"] + 4096))),
    ("layer_crc_flipped", "refuse", TRUNK, _lay(lambda lay: lay.update(crc32=lay["crc32"] ^ 1))),
    ("layer_crc_negative", "refuse", MANIFEST, _lay(lambda lay: lay.update(crc32=-1))),
    ("layer_crc_float", "refuse", MANIFEST, _lay(lambda lay: lay.update(crc32=float(lay["crc32"]) + 0.5))),
    ("layer_run_start_moved", "refuse", MANIFEST, _lay(lambda lay: lay.update(run_start=lay["run_start"] + 2))),
    ("layer_shard_parent", "refuse", MANIFEST, _lay(lambda lay: lay.update(shard="../" + lay["shard"]))),
    ("layer_shard_absolute", "refuse", MANIFEST, _lay(lambda lay: lay.update(shard="/etc/hostname"))),
    ("layer_shard_other", "refuse", MANIFEST, _lay(lambda lay: lay.update(
        shard=lay["shard"].replace("00005-", "00006-")))),
    ("layer_tensors_empty", "refuse", MANIFEST, _lay(lambda lay: lay.update(tensors={}))),
    # trunk.json: the tensor table of a layer
    ("tensor_dtype_f16", "refuse", MANIFEST, _ten(lambda t, s: t[s].update(dtype="F16"))),
    ("tensor_dtype_unknown", "refuse", MANIFEST, _ten(lambda t, s: t[s].update(dtype="F64"))),
    ("tensor_shape_swapped", "refuse", MANIFEST, _ten(lambda t, s: t[s].update(shape=t[s]["shape"][::-1]))),
    ("tensor_shape_negative", "refuse", MANIFEST, _ten(lambda t, s: t[s].update(shape=[-1, 128]))),
    ("tensor_shape_float", "refuse", MANIFEST, _ten(lambda t, s: t[s].update(shape=[float(x) for x in t[s]["shape"]]))),
    ("tensor_off_plus_2", "refuse", MANIFEST, _ten(lambda t, s: t[s].update(off=t[s]["off"] + 2))),
    ("tensor_off_outside_run", "refuse", MANIFEST, _ten(lambda t, s: t[s].update(off=10**7))),
    ("tensor_nbytes_wrong", "refuse", MANIFEST, _ten(lambda t, s: t[s].update(nbytes=t[s]["nbytes"] - 2))),
    ("tensor_removed", "refuse", MANIFEST, _ten(lambda t, s: t.pop(s))),
    ("tensor_extra", "refuse", MANIFEST, _ten(lambda t, s: t.update({"self_attn.extra.weight": t[s]}))),
    ("tensor_offsets_swapped", "refuse", MANIFEST, _lay(_swap_tensor_offsets)),
    # trunk.bin
    ("trunk_flip_pinned_or_streamed_layer", "refuse", TRUNK, _flip_trunk(5)),
    ("trunk_flip_last_layer", "refuse", TRUNK, _flip_trunk(12)),
    ("trunk_flip_padding", "accept", None, _flip_trunk(3, where="padding")),
    ("trunk_nan_with_matching_crc", "refuse", "layer 6", _nan_in_trunk),
    ("trunk_truncated_page", "refuse", TRUNK, _resize_trunk(-4096)),
    ("trunk_extended_page", "refuse", TRUNK, _resize_trunk(4096)),
    ("trunk_missing", "refuse", TRUNK, _remove(TRUNK)),
    ("trunk_is_a_directory", "refuse", TRUNK, _remove(TRUNK, as_dir=True)),
    # experts.idx
    ("index_missing", "refuse", INDEX, _remove(INDEX)),
    ("index_bad_magic", "refuse", INDEX, _index_bytes(lambda b: b"K3EXPIDY" + b[8:])),
    ("index_header_length_huge", "refuse", INDEX, _index_bytes(lambda b: b[:8] + struct.pack("<I", 2**31) + b[12:])),
    ("index_header_length_zero", "refuse", INDEX, _index_bytes(lambda b: b[:8] + struct.pack("<I", 0) + b[12:])),
    ("index_short_file", "refuse", INDEX, _index_bytes(lambda b: b[:10])),
    ("index_header_not_json", "refuse", INDEX, _index_bytes(lambda b: b[:12] + b"\x00" + b[13:])),
    ("index_header_is_list", "refuse", INDEX, lambda d, m: _write_index(d, b"K3EXPIDX", [], b"")),
    ("index_version_99", "refuse", INDEX, _head(lambda h: h.update(version=99))),
    ("index_records_plus_1", "refuse", INDEX, _head(lambda h: h.update(records=h["records"] + 1))),
    ("index_records_string", "refuse", INDEX, _head(lambda h: h.update(records=str(h["records"])))),
    ("index_record_bytes_40", "refuse", INDEX, _head(lambda h: h.update(record_bytes=40))),
    ("index_n_experts_changed", "refuse", INDEX, _head(lambda h: h.update(n_experts=h["n_experts"] + 1))),
    ("index_moe_layers_changed", "refuse", INDEX, _head(lambda h: h.update(moe_layers=h["moe_layers"][1:]))),
    ("index_parts_shape_changed", "refuse", INDEX, _head(lambda h: h["parts"][0].__setitem__(2, [1, 1]))),
    ("index_shard_name_parent", "refuse", INDEX, _head(lambda h: h["shards"].__setitem__(0, "../x.safetensors"))),
    ("index_unknown_key", "refuse", INDEX, _head(lambda h: h.update(extra=1))),
    ("index_body_minus_1_byte", "refuse", INDEX, _index_bytes(lambda b: b[:-1])),
    ("index_body_plus_record", "refuse", INDEX, _index_bytes(lambda b: b + b[-48:])),
    ("record_offset_plus_1", "refuse", INDEX, _rec("offset", lambda v: v + 1)),
    ("record_nbytes_plus_1", "refuse", INDEX, _rec("nbytes", lambda v: v + 1)),
    ("record_shard_out_of_range", "refuse", INDEX, _rec("shard", lambda v: 9999)),
    ("record_layer_dense", "refuse", INDEX, _rec("layer", lambda v: 0)),
    ("record_expert_out_of_range", "refuse", INDEX, _rec("expert", lambda v: 99)),
    ("record_sub_offset_changed", "refuse", INDEX, _rec("sub", lambda v: v + np.array([0, 1, 0, 0, 0, 0], "<u4"))),
    ("records_swapped", "refuse", INDEX, _swap_records),
    # the checkpoint beside the pack
    ("checkpoint_other_weights_same_layout", "refuse", "model-00003-of-000014.safetensors", _other_checkpoint),
]


def make_case(name: str, good_pack: Path, work: Path, model: Path):
    """(pack dir, model dir) for case ``name``: copies of the good ones, one mutation."""
    mutate = {n: f for n, _, _, f in CASES}[name]
    work.mkdir(parents=True, exist_ok=True)
    d = work / "pack"
    shutil.copytree(good_pack, d)
    if name.startswith("checkpoint_"):
        model = shutil.copytree(model, work / "model")
    if mutate is not None:
        mutate(d, Path(model))
    return d, Path(model)
