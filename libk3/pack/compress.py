"""Compressing a finished pack's trunk: trunk.bin becomes trunk.kz + trunk.blocks and
trunk.json goes from v2 to v3 (formats/pack.md "Compressed trunk").

Owns: reading each raw layer (checked against its CRC), encoding it
(``libk3.pack.codec``), writing it durably with a journal so an interrupted run
resumes, and the switch: trunk.kz and trunk.blocks complete and durable first, then the
new trunk.json (atomic), then trunk.bin removed. Does not own: the codec, the schema
(``libk3.pack.schema``) or packing a checkpoint (``libk3.pack.writer``).

Why in place and after packing: the raw pack is the checked copy of the checkpoint's
bytes (every layer has its CRC), so compressing reads only the pack and needs no
checkpoint; until the new trunk.json lands the raw pack stays complete and usable.
Why a trunk that would not shrink stays raw: its reads would cost as many bytes and
add a decode (formats/pack.md "Compressed trunk").
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import zlib
from pathlib import Path

import numpy as np

from ..errors import BudgetError, K3IOError
from ..io.atomic import fsync_dir, write_bytes
from .schema import (BLOCK_INDEX_FILE, COMPRESSED_TRUNK_FILE, COMPRESSED_VERSION,
                     MANIFEST_FILE, TRUNK_FILE, layer_block_plan, open_pack)
from . import codec as trunk_codec, stripes
from .verify import preadv
from ..io.direct import DirectFile, align_up, aligned_empty, window_bytes
from .schema import crc_mismatch

KZ_PARTIAL_FILE, KZ_JOURNAL_FILE = "trunk.kz.partial", "compress.journal"
ENCODE_BYTES = 64 << 20        # raw bytes read and encoded at a time (RAM: ~2x this)


@dataclasses.dataclass
class CompressResult:
    out: str
    layers: int
    layers_resumed: int
    raw_bytes: int
    stored_bytes: int
    seconds: float
    already_compressed: bool = False
    saves_nothing: bool = False       # the compressed files would not be smaller: kept raw

    @property
    def fraction(self) -> float:
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0


def compress(pack_dir, *, threads: int = 1, progress: bool = True,
             even_if_no_gain: bool = False) -> CompressResult:
    """Compress the trunk of the finished pack ``pack_dir`` (checked by ``open_pack``).
    Resumes an interrupted run; a pack already compressed is left as it is, and so is one
    whose trunk.kz and trunk.blocks would not be smaller than trunk.bin
    (``saves_nothing``; ``even_if_no_gain`` switches anyway, for tests of such packs)."""
    from .. import progress as _progress

    d = Path(pack_dir)
    pk = open_pack(d)
    man = pk.manifest
    lays = man["layers"]
    raw_total = sum(l["nbytes"] for l in lays)
    raw_lay = pk.stripes and stripes.renamed(pk.stripes, TRUNK_FILE)
    if pk.compressed:
        (d / TRUNK_FILE).unlink(missing_ok=True)       # an interrupted switch's leftover
        for p in raw_lay.paths if raw_lay else ():
            p.unlink(missing_ok=True)
        (d / KZ_JOURNAL_FILE).unlink(missing_ok=True)
        return CompressResult(str(d), len(lays), len(lays), raw_total,
                              sum(l["stored"] for l in lays), 0.0, already_compressed=True)
    kz_lay = pk.stripes and stripes.renamed(pk.stripes, COMPRESSED_TRUNK_FILE)
    for done_p, part in ([(q, q.with_name(q.name + ".partial")) for q in kz_lay.paths]
                         if kz_lay else [(d / COMPRESSED_TRUNK_FILE, d / KZ_PARTIAL_FILE)]):
        if done_p.exists():                            # renamed, but trunk.json not switched
            os.replace(done_p, part)
    plans = [layer_block_plan(l) for l in lays]
    head = {"version": COMPRESSED_VERSION, "source": man["source"],
            "codec": trunk_codec.codec_params(), "crc32": [l["crc32"] for l in lays]}
    t0 = time.perf_counter()
    out = stripes.StripedOut(kz_lay, direct=False, header_now=False) if kz_lay else \
        os.open(d / KZ_PARTIAL_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        done = _resume(d, head, plans, out)
        for p, share in ([(q.parent, n) for q, n in zip(pk.stripes.paths, pk.stripes.sizes)]
                         if kz_lay else [(d, man["trunk_bytes"])]):
            free = shutil.disk_usage(p).free    # stored <= raw for trained weights
            if share - sum(align_up(int(r["stored"].sum())) for r in done) // \
                    (pk.stripes.count if kz_lay else 1) > free:
                raise BudgetError("not enough free disk to compress the trunk beside "
                                  "trunk.bin", path=p, expected=f"{share} bytes",
                                  found=f"{free} bytes free")
    except BaseException:
        out.close() if kz_lay else os.close(out)
        raise
    resumed = len(done)
    codec = trunk_codec.Codec(threads)
    src = stripes.open_reader(pk.stripes, d / TRUNK_FILE) if pk.stripes else \
        DirectFile(d / TRUNK_FILE)
    buf = aligned_empty(window_bytes(ENCODE_BYTES))
    fd = out
    off = sum(align_up(int(r["stored"].sum())) for r in done)
    try:
        bar = _progress.bar(total=raw_total, initial=sum(l["nbytes"] for l in lays[:len(done)]),
                            unit="B", unit_scale=True, desc="k3-pack compress", show=progress)
        for lay, plan in zip(lays[len(done):], plans[len(done):]):
            L, crc, recs = lay["layer"], 0, []
            for lo, hi in plan.groups(ENCODE_BYTES, stored=False):
                a, n = plan.span(lo, hi, stored=False)
                at = src.read_window(lay["file_off"] + a, n, buf, what=f"layer {L} trunk")
                crc = zlib.crc32(buf[at:at + n], crc)
                blob, rec = codec.encode(buf, plan, lo, hi, at)
                _write_at(fd, blob, off, d / KZ_PARTIAL_FILE)
                off += len(blob)
                recs.append(rec)
                bar.update(n)
            if crc != lay["crc32"]:       # journaled only if intact: never compress damage
                raise crc_mismatch(d / TRUNK_FILE, L, lay["crc32"], crc)
            _write_at(fd, bytes(align_up(off) - off), off, d / KZ_PARTIAL_FILE)
            off = align_up(off)
            _fsync(fd)
            rec = np.concatenate(recs)
            _journal_append(d, {"layer": L, "index": rec.tobytes().hex()})
            done.append(rec)
        bar.close()
        fd.truncate(off) if kz_lay else os.ftruncate(fd, off)
        _fsync(fd)
    finally:
        fd.close() if kz_lay else os.close(fd)
        src.close()
        codec.close()
    if off + sum(r.nbytes for r in done) >= man["trunk_bytes"] and not even_if_no_gain:
        out.discard() if kz_lay else (d / KZ_PARTIAL_FILE).unlink()
        (d / KZ_JOURNAL_FILE).unlink(missing_ok=True)
        fsync_dir(d)
        return CompressResult(str(d), len(lays), resumed, raw_total,
                              sum(int(r["stored"].sum()) for r in done),
                              time.perf_counter() - t0, saves_nothing=True)
    stored = _switch(d, man, done, out if kz_lay else None, raw_lay)
    return CompressResult(str(d), len(lays), resumed, raw_total, stored,
                          time.perf_counter() - t0)


def _switch(d: Path, man: dict, recs: list, out=None, raw_lay=None) -> int:
    """Make the compressed trunk the pack's: trunk.blocks, trunk.kz (or its stripes,
    ``out``), then trunk.json (each durable before the next), then remove trunk.bin (or
    its stripes, ``raw_lay``) and the journal. Returns stored bytes."""
    index = b"".join(r.tobytes() for r in recs)
    write_bytes(d / BLOCK_INDEX_FILE, index)
    if out is not None:
        out.finish()
    else:
        os.replace(d / KZ_PARTIAL_FILE, d / COMPRESSED_TRUNK_FILE)
    fsync_dir(d)
    layers, off = [], 0
    for lay, r in zip(man["layers"], recs):
        stored = int(r["stored"].sum())
        layers.append({**lay, "stored": stored, "padded": align_up(stored), "file_off": off})
        off += align_up(stored)
    doc = {**man, "version": COMPRESSED_VERSION, "trunk_file": COMPRESSED_TRUNK_FILE,
           "trunk_bytes": off, "layers": layers,
           "trunk_codec": {**trunk_codec.codec_params(), "block_index": BLOCK_INDEX_FILE,
                           "block_index_bytes": len(index),
                           "block_index_crc32": zlib.crc32(index)},
           **({"stripes": out.field(man["stripes"])} if out is not None else {})}
    write_bytes(d / MANIFEST_FILE, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
    (d / TRUNK_FILE).unlink(missing_ok=True)
    for p in raw_lay.paths if raw_lay else ():
        p.unlink(missing_ok=True)
    (d / KZ_JOURNAL_FILE).unlink(missing_ok=True)
    fsync_dir(d)
    return sum(l["stored"] for l in layers)


def _fsync(fd) -> None:
    os.fsync(fd) if isinstance(fd, int) else fd.fsync()


def _write_at(fd, data: bytes, off: int, path) -> None:
    if not isinstance(fd, int):                 # a striped trunk.kz (names its own files)
        fd.pwrite(data, off)
        return
    mv = memoryview(data)
    while mv:
        try:
            n = os.pwrite(fd, mv, off)
        except OSError as e:
            raise K3IOError(f"cannot write: {e.strerror}", path=path) from None
        mv, off = mv[n:], off + n


def _journal_append(d: Path, rec: dict) -> None:
    with open(d / KZ_JOURNAL_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _resume(d: Path, head: dict, plans: list, out) -> list:
    """Index records of the layers an earlier run finished (journaled, and every block's
    bytes in trunk.kz.partial matching its CRC), in layer order from 0; starts the
    journal over when there is nothing to resume."""
    recs: list = []
    p = d / KZ_JOURNAL_FILE
    if p.is_file() and (not isinstance(out, int) or (d / KZ_PARTIAL_FILE).is_file()):
        lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
        try:
            ok = json.loads(lines[0]) == head if lines else False
        except ValueError:
            ok = False
        if ok:
            recs = _verified_records(lines[1:], plans, out)
    if not recs:
        if isinstance(out, int):
            os.ftruncate(out, 0)
        with open(p, "w", encoding="utf-8") as f:
            f.write(json.dumps(head, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
    else:            # keep the journal to the verified layers only
        with open(p, "w", encoding="utf-8") as f:
            f.write(json.dumps(head, sort_keys=True) + "\n")
            for L, r in enumerate(recs):
                f.write(json.dumps({"layer": L, "index": r.tobytes().hex()}, sort_keys=True)
                        + "\n")
            f.flush()
            os.fsync(f.fileno())
    return recs


def _verified_records(lines: list, plans: list, out) -> list:
    recs: list = []
    off = 0
    for L, line in enumerate(lines[:len(plans)]):
        try:
            j = json.loads(line)
            rec = np.frombuffer(bytes.fromhex(j["index"]), trunk_codec.INDEX_RECORD)
            if j["layer"] != L or rec.size != len(plans[L]):
                break
        except (ValueError, KeyError, TypeError):
            break                                # a torn line ends the journal
        good, at = True, off
        for n, c in zip(rec["stored"].tolist(), rec["crc32"].tolist()):
            buf = bytearray(n)
            good = good and preadv(out, [buf], at) == n and zlib.crc32(buf) == c
            at += n
        if not good:
            break
        recs.append(rec.copy())
        off += align_up(int(rec["stored"].sum()))
    return recs
