"""The identity of a checkpoint's weights: what a pack, a saved state (and any cache of
states) records to recognise the checkpoint it was made from.

Owns: the sampled content digest of a shard (formats/pack.md ``sampled_sha256``), a
checkpoint's ``source`` (its config fingerprint plus every shard's name, size and
digest: trunk.json's ``source``), and ``weights_identity``, that source as one hex
string (formats/state.md ``weights``). Does not own: comparing a pack's manifest against
a checkpoint (``libk3.pack.schema``) or reading a state (``libk3.model.state``).

Why sampled content: names and sizes alone accept another fine-tune of the same
architecture; hashing whole shards (1.56 TB) at every start is out of the question, four
64 KiB blocks per shard are not. What it does not see: a change that misses every
sampled block (only ``k3-pack verify --against`` compares every trunk byte).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import weakref

SAMPLE_BLOCK = 64 << 10          # bytes per sampled block of a shard (formats/pack.md)


def sample_blocks(size: int, data_start: int) -> list:
    """(offset, length) of the blocks a shard's digest covers: the first, the first data
    bytes (after the safetensors header), the middle and the last SAMPLE_BLOCK; the whole
    file when it is at most four blocks long."""
    if size <= 4 * SAMPLE_BLOCK:
        return [(0, size)]
    starts = {0, min(max(data_start, 0), size - SAMPLE_BLOCK),
              size // 2 - SAMPLE_BLOCK // 2, size - SAMPLE_BLOCK}
    return [(s, SAMPLE_BLOCK) for s in sorted(starts)]


def shard_digest(ckpt, path: str, size: int) -> str:
    """sha256 over each sampled block's offset (u64 LE) and bytes."""
    return _sampled_digest(lambda off, n: ckpt.read_span(path, off, n), size)


def file_digest(path) -> tuple:
    """(size, ``shard_digest``) of a safetensors file read directly (a draft's files,
    which no Checkpoint reads)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return size, _sampled_digest(lambda off, n: os.pread(fd, n, off), size)
    finally:
        os.close(fd)


def _sampled_digest(read, size: int) -> str:
    h = hashlib.sha256()
    head = read(0, 8) if size >= 8 else b""
    data_start = 8 + int.from_bytes(bytes(head), "little") if size >= 8 else 0
    for off, n in sample_blocks(size, data_start):
        h.update(off.to_bytes(8, "little"))
        h.update(read(off, n))
    return h.hexdigest()


_SOURCES = weakref.WeakKeyDictionary()    # an open Checkpoint -> its source_identity


def source_identity(ckpt) -> dict:
    """trunk.json's ``source``: what a pack records to recognise its checkpoint. Read once
    per open checkpoint (a run checks a state file against it before its session asks
    again); a copy each call."""
    if ckpt not in _SOURCES:
        ident = ckpt.identity()
        _SOURCES[ckpt] = {"config_fingerprint": ident["config_fingerprint"],
                          "shards": [{"name": name, "size": size,
                                      "sampled_sha256": shard_digest(ckpt, path, size)}
                                     for path, (name, size) in zip(ckpt.shards,
                                                                   ident["shards"])]}
    return copy.deepcopy(_SOURCES[ckpt])


def weights_identity(ckpt, source: dict | None = None) -> str:
    """The identity of ``ckpt``'s weights as 64 hex digits: the sha256 of its
    ``source_identity`` as canonical JSON (keys sorted, no spaces). The same whether a
    run streams the trunk from a pack or from the shards (a pack's ``source`` is checked
    to equal the checkpoint's); two checkpoints of one configuration with other weights
    differ in it (up to the sampling above). ``source``: that dict when already at hand
    and checked against ``ckpt`` (a pack's manifest after ``open_pack(pack, ckpt)``),
    which saves re-reading the sampled blocks; else they are read (four per shard)."""
    return digest_of(source_identity(ckpt) if source is None else source)


def digest_of(source: dict) -> str:
    """An identity's 64 hex digits: the sha256 of ``source`` as canonical JSON (keys
    sorted, no spaces); a checkpoint's (above) and a draft's
    (``libk3.draft.checkpoint.draft_identity``)."""
    text = json.dumps(source, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
