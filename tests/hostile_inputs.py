"""Builders of the hostile suite's inputs (tests/test_hostile_*.py): a model directory with
a given config.json or with other weights, small traces and re-headed traces, crafted state
files, and the one random damage (truncate, flip a byte, append) every file format must
refuse.

Crafted files keep their framing and checksums right, so only the edited part is wrong
and a test shows that part is checked (not merely caught by a checksum).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import zlib

import numpy as np
from hypothesis import strategies as st

from libk3.trace import format as tr

NESTED = "[" * 100_000 + "]" * 100_000     # past json's recursion limit
HUGE_INT = "9" * 5000                      # past Python's 4,300-digit int parsing limit


def model_with_config(tiny_dir, d, text: str):
    """A model directory ``d``: tiny's shards and tokenizer (linked) and this config."""
    d.mkdir(exist_ok=True)
    for f in tiny_dir.iterdir():
        if f.name != "config.json" and not (d / f.name).exists():
            (d / f.name).symlink_to(f)
    (d / "config.json").write_text(text)
    return d


def model_with_other_weights(tiny_dir, d):
    """A copy ``d`` of tiny with the same config and other weights: the lowest mantissa
    bit of the first value of its first shard flipped (so every weight stays finite),
    inside a block the weights' identity samples (formats/pack.md ``sampled_sha256``)."""
    shutil.copytree(tiny_dir, d)
    shard = sorted(d.glob("*.safetensors"))[0]
    with open(shard, "r+b") as f:
        first = 8 + int.from_bytes(f.read(8), "little")
        f.seek(first)
        byte = f.read(1)
        f.seek(first)
        f.write(bytes([byte[0] ^ 0x01]))
    return d


def damaged(data, blob: bytes) -> bytes:
    """One random damage drawn by hypothesis ``data``: truncated anywhere, one byte
    flipped, or bytes appended."""
    kind = data.draw(st.sampled_from(["truncate", "flip", "append"]))
    if kind == "truncate":
        return blob[:data.draw(st.integers(0, len(blob) - 1))]
    if kind == "flip":
        i = data.draw(st.integers(0, len(blob) - 1))
        return blob[:i] + bytes([blob[i] ^ data.draw(st.integers(1, 255))]) + blob[i + 1:]
    return blob + data.draw(st.binary(min_size=1, max_size=64))


# ---- traces ----------------------------------------------------------------------------------

TRACE_HEADER = tr.TraceHeader(checkpoint="x", expert_bytes=1000, n_layers=4, n_experts=8,
                              top_k=2, source="k3-run", created_by="test")


def small_trace(path, n: int = 300, frame_records: int = 64, **header):
    """A complete trace of ``n`` decode records over 4 layers x 8 experts; ``header``
    fields, if given, are rewritten afterwards (checksum kept right)."""
    rec = np.zeros(n, tr.RECORD_DTYPE)
    rec["pos"] = np.arange(n) // 8
    rec["layer"] = np.arange(n) % 4
    rec["expert"] = (np.arange(n) * 7) % 8
    rec["phase"] = tr.PHASE_DECODE
    with tr.TraceWriter(path, TRACE_HEADER, frame_records=frame_records) as w:
        w.append_records(rec)
    if header:
        doc = dict(TRACE_HEADER.to_json(), **header)
        path.write_bytes(rewrite_trace_header(path.read_bytes(), json.dumps(doc).encode()))
    return path


def rewrite_trace_header(blob: bytes, text: bytes) -> bytes:
    """The trace ``blob`` with its JSON header replaced by ``text`` (length and CRC-32 set)."""
    _, version, hlen, _ = tr.FILE_HEAD.unpack_from(blob)
    return (tr.FILE_HEAD.pack(tr.MAGIC, version, len(text), zlib.crc32(text)) + text
            + blob[tr.FILE_HEAD.size + hlen:])


# ---- state files -----------------------------------------------------------------------------

_PREFIX = struct.Struct("<8sII")           # formats/state.md: magic, version, header bytes
_DIGEST = 32                               # v2: sha256 trailer


def state_header(blob: bytes) -> dict:
    _, _, hlen = _PREFIX.unpack_from(blob)
    return json.loads(blob[_PREFIX.size:_PREFIX.size + hlen])


def craft_state(blob: bytes, edit=None, header: bytes | None = None, version=None) -> bytes:
    """The state ``blob`` with its header edited in place by ``edit(dict)`` (or replaced by
    ``header`` bytes) and, when given, another ``version``; framed and checksummed as the
    writer would (v1 files had no checksum)."""
    magic, ver, hlen = _PREFIX.unpack_from(blob)
    head = state_header(blob)
    if edit is not None:
        edit(head)
    text = header if header is not None else json.dumps(head, sort_keys=True).encode()
    body = blob[_PREFIX.size + hlen:]
    arrays = body[:-_DIGEST] if ver >= 2 else body
    ver = ver if version is None else version
    out = _PREFIX.pack(magic, ver, len(text)) + text + arrays
    return out + hashlib.sha256(out).digest() if ver >= 2 else out
