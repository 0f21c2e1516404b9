"""Packing a checkpoint for streaming: trunk.bin, trunk.json and experts.idx (formats/pack.md).

Owns: copying every layer's trunk run verbatim into one page-aligned file, the manifest,
the compact expert index, resuming after an interruption, verification, and the short
probe of the source disk's read rate that a pack's MB/s is reported against. Does not own:
reading safetensors (``libk3.io``) or streaming at run time (``libk3.stream``).

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

import numpy as np

from . import names
from .errors import BudgetError, FormatError, K3IOError
from .io.atomic import fsync_dir, write_bytes
from .stream.direct import ALIGN, FileSet, align_up, aligned_empty, window_bytes

PACK_FORMAT = "k3-pack"
PACK_VERSION = 1
COPY_BLOCK = 16 << 20                # 16 MiB reads and writes
READERS = 4                          # source reads in flight at once
WRITERS = 2                          # pack writes in flight at once
TRUNK_FILE, MANIFEST_FILE, EXPERT_INDEX_FILE = "trunk.bin", "trunk.json", "experts.idx"
PARTIAL_FILE, JOURNAL_FILE = "trunk.bin.partial", "pack.journal"
EXPERT_INDEX_MAGIC = b"K3EXPIDX"
EXPERT_RECORD = np.dtype([("shard", "<u2"), ("layer", "<u2"), ("expert", "<u4"),
                          ("offset", "<u8"), ("nbytes", "<u8"), ("sub", "<u4", (6,))])


@dataclasses.dataclass
class LayerPlan:
    layer: int
    shard: str             # file name inside the checkpoint directory
    run_start: int         # absolute offset of the run in the shard
    nbytes: int            # run length (unpadded)
    file_off: int          # offset in trunk.bin (multiple of ALIGN)
    tensors: dict          # suffix -> {off, nbytes, dtype, shape}


def plan_pack(ckpt) -> list:
    """Layer runs and their places in trunk.bin; refuses non-contiguous runs."""
    plans, off = [], 0
    for L in range(ckpt.config.num_hidden_layers):
        path, start, nbytes, tensors = ckpt.layer_trunk_run(L)
        prefix = names.layer_prefix(L)
        tmap = {name[len(prefix):]: {"off": sub, "nbytes": nb, "dtype": dt, "shape": list(sh)}
                for name, (sub, nb, dt, sh) in tensors.items()}
        plans.append(LayerPlan(L, Path(path).name, start, nbytes, off, tmap))
        off += align_up(nbytes)
    return plans


def _source_identity(ckpt) -> dict:
    ident = ckpt.identity()
    return {"config_fingerprint": ident["config_fingerprint"],
            "shards": [[name, size] for name, size in ident["shards"]]}


def pack_state(out_dir, ckpt=None) -> str:
    """'missing', 'partial', 'complete', or 'stale' (complete but for another checkpoint)."""
    d = Path(out_dir)
    if (d / MANIFEST_FILE).is_file():
        if ckpt is None:
            return "complete"
        try:
            man = json.loads((d / MANIFEST_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            return "partial"
        return "complete" if man.get("source") == _source_identity(ckpt) else "stale"
    if (d / PARTIAL_FILE).exists() or (d / JOURNAL_FILE).exists():
        return "partial"
    return "missing"


def _journal_read(d: Path, ident: dict) -> dict:
    """Finished layers {L: crc} from a journal written for this same source, else {}."""
    p = d / JOURNAL_FILE
    if not p.is_file() or not (d / PARTIAL_FILE).is_file():
        return {}
    done, header_ok = {}, False
    for i, line in enumerate(p.read_text().splitlines()):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break                       # a torn last line: ignore it and what follows
        if i == 0:
            header_ok = rec.get("source") == ident and rec.get("version") == PACK_VERSION
            if not header_ok:
                return {}
            continue
        done[int(rec["layer"])] = int(rec["crc32"])
    return done


def _journal_append(d: Path, rec: dict) -> None:
    with open(d / JOURNAL_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _crc_of_file_range(fd: int, off: int, n: int) -> int:
    crc, buf = 0, bytearray(COPY_BLOCK)
    mv = memoryview(buf)
    while n > 0:
        k = os.preadv(fd, [mv[:min(n, COPY_BLOCK)]], off)
        if k <= 0:
            raise FormatError("pack file ends early", tensor=None)
        crc = zlib.crc32(mv[:k], crc)
        off += k
        n -= k
    return crc


@dataclasses.dataclass
class PackResult:
    out: str
    layers_total: int
    layers_packed: int
    layers_resumed: int
    bytes_written: int
    seconds: float
    already_complete: bool = False

    @property
    def mb_per_s(self) -> float:
        return self.bytes_written / 1e6 / self.seconds if self.seconds > 0 else 0.0


def disk_needed(plans) -> int:
    return sum(align_up(p.nbytes) for p in plans)


def pack(ckpt, out_dir, *, progress: bool = True, throttle_mbps: float | None = None) -> PackResult:
    """Pack ``ckpt`` into ``out_dir``: resumable, never rewrites a finished pack."""
    from tqdm import tqdm

    d = Path(out_dir)
    ident = _source_identity(ckpt)
    state = pack_state(d, ckpt)
    plans = plan_pack(ckpt)
    if state == "complete":
        return PackResult(str(d), len(plans), 0, len(plans), 0, 0.0, already_complete=True)
    if state == "stale":
        raise FormatError("this directory holds a finished pack of a different checkpoint",
                          path=d, hint="choose another OUT directory")
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
            if p.layer in done and _crc_of_file_range(fd_out, p.file_off, p.nbytes) == done[p.layer]:
                resumed += 1
            else:
                todo.append(p)
    finally:
        os.close(fd_out)
    fd_out = _open_for_write(d / PARTIAL_FILE)
    try:
        bar = tqdm(total=sum(p.nbytes for p in todo), unit="B", unit_scale=True,
                   desc="k3-pack", disable=not progress)
        for p, crc in _copy_layers(ckpt.model_dir, todo, fd_out, bar, throttle_mbps):
            _journal_append(d, {"layer": p.layer, "crc32": crc})
            written += p.nbytes
        bar.close()
        os.fsync(fd_out)
    finally:
        os.close(fd_out)
    crcs = _journal_read(d, ident)
    _write_expert_index(ckpt, d)
    os.replace(d / PARTIAL_FILE, d / TRUNK_FILE)
    _write_manifest(ckpt, d, plans, crcs, ident)
    (d / JOURNAL_FILE).unlink(missing_ok=True)
    fsync_dir(d)
    return PackResult(str(d), len(plans), len(todo), resumed, written, time.perf_counter() - t0)


PROBE_MIN_BYTES = 10**9         # smaller packs end before a rate means anything
PROBE_SECONDS = 1.0
PROBE_REGION_BYTES = 2 << 30     # expert bytes lined up for the probe (it stops on time)


def source_read_rate(ckpt, seconds: float = PROBE_SECONDS) -> float | None:
    """The source disk's sequential read rate (B/s, O_DIRECT, 8 MiB blocks, 4 in flight),
    what a pack's MB/s is reported against. Timed on the experts' runs of the last MoE
    layers, bytes a pack never reads, so the pack gets no help from any cache the probe
    warms. None without O_DIRECT or when the shards are sparse (holes read at RAM speed)."""
    from .hwprobe import holds_data, sequential_read_rate

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
    lengths are 4096-aligned, so trunk.bin can bypass the page cache; buffered writes of
    a large file were throttled by dirty-page writeback to ~190 MB/s on the CI disk,
    O_DIRECT reached ~2,100 MB/s (measured side by side, bench/pack_throughput.py)."""
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_WRONLY | os.O_DIRECT)
        except OSError:
            pass
    return os.open(path, os.O_WRONLY)


def _copy_layers(src_dir, plans, fd_out, bar, throttle_mbps):
    """Yield (plan, crc32) per layer once all its bytes are written.

    READERS threads read 16 MiB pieces of the layer runs in order (O_DIRECT when the
    source allows it: each read is the aligned window around the piece, and the payload
    is moved to the buffer's start so the pack's O_DIRECT write is aligned too); this
    thread takes the pieces back in order, checksums them and hands them to WRITERS
    write threads. With one read and one write at a time the pack ran at 53-73 % of the
    source disk's sequential read rate; with several in flight it runs at the disk's
    limit (bench/pack_throughput.py). Buffers come from a fixed pool (bounded read-ahead,
    READERS + WRITERS + 4 blocks); a reader takes its buffer before its piece, so the
    piece this thread waits for always has one. Each layer's last piece is zero-padded
    to 4096, which writes the layer's padding. A layer is yielded (and journaled by the
    caller) only when every one of its writes has returned."""
    jobs = [(p, pos, min(COPY_BLOCK, p.nbytes - pos))
            for p in plans for pos in range(0, p.nbytes, COPY_BLOCK)]
    pool: queue.Queue = queue.Queue()
    for _ in range(READERS + WRITERS + 4):
        pool.put(aligned_empty(window_bytes(COPY_BLOCK)))
    files = FileSet(use_direct=True)
    ready: dict = {}
    cv = threading.Condition()
    state = {"next_job": 0, "stop": False, "err": None}

    def reader():
        try:
            while True:
                buf = None
                while buf is None:
                    if state["stop"]:
                        return
                    try:
                        buf = pool.get(timeout=0.1)
                    except queue.Empty:
                        pass
                with cv:
                    k = state["next_job"]
                    if k >= len(jobs) or state["stop"]:
                        return
                    state["next_job"] = k + 1
                p, pos, n = jobs[k]
                f = files.get(Path(src_dir) / p.shard)
                at = f.read_window(p.run_start + pos, n, buf, what=f"layer {p.layer} trunk run")
                if at:
                    ctypes.memmove(buf.ctypes.data, buf.ctypes.data + at, n)
                with cv:
                    ready[k] = buf
                    cv.notify_all()
        except BaseException as e:          # handed to the writer thread, re-raised there
            with cv:
                state["err"] = state["err"] or e
                state["stop"] = True
                cv.notify_all()

    def write(buf, length, off):
        try:
            try:
                w = os.pwrite(fd_out, memoryview(buf)[:length], off)
            except OSError as e:
                raise K3IOError(f"cannot write the pack: {e.strerror}") from None
            if w != length:
                raise K3IOError("short write to the pack (disk full?)")
        finally:
            pool.put(buf)

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(READERS)]
    for th in threads:
        th.start()
    writers = ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="k3-pack-write")
    t0 = time.perf_counter()
    sent = 0
    crc = {p.layer: 0 for p in plans}
    pending: list = []                  # (plan, futures of its pieces), in layer order
    try:
        for k, (p, pos, n) in enumerate(jobs):
            with cv:
                while k not in ready and state["err"] is None:
                    cv.wait()
                if state["err"] is not None:
                    raise state["err"]
                buf = ready.pop(k)
            crc[p.layer] = zlib.crc32(memoryview(buf)[:n], crc[p.layer])
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
                yield done_p, crc[done_p.layer]
            if throttle_mbps:
                ahead = sent / (throttle_mbps * 1e6) - (time.perf_counter() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        for done_p, futs in pending:            # the tail: wait for the last writes
            for f in futs:
                f.result()
            yield done_p, crc[done_p.layer]
    finally:
        with cv:
            state["stop"] = True
            cv.notify_all()
        writers.shutdown(wait=True)
        for th in threads:
            th.join(timeout=5)
        for f in files.files.values():
            f.close()


def _write_expert_index(ckpt, d: Path) -> None:
    cfg = ckpt.config
    shards = sorted({Path(s).name for s, _ in ckpt.identity()["shards"]})
    shard_idx = {s: i for i, s in enumerate(shards)}
    moe = list(cfg.moe_layers)
    rec = np.zeros(len(moe) * cfg.num_experts, EXPERT_RECORD)
    parts = None
    i = 0
    for L in moe:
        for e in range(cfg.num_experts):
            run = ckpt.expert_run(L, e)
            rec[i]["shard"] = shard_idx[Path(run.path).name]
            rec[i]["layer"], rec[i]["expert"] = L, e
            rec[i]["offset"], rec[i]["nbytes"] = run.offset, run.nbytes
            rec[i]["sub"] = [run.parts[k][0] for k in names.EXPERT_PARTS]
            if parts is None:
                parts = [[w, p, list(run.parts[(w, p)][2]), run.parts[(w, p)][1]]
                         for w, p in names.EXPERT_PARTS]
            i += 1
    head = json.dumps({"version": PACK_VERSION, "shards": shards, "n_layers": cfg.num_hidden_layers,
                       "n_experts": cfg.num_experts, "moe_layers": moe, "parts": parts,
                       "records": int(rec.size), "record_bytes": EXPERT_RECORD.itemsize},
                      sort_keys=True).encode()
    blob = EXPERT_INDEX_MAGIC + len(head).to_bytes(4, "little") + head + rec.tobytes()
    write_bytes(d / EXPERT_INDEX_FILE, blob)


def _write_manifest(ckpt, d: Path, plans, crcs: dict, ident: dict) -> None:
    model_level = {}
    for name in names.MODEL_LEVEL:
        e = ckpt.entry(name)
        model_level[name] = {"shard": Path(e.path).name, "offset": e.offset, "nbytes": e.nbytes,
                             "dtype": e.dtype, "shape": list(e.shape)}
    doc = {"format": PACK_FORMAT, "version": PACK_VERSION, "align": ALIGN, "source": ident,
           "trunk_file": TRUNK_FILE, "trunk_bytes": disk_needed(plans),
           "expert_index": EXPERT_INDEX_FILE, "model_level": model_level,
           "layers": [{"layer": p.layer, "shard": p.shard, "run_start": p.run_start,
                       "nbytes": p.nbytes, "padded": align_up(p.nbytes), "file_off": p.file_off,
                       "crc32": crcs[p.layer], "tensors": p.tensors} for p in plans]}
    write_bytes(d / MANIFEST_FILE, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())


# ---- reading and verifying a pack --------------------------------------------------

def load_manifest(out_dir) -> dict:
    """trunk.json, checked for format, version, alignment and layer layout."""
    p = Path(out_dir) / MANIFEST_FILE
    if not p.is_file():
        raise FormatError("no trunk.json: not a finished pack", path=Path(out_dir),
                          hint="run `k3-pack CHECKPOINT OUT` (it resumes an interrupted pack)")
    try:
        man = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"unreadable manifest: {e}", path=p) from None
    if man.get("format") != PACK_FORMAT or man.get("version") != PACK_VERSION:
        raise FormatError("unsupported pack format or version", path=p,
                          expected=f"{PACK_FORMAT} v{PACK_VERSION}",
                          found=f"{man.get('format')} v{man.get('version')}")
    if man.get("align") != ALIGN:
        raise FormatError("pack alignment is not 4096", path=p, found=man.get("align"))
    end = 0
    for i, lay in enumerate(man["layers"]):
        if lay["layer"] != i or lay["file_off"] % ALIGN or lay["file_off"] < end:
            raise FormatError("layer table is out of order or misaligned", path=p,
                              tensor=f"layer {i}")
        end = lay["file_off"] + lay["padded"]
    size = (Path(out_dir) / TRUNK_FILE).stat().st_size if (Path(out_dir) / TRUNK_FILE).exists() else -1
    if size != man["trunk_bytes"] or end != size:
        raise FormatError("trunk.bin size does not match the manifest", path=Path(out_dir) / TRUNK_FILE,
                          expected=man["trunk_bytes"], found=size)
    return man


def load_expert_index(out_dir):
    """(header dict, records ndarray of EXPERT_RECORD) from experts.idx."""
    p = Path(out_dir) / EXPERT_INDEX_FILE
    try:
        blob = p.read_bytes()
    except OSError as e:
        raise FormatError(f"cannot read the expert index: {e.strerror}", path=p) from None
    if blob[:8] != EXPERT_INDEX_MAGIC or len(blob) < 12:
        raise FormatError("not a k3 expert index (bad magic)", path=p)
    hlen = int.from_bytes(blob[8:12], "little")
    try:
        head = json.loads(blob[12:12 + hlen])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FormatError("expert index header is not valid JSON", path=p) from None
    body = blob[12 + hlen:]
    if head.get("version") != PACK_VERSION or head.get("record_bytes") != EXPERT_RECORD.itemsize \
            or len(body) != head.get("records", -1) * EXPERT_RECORD.itemsize:
        raise FormatError("expert index version or size does not match its header", path=p)
    return head, np.frombuffer(body, dtype=EXPERT_RECORD)


def check_pack_matches(out_dir, ckpt) -> dict:
    """The manifest, after refusing a pack built from a different checkpoint."""
    man = load_manifest(out_dir)
    if man["source"] != _source_identity(ckpt):
        raise FormatError("this pack was built from a different checkpoint", path=out_dir,
                          hint="re-run k3-pack for this checkpoint")
    return man


def verify(out_dir, ckpt=None, progress: bool = True) -> dict:
    """Re-check every layer's checksum; with ``ckpt``, also every byte against its source
    and the expert index against the shard headers. Raises FormatError naming the first
    bad layer; returns a summary."""
    from tqdm import tqdm

    d = Path(out_dir)
    man = check_pack_matches(d, ckpt) if ckpt is not None else load_manifest(d)
    fd = os.open(d / TRUNK_FILE, os.O_RDONLY)
    src_fds = {}
    try:
        bar = tqdm(total=sum(l["nbytes"] for l in man["layers"]), unit="B", unit_scale=True,
                   desc="verify", disable=not progress)
        for lay in man["layers"]:
            if _crc_of_file_range(fd, lay["file_off"], lay["nbytes"]) != lay["crc32"]:
                raise FormatError("checksum mismatch", path=d / TRUNK_FILE,
                                  tensor=f"layer {lay['layer']}")
            if ckpt is not None:
                sfd = src_fds.get(lay["shard"])
                if sfd is None:
                    sfd = src_fds[lay["shard"]] = os.open(ckpt.model_dir / lay["shard"], os.O_RDONLY)
                if _crc_of_file_range(sfd, lay["run_start"], lay["nbytes"]) != lay["crc32"]:
                    raise FormatError("bytes differ from the source checkpoint",
                                      path=d / TRUNK_FILE, tensor=f"layer {lay['layer']}")
            bar.update(lay["nbytes"])
        bar.close()
    finally:
        os.close(fd)
        for sfd in src_fds.values():
            os.close(sfd)
    head, rec = load_expert_index(d)
    if ckpt is not None:
        for r in rec:
            run = ckpt.expert_run(int(r["layer"]), int(r["expert"]))
            if (Path(run.path).name != head["shards"][r["shard"]] or run.offset != r["offset"]
                    or run.nbytes != r["nbytes"]):
                raise FormatError("expert index disagrees with the shard headers",
                                  path=d / EXPERT_INDEX_FILE,
                                  tensor=f"layer {r['layer']} expert {r['expert']}")
    return {"pack": str(d), "layers": len(man["layers"]), "experts": int(rec.size),
            "trunk_bytes": man["trunk_bytes"], "against_checkpoint": ckpt is not None, "ok": True}
