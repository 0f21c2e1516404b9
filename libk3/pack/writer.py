"""Packing a checkpoint for streaming: trunk.bin, trunk.json and experts.idx (formats/pack.md).

Owns: copying every layer's trunk run verbatim into one page-aligned file, or over the
stripe files of several drives (checksumming it and scanning it for NaN/Inf on the way),
writing the manifest and the compact expert index, resuming after an interruption, and
the short probe of the source disk's read rate that a pack's MB/s is reported against.
Does not own: what the files must say and the checks before use (``libk3.pack.schema``),
the stripe layout (``libk3.pack.stripes``), ``verify`` (``libk3.pack.verify``, re-exported
here), compressing a pack (``libk3.pack.compress``), reading safetensors (``libk3.io``) or
streaming at run time (``libk3.stream``).

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
from .nonfinite import RunScan
from .schema import (COMPRESSED_VERSION, EXPERT_INDEX_FILE, EXPERT_INDEX_MAGIC,
                     MANIFEST_FILE, PACK_FORMAT, PACK_VERSION, TRUNK_FILE,
                     expert_index_contents, load_expert_index, load_manifest,  # noqa: F401
                     model_level_entries, plan_pack)
from . import stripes
from ..io.direct import ALIGN, FileSet, align_up, aligned_empty, window_bytes
from ..io.identity import source_identity
from .verify import crc_of_file_range, nonfinite_error, verify  # noqa: F401

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


def manifest_version(pack_dir):
    """The ``version`` a finished pack's trunk.json states (None when unreadable)."""
    try:
        doc = json.loads((Path(pack_dir) / MANIFEST_FILE).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return doc.get("version") if isinstance(doc, dict) else None


def _journal_read(d: Path, ident: dict, dirs: list | None = None) -> tuple:
    """(finished layers {L: (crc, [suffixes holding NaN/Inf])}, the striped pack's id) from
    a journal written for this same source (and, striped, the same stripe directories,
    ``dirs`` as the manifest records them), else ({}, None)."""
    p = d / JOURNAL_FILE
    if not p.is_file() or (dirs is None and not (d / PARTIAL_FILE).is_file()):
        return {}, None
    done, pack_id = {}, None
    for i, line in enumerate(p.read_text().splitlines()):
        try:
            rec = json.loads(line)
            if i == 0:
                st = rec.get("stripes")
                if rec.get("source") != ident or rec.get("version") != PACK_VERSION \
                        or (st is None) != (dirs is None) \
                        or (st is not None and st.get("dirs") != dirs):
                    return {}, None
                pack_id = st and st.get("pack_id")
                continue
            done[int(rec["layer"])] = (int(rec["crc32"]), list(rec["nonfinite"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            break                       # a torn last line: ignore it and what follows
    return done, pack_id


def _journal_append(d: Path, rec: dict) -> None:
    with open(d / JOURNAL_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


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
         allow_nonfinite: bool = False, stripe_dirs=()) -> PackResult:
    """Pack ``ckpt`` into ``out_dir``: resumable, never rewrites a finished pack. Refuses
    (FormatError) a trunk tensor holding NaN or Inf unless ``allow_nonfinite``; the
    layer is journaled first, so a rerun that allows them resumes. With ``stripe_dirs``
    the trunk is striped over ``out_dir`` and each of them (formats/pack.md "Striped
    trunk"); a missing, read-only or full one is refused naming it."""
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
    _writable_dir(d, parents=True)
    for s in stripe_dirs:
        _writable_dir(Path(s), parents=False)
    total = disk_needed(plans)
    striped = bool(stripe_dirs)
    recorded = stripes.plan_layout(d, stripe_dirs, TRUNK_FILE, total, "0" * 16)[1] \
        if striped else None
    dirs = [e["dir"] for e in recorded["files"]] if striped else None
    done, pack_id = _journal_read(d, ident, dirs)
    lay = None
    if striped:
        lay, field = stripes.plan_layout(d, stripe_dirs, TRUNK_FILE, total,
                                         pack_id or stripes.new_pack_id())
        targets = list(zip(lay.paths, lay.sizes))
    else:
        targets = [(d / TRUNK_FILE, total)]
    for path, need in targets:
        part = path.with_name(path.name + ".partial") if striped else d / PARTIAL_FILE
        have = part.stat().st_size if done and part.exists() else 0
        free = shutil.disk_usage(path.parent).free
        if need - have > free:
            raise BudgetError("not enough free disk for the pack", path=path.parent,
                              expected=f"{need - have} bytes", found=f"{free} bytes free")
    if not done:
        _start_fresh(d, ident, {"dirs": dirs, "pack_id": lay.pack_id} if striped else None)
        if striped:
            for path, _ in targets:
                path.with_name(path.name + ".partial").unlink(missing_ok=True)
    t0 = time.perf_counter()
    out = stripes.StripedOut(lay) if striped else _FileOut(d / PARTIAL_FILE)
    resumed, written = 0, 0
    copies = None
    try:
        out.allocate(total)
        todo = []               # verify what the journal claims, then copy the rest
        for p in plans:
            if p.layer in done and \
                    crc_of_file_range(out, p.file_off, p.nbytes) == done[p.layer][0]:
                resumed += 1
                _check_nonfinite(ckpt, p, done[p.layer][1], allow_nonfinite)
            else:
                todo.append(p)
        bar = _progress.bar(total=sum(p.nbytes for p in todo), unit="B", unit_scale=True,
                            desc="k3-pack", show=progress)
        copies = _copy_layers(ckpt.model_dir, todo, out, bar, throttle_mbps)
        for p, crc, found in copies:
            _journal_append(d, {"layer": p.layer, "crc32": crc, "nonfinite": sorted(found)})
            written += p.nbytes
            _check_nonfinite(ckpt, p, sorted(found), allow_nonfinite)
        bar.close()
        out.fsync()
    finally:
        if copies is not None:
            copies.close()                  # stops the readers and writers on an error
        out.close()
    journal = _journal_read(d, ident, dirs)[0]
    _write_expert_index(d, ckpt)
    out.finish()
    _write_manifest(d, ckpt, plans, {L: crc for L, (crc, _) in journal.items()}, ident,
                    field if striped else None)
    (d / JOURNAL_FILE).unlink(missing_ok=True)
    fsync_dir(d)
    return PackResult(str(d), len(plans), len(todo), resumed, written, time.perf_counter() - t0,
                      nonfinite=[names.layer(L, sfx) for L in sorted(journal)
                                 for sfx in journal[L][1]])


def _writable_dir(d: Path, parents: bool) -> None:
    """Create ``d`` (a stripe directory only when its parent exists: a drive that is not
    mounted is not silently replaced by a directory on another one) and require it
    writable."""
    try:
        d.mkdir(parents=parents, exist_ok=True)
    except OSError as e:
        raise K3IOError(f"cannot create the {'pack' if parents else 'stripe'} directory: "
                        f"{e.strerror}", path=d) from None
    if not os.access(d, os.W_OK):
        raise K3IOError(f"the {'pack' if parents else 'stripe'} directory is not writable "
                        "(read-only disk?)", path=d)


class _FileOut:
    """The unstriped trunk being written: trunk.bin.partial, renamed at the end."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.wfd = -1

    def allocate(self, total: int) -> None:
        if os.fstat(self.fd).st_size < total:
            try:      # reserve the blocks now: O_DIRECT writes into holes allocate as they go
                os.posix_fallocate(self.fd, 0, total)
            except OSError:
                os.ftruncate(self.fd, total)
        self.wfd = _open_for_write(self.path)

    def preadv(self, bufs, off: int) -> int:
        return os.preadv(self.fd, bufs, off)

    def pwrite(self, view, off: int) -> int:
        try:
            w = os.pwrite(self.wfd, view, off)
        except OSError as e:
            raise K3IOError(f"cannot write the pack: {e.strerror}") from None
        if w != len(view):
            raise K3IOError("short write to the pack (disk full?)")
        return w

    def fsync(self) -> None:
        os.fsync(self.wfd)

    def close(self) -> None:
        for fd in (self.fd, self.wfd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.wfd = -1

    def finish(self) -> None:
        os.replace(self.path, self.path.parent / TRUNK_FILE)


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


def _start_fresh(d: Path, ident: dict, striped: dict | None = None) -> None:
    (d / PARTIAL_FILE).unlink(missing_ok=True)
    head = {"version": PACK_VERSION, "source": ident, **({"stripes": striped} if striped else {})}
    with open(d / JOURNAL_FILE, "w", encoding="utf-8") as f:
        f.write(json.dumps(head, sort_keys=True) + "\n")
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
        self.files.close()


def _copy_layers(src_dir, plans, out, bar, throttle_mbps):
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
            out.pwrite(memoryview(buf)[:length], off)
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


def _write_manifest(d: Path, ckpt, plans, crcs: dict, ident: dict, striped=None) -> None:
    doc = {"format": PACK_FORMAT, "version": PACK_VERSION, "align": ALIGN, "source": ident,
           "config": ckpt.config.to_flat_dict(),
           "trunk_file": TRUNK_FILE, "trunk_bytes": disk_needed(plans),
           "expert_index": EXPERT_INDEX_FILE, "model_level": model_level_entries(ckpt),
           "layers": [p.entry(crcs[p.layer]) for p in plans],
           **({"stripes": striped} if striped else {})}
    write_bytes(d / MANIFEST_FILE, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
