"""Packing a checkpoint for streaming: trunk.bin, trunk.json and experts.idx (formats/pack.md).

Owns: copying every layer's trunk run verbatim into one page-aligned file (checksumming
it and scanning it for NaN/Inf on the way), writing the manifest and the compact expert
index, resuming after an interruption, ``verify`` (re-reading every layer, decoding a
compressed trunk's blocks), and the short probe of the source disk's read rate that a
pack's MB/s is reported against. Does not own: what the files must say and the checks
before use (``libk3.pack.schema``), compressing a pack (``libk3.pack.compress``), reading
safetensors (``libk3.io``) or streaming at run time (``libk3.stream``).

Why this shape: one positioned read (O_DIRECT-capable: 4096-aligned offset and length)
loads one whole layer; the experts stay in the shards and are located through a
fixed-width binary index (48 bytes per expert, ~4 MB for the real 82,432) that loads with
one ``numpy.frombuffer``. Completion is marked by ``trunk.json`` appearing last, so a
directory without it is never mistaken for a finished pack.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import queue
import shutil
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import names
from ..errors import BudgetError, FormatError, K3IOError
from ..io.atomic import fsync_dir, write_bytes
from ..io.dtypes import ITEMSIZE
from .nonfinite import RunScan
from .schema import (COMPRESSED_VERSION, EXPERT_INDEX_FILE, EXPERT_INDEX_MAGIC,
                     MANIFEST_FILE, PACK_FORMAT, PACK_VERSION, REPACK_HINT, TRUNK_FILE,
                     expert_index_contents, load_expert_index, load_manifest,  # noqa: F401
                     manifest_version, model_level_entries, open_pack, plan_pack)
from . import codec as trunk_codec
from ..io.direct import ALIGN, FileSet, align_up, aligned_empty, window_bytes
from ..io.identity import source_identity
from .schema import crc_mismatch

COPY_BLOCK = 16 << 20                # 16 MiB reads and writes
READERS = 4                          # source reads in flight at once
WRITERS = 2                          # pack writes in flight at once
PARTIAL_FILE, JOURNAL_FILE = "trunk.bin.partial", "pack.journal"


def pack_state(out_dir, ckpt=None) -> str:
    """'missing', 'partial', 'complete', or 'stale' (complete but for another checkpoint,
    or in an older pack format)."""
    d = Path(out_dir)
    if (d / MANIFEST_FILE).is_file():
        if ckpt is None:
            return "complete"
        try:
            man = json.loads((d / MANIFEST_FILE).read_text())
        except (OSError, ValueError, RecursionError):
            return "partial"
        if not isinstance(man, dict) or man.get("version") not in (PACK_VERSION,
                                                                   COMPRESSED_VERSION):
            return "stale"
        return "complete" if man.get("source") == source_identity(ckpt) else "stale"
    if (d / PARTIAL_FILE).exists() or (d / JOURNAL_FILE).exists():
        return "partial"
    return "missing"


def _journal_read(d: Path, ident: dict) -> dict:
    """Finished layers {L: (crc, [suffixes holding NaN/Inf])} from a journal written for
    this same source, else {}."""
    p = d / JOURNAL_FILE
    if not p.is_file() or not (d / PARTIAL_FILE).is_file():
        return {}
    done = {}
    for i, line in enumerate(p.read_text().splitlines()):
        try:
            rec = json.loads(line)
            if i == 0:
                if rec.get("source") != ident or rec.get("version") != PACK_VERSION:
                    return {}
                continue
            done[int(rec["layer"])] = (int(rec["crc32"]), list(rec["nonfinite"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            break                       # a torn last line: ignore it and what follows
    return done


def _journal_append(d: Path, rec: dict) -> None:
    with open(d / JOURNAL_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _crc_of_file_range(fd: int, off: int, n: int, scan: RunScan | None = None,
                       path=None) -> int:
    """CRC-32 of ``n`` bytes at ``off``, feeding them to ``scan`` as well."""
    crc, buf = 0, aligned_empty(COPY_BLOCK)
    mv = memoryview(buf)
    while n > 0:
        k = os.preadv(fd, [mv[:min(n, COPY_BLOCK)]], off)
        if k <= 0:
            raise FormatError("pack file ends early", path=path, expected=f"{n} more bytes "
                              f"at offset {off}", hint=REPACK_HINT)
        crc = zlib.crc32(mv[:k], crc)
        if scan is not None:
            scan.feed(buf[:k])
        off += k
        n -= k
    return crc


def nonfinite_error(path, tensors: list, where: str | None = None) -> FormatError:
    """The one refusal of trunk tensors holding NaN or Inf (k3-pack and verify);
    ``where``: the first one's place (layer, tensor, element, block)."""
    return FormatError(f"{len(tensors)} trunk tensor(s) hold NaN or Inf"
                       + (f", the first at {where}" if where else ""), path=path,
                       tensor=tensors[0],
                       hint="a released checkpoint has none: fetch the shard again, or pass "
                            "--allow-nonfinite to accept them")


@dataclasses.dataclass
class PackResult:
    out: str
    layers_total: int
    layers_packed: int
    layers_resumed: int
    bytes_written: int
    seconds: float
    already_complete: bool = False
    nonfinite: list = dataclasses.field(default_factory=list)   # tensor names (allowed)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_written / 1e6 / self.seconds if self.seconds > 0 else 0.0


def disk_needed(plans) -> int:
    return sum(align_up(p.nbytes) for p in plans)


def pack(ckpt, out_dir, *, progress: bool = True, throttle_mbps: float | None = None,
         allow_nonfinite: bool = False) -> PackResult:
    """Pack ``ckpt`` into ``out_dir``: resumable, never rewrites a finished pack. Refuses
    (FormatError) a trunk tensor holding NaN or Inf unless ``allow_nonfinite``; the
    layer is journaled first, so a rerun that allows them resumes."""
    from .. import progress as _progress

    d = Path(out_dir)
    ident = source_identity(ckpt)
    state = pack_state(d, ckpt)
    plans = plan_pack(ckpt)
    if state == "complete":
        return PackResult(str(d), len(plans), 0, len(plans), 0, 0.0, already_complete=True)
    if state == "stale":
        old = manifest_version(d)
        raise FormatError("this directory holds a finished pack of a different checkpoint"
                          if old in (PACK_VERSION, COMPRESSED_VERSION) else
                          f"this directory holds a finished pack in format v{old} (this k3 "
                          f"writes v{PACK_VERSION})", path=d,
                          hint="choose another OUT directory (a pack is never rewritten)")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise K3IOError(f"cannot create the pack directory: {e.strerror}", path=d) from None
    if not os.access(d, os.W_OK):
        raise K3IOError("the pack directory is not writable (read-only disk?)", path=d)
    total = disk_needed(plans)
    done = _journal_read(d, ident)
    have = (d / PARTIAL_FILE).stat().st_size if (d / PARTIAL_FILE).exists() else 0
    free = shutil.disk_usage(d).free
    if total - have > free:
        raise BudgetError("not enough free disk for the pack", path=d,
                          expected=f"{total - have} bytes", found=f"{free} bytes free")
    if not done:
        _start_fresh(d, ident)
    t0 = time.perf_counter()
    fd_out = os.open(d / PARTIAL_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    resumed, written = 0, 0
    try:
        if os.fstat(fd_out).st_size < total:
            try:      # reserve the blocks now: O_DIRECT writes into holes allocate as they go
                os.posix_fallocate(fd_out, 0, total)
            except OSError:
                os.ftruncate(fd_out, total)
        # verify what the journal claims, then copy the rest
        todo = []
        for p in plans:
            if p.layer in done and \
                    _crc_of_file_range(fd_out, p.file_off, p.nbytes) == done[p.layer][0]:
                resumed += 1
                _check_nonfinite(ckpt, p, done[p.layer][1], allow_nonfinite)
            else:
                todo.append(p)
    finally:
        os.close(fd_out)
    fd_out = _open_for_write(d / PARTIAL_FILE)
    copies = None
    try:
        bar = _progress.bar(total=sum(p.nbytes for p in todo), unit="B", unit_scale=True,
                            desc="k3-pack", show=progress)
        copies = _copy_layers(ckpt.model_dir, todo, fd_out, bar, throttle_mbps)
        for p, crc, found in copies:
            _journal_append(d, {"layer": p.layer, "crc32": crc, "nonfinite": sorted(found)})
            written += p.nbytes
            _check_nonfinite(ckpt, p, sorted(found), allow_nonfinite)
        bar.close()
        os.fsync(fd_out)
    finally:
        if copies is not None:
            copies.close()                  # stops the readers and writers on an error
        os.close(fd_out)
    journal = _journal_read(d, ident)
    _write_expert_index(d, ckpt)
    os.replace(d / PARTIAL_FILE, d / TRUNK_FILE)
    _write_manifest(d, ckpt, plans, {L: crc for L, (crc, _) in journal.items()}, ident)
    (d / JOURNAL_FILE).unlink(missing_ok=True)
    fsync_dir(d)
    return PackResult(str(d), len(plans), len(todo), resumed, written, time.perf_counter() - t0,
                      nonfinite=[names.layer(L, sfx) for L in sorted(journal)
                                 for sfx in journal[L][1]])


def _check_nonfinite(ckpt, p, suffixes: list, allow: bool) -> None:
    if suffixes and not allow:
        raise nonfinite_error(ckpt.model_dir / p.shard, [names.layer(p.layer, s) for s in suffixes])


PROBE_MIN_BYTES = 10**9         # smaller packs end before a rate means anything
PROBE_SECONDS = 1.0
PROBE_REGION_BYTES = 2 << 30     # expert bytes lined up for the probe (it stops on time)


def source_read_rate(ckpt, seconds: float = PROBE_SECONDS) -> float | None:
    """The source disk's sequential read rate (B/s, O_DIRECT, 8 MiB blocks, 4 in flight),
    what a pack's MB/s is reported against. Timed on the experts' runs of the last MoE
    layers, bytes a pack never reads, so the pack gets no help from any cache the probe
    warms. None without O_DIRECT or when the shards are sparse (holes read at RAM speed)."""
    from ..machine.storage import holds_data, sequential_read_rate

    t = ckpt.expert_table()
    regions, total = [], 0
    for L in reversed(list(ckpt.config.moe_layers)):
        runs = sorted(zip(t.shard[L].tolist(), t.offset[L].tolist(), t.nbytes[L].tolist()))
        merged: list = []                   # [shard, start, end] of adjacent expert runs
        for sh, off, n in runs:
            if merged and merged[-1][0] == sh and merged[-1][2] == off:
                merged[-1][2] += n
            else:
                merged.append([sh, off, off + n])
        regions += [(t.paths[sh], start, end) for sh, start, end in merged]
        total += sum(end - start for _, start, end in merged)
        if total >= PROBE_REGION_BYTES:
            break
    regions = [r for r in regions if holds_data(r[0])]
    return sequential_read_rate(regions, seconds=seconds) if regions else None


def _start_fresh(d: Path, ident: dict) -> None:
    (d / PARTIAL_FILE).unlink(missing_ok=True)
    with open(d / JOURNAL_FILE, "w", encoding="utf-8") as f:
        f.write(json.dumps({"version": PACK_VERSION, "source": ident}, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _open_for_write(path: Path):
    """A write descriptor, O_DIRECT when the filesystem allows it. Why: layer offsets and padded
    lengths are 4096-aligned, so trunk.bin can bypass the page cache, whose dirty-page
    writeback throttles a large buffered write (bench/README.md, "Packing")."""
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_WRONLY | os.O_DIRECT)
        except OSError:
            pass
    return os.open(path, os.O_WRONLY)


class _Pieces:
    """The read side of ``_copy_layers``: READERS threads read the layer runs' pieces in
    order into buffers of a fixed pool and hand them back by piece number (``take``); a
    buffer returns to the pool once its write is done (``give_back``). A reader takes its
    buffer before its piece, so the piece the copier waits for always has one. A
    reader's failure is raised by ``take``."""

    def __init__(self, src_dir, jobs):
        self.src_dir, self.jobs = Path(src_dir), jobs
        self.pool: queue.Queue = queue.Queue()
        for _ in range(READERS + WRITERS + 4):
            self.pool.put(aligned_empty(window_bytes(COPY_BLOCK)))
        self.files = FileSet(use_direct=True)
        self.ready: dict = {}
        self.cv = threading.Condition()
        self.next_job, self.stopped, self.err = 0, False, None
        self.threads = [threading.Thread(target=self._read, daemon=True)
                        for _ in range(READERS)]
        for th in self.threads:
            th.start()

    def _buffer(self):
        while not self.stopped:
            try:
                return self.pool.get(timeout=0.1)
            except queue.Empty:
                pass
        return None

    def _read(self) -> None:
        try:
            while True:
                buf = self._buffer()
                if buf is None:
                    return
                with self.cv:
                    k = self.next_job
                    if k >= len(self.jobs) or self.stopped:
                        return
                    self.next_job = k + 1
                p, pos, n = self.jobs[k]
                f = self.files.get(self.src_dir / p.shard)
                at = f.read_window(p.run_start + pos, n, buf, what=f"layer {p.layer} trunk run")
                if at:
                    ctypes.memmove(buf.ctypes.data, buf.ctypes.data + at, n)
                with self.cv:
                    self.ready[k] = buf
                    self.cv.notify_all()
        except BaseException as e:          # handed to the copier, re-raised by take
            with self.cv:
                self.err = self.err or e
                self.stopped = True
                self.cv.notify_all()

    def take(self, k: int):
        """Piece ``k``'s buffer, once read (its payload at the start)."""
        with self.cv:
            while k not in self.ready and self.err is None:
                self.cv.wait()
            if self.err is not None:
                raise self.err
            return self.ready.pop(k)

    def give_back(self, buf) -> None:
        self.pool.put(buf)

    def close(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()
        for th in self.threads:
            th.join(timeout=5)
        for f in self.files.files.values():
            f.close()


def _copy_layers(src_dir, plans, fd_out, bar, throttle_mbps):
    """Yield (plan, crc32, {suffix: first NaN/Inf element}) per layer once all its bytes
    are written.

    The pieces (16 MiB of the layer runs, in order) are read ahead by ``_Pieces``
    (O_DIRECT when the source allows it: each read is the aligned window around the
    piece, and the payload is moved to the buffer's start so the pack's O_DIRECT write is
    aligned too); this thread takes them back in order, checksums them, scans their
    float tensors for NaN/Inf (``libk3.pack.nonfinite``) and hands them to WRITERS write
    threads; several reads and writes in flight keep the disk busy where one at a time
    left it idle (bench/README.md, "Packing"). Each layer's last piece is zero-padded to
    4096, which writes the layer's padding. A layer is yielded (and journaled by the
    caller) only when every one of its writes has returned."""
    jobs = [(p, pos, min(COPY_BLOCK, p.nbytes - pos))
            for p in plans for pos in range(0, p.nbytes, COPY_BLOCK)]
    pieces = _Pieces(src_dir, jobs)

    def write(buf, length, off):
        try:
            try:
                w = os.pwrite(fd_out, memoryview(buf)[:length], off)
            except OSError as e:
                raise K3IOError(f"cannot write the pack: {e.strerror}") from None
            if w != length:
                raise K3IOError("short write to the pack (disk full?)")
        finally:
            pieces.give_back(buf)

    writers = ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="k3-pack-write")
    t0 = time.perf_counter()
    sent = 0
    crc = {p.layer: 0 for p in plans}
    scans = {p.layer: RunScan(p.tensors) for p in plans}
    pending: list = []                  # (plan, futures of its pieces), in layer order
    try:
        for k, (p, pos, n) in enumerate(jobs):
            buf = pieces.take(k)
            crc[p.layer] = zlib.crc32(memoryview(buf)[:n], crc[p.layer])
            scans[p.layer].feed(buf[:n])
            last = pos + n == p.nbytes
            length = align_up(n) if last else n
            if length > n:
                buf[n:length] = 0
            if not pending or pending[-1][0] is not p:
                pending.append((p, []))
            pending[-1][1].append(writers.submit(write, buf, length, p.file_off + pos))
            sent += n
            bar.update(n)
            while pending and (pending[0][0] is not p or last) \
                    and all(f.done() for f in pending[0][1]):
                done_p, futs = pending.pop(0)
                for f in futs:
                    f.result()                  # raises a failed write
                yield done_p, crc[done_p.layer], scans[done_p.layer].found
            if throttle_mbps:
                ahead = sent / (throttle_mbps * 1e6) - (time.perf_counter() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        for done_p, futs in pending:            # the tail: wait for the last writes
            for f in futs:
                f.result()
            yield done_p, crc[done_p.layer], scans[done_p.layer].found
    finally:
        pieces.stopped = True           # no new reads; close() wakes and joins the readers
        writers.shutdown(wait=True)
        pieces.close()


def _write_expert_index(d: Path, ckpt) -> None:
    head, rec = expert_index_contents(ckpt)
    blob = json.dumps(head, sort_keys=True).encode()
    write_bytes(d / EXPERT_INDEX_FILE,
                EXPERT_INDEX_MAGIC + len(blob).to_bytes(4, "little") + blob + rec.tobytes())


def _write_manifest(d: Path, ckpt, plans, crcs: dict, ident: dict) -> None:
    doc = {"format": PACK_FORMAT, "version": PACK_VERSION, "align": ALIGN, "source": ident,
           "config": ckpt.config.to_flat_dict(),
           "trunk_file": TRUNK_FILE, "trunk_bytes": disk_needed(plans),
           "expert_index": EXPERT_INDEX_FILE, "model_level": model_level_entries(ckpt),
           "layers": [p.entry(crcs[p.layer]) for p in plans]}
    write_bytes(d / MANIFEST_FILE, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())


# ---- verifying a pack -----------------------------------------------------------------

def verify(out_dir, ckpt=None, progress: bool = True, allow_nonfinite: bool = False) -> dict:
    """Check a pack the way k3-run opens it (``open_pack``: the schema, the stored config's
    inventory, and with ``ckpt`` the identity, every layer row, tensor entry and expert
    record), then read every layer once: its CRC, NaN/Inf in its float tensors, and with
    ``ckpt`` the CRC of its source bytes. A compressed trunk's layers are decoded, each
    block checked against its own CRC first (a bad block is named). Raises FormatError
    naming the first bad file, field, layer or block (NaN/Inf: after the whole pass,
    naming the first value's layer, tensor and, compressed, block, and the count of
    tensors, unless ``allow_nonfinite``); returns a summary."""
    from .. import progress as _progress

    d = Path(out_dir)
    pk = open_pack(d, ckpt)
    man = pk.manifest
    trunk = d / man["trunk_file"]
    nonfinite: list = []
    first_at = None                 # where the first NaN/Inf is
    fd = os.open(trunk, os.O_RDONLY)
    src_fds = {}
    decoded = _DecodedLayers(pk, fd, trunk) if pk.compressed else None
    try:
        bar = _progress.bar(total=sum(l["nbytes"] for l in man["layers"]), unit="B",
                            unit_scale=True, desc="verify", show=progress)
        for lay in man["layers"]:
            L = lay["layer"]
            scan = RunScan(lay["tensors"])
            if decoded is not None:
                crc = decoded.crc(L, scan)
            else:
                crc = _crc_of_file_range(fd, lay["file_off"], lay["nbytes"], scan, path=trunk)
            if crc != lay["crc32"]:
                raise crc_mismatch(trunk, L, lay["crc32"], crc)
            nonfinite += [names.layer(L, sfx) for sfx in sorted(scan.found)]
            if scan.found and first_at is None:           # the tensor nonfinite[0] names
                sfx = min(scan.found)
                first_at = _nonfinite_at(lay, sfx, scan.found[sfx],
                                         pk.blocks[L] if pk.compressed else None)
            if ckpt is not None:
                src = ckpt.model_dir / lay["shard"]        # a plain name (open_pack)
                if src not in src_fds:
                    src_fds[src] = os.open(src, os.O_RDONLY)
                if _crc_of_file_range(src_fds[src], lay["run_start"], lay["nbytes"],
                                      path=src) != lay["crc32"]:
                    raise FormatError(f"layer {L}: trunk bytes differ from the source "
                                      "checkpoint", path=trunk, hint=REPACK_HINT)
            bar.update(lay["nbytes"])
        bar.close()
    finally:
        os.close(fd)
        for sfd in src_fds.values():
            os.close(sfd)
        if decoded is not None:
            decoded.codec.close()
    if nonfinite and not allow_nonfinite:
        raise nonfinite_error(trunk, nonfinite, first_at)
    return {"pack": str(d), "layers": len(man["layers"]), "experts": int(pk.records.size),
            "trunk_bytes": man["trunk_bytes"], "against_checkpoint": ckpt is not None,
            "compressed": pk.compressed, "nonfinite": nonfinite, "ok": True}


def _nonfinite_at(lay: dict, sfx: str, element: int, plan=None) -> str:
    """The place of NaN/Inf ``element`` of tensor ``sfx`` of layer row ``lay``: layer,
    tensor and element, and in a compressed trunk (``plan``: the layer's BlockPlan) the
    block holding it."""
    L, t = lay["layer"], lay["tensors"][sfx]
    if plan is None:
        return f"layer {L} tensor {sfx} element {element}"
    b = plan.block_at(t["off"] + element * ITEMSIZE[t["dtype"]])
    return f"{plan.where(L, b)} (element {element} of the tensor)"


class _DecodedLayers:
    """verify's reader of a compressed trunk: COPY_BLOCK of stored bytes at a time, every
    block checked against its CRC, decoded, and its output fed on in run order."""

    def __init__(self, pk, fd: int, path):
        import numba

        self.pk, self.fd, self.path = pk, fd, path
        self.codec = trunk_codec.Codec(numba.get_num_threads())
        self.groups = [pl.groups(COPY_BLOCK) for pl in pk.blocks]
        spans = [(pl.span(lo, hi)[1], pl.span(lo, hi, stored=False)[1])
                 for pl, gs in zip(pk.blocks, self.groups) for lo, hi in gs]
        self.stored = aligned_empty(max(s for s, _ in spans))
        self.out = aligned_empty(max(o for _, o in spans) + 1)

    def crc(self, L: int, scan: RunScan) -> int:
        """CRC-32 of layer L's decoded run (fed to ``scan`` too)."""
        lay, plan, crc = self.pk.manifest["layers"][L], self.pk.blocks[L], 0
        for lo, hi in self.groups[L]:
            a, n = plan.span(lo, hi)
            got = os.preadv(self.fd, [memoryview(self.stored)[:n]], lay["file_off"] + a)
            if got != n:
                raise FormatError(f"layer {L}: the compressed trunk ends early",
                                  path=self.path, expected=f"{n} bytes at offset "
                                  f"{lay['file_off'] + a}", found=got, hint=REPACK_HINT)
            oa, on = plan.span(lo, hi, stored=False)
            base = oa - oa % 2                    # coded blocks sit at even run offsets
            self.codec.decode(plan, lo, hi, self.stored, 0, self.out, True, self.path, L,
                              out_base=base)
            piece = self.out[oa - base:oa - base + on]
            scan.feed(piece)
            crc = zlib.crc32(piece, crc)
        return crc
