"""Storage as k3 uses it: per directory, the filesystem, free space, O_DIRECT and read rates.

Owns: finding a directory's filesystem and free space, whether O_DIRECT works there, and
read rates measured the way k3-run reads (large sequential runs for the trunk; one
expert's bytes at random offsets, at queue depths 1, 4 and 16, for experts), on the
model's own files or on a temporary probe file. Does not own: what the rates mean for a
budget or an estimate (``libk3.doctor``).

Why these measurements:
* k3-run reads the trunk in large sequential runs and experts as one-expert random reads
  (model.md §3.5) from a pool of threads, so those are what is timed, with ``os.preadv``
  into the engine's buffers (``io.direct.aligned_empty``) under O_DIRECT when the
  filesystem allows it.
* A figure the page cache could satisfy is not disk speed. With O_DIRECT the cache is
  bypassed; without it the file's cached pages are dropped first
  (``posix_fadvise(DONTNEED)``) and the result is still flagged ``cached``.
* The model's own shards are measured when they hold real data. A synthetic
  ``real-sparse`` checkpoint is almost all holes, which read as zeros at memory speed,
  so a file whose allocated blocks cover less than 90 % of its size is not used.
* Otherwise a temporary file of random bytes, fsynced, is written on the same
  filesystem, but never inside the model's or the pack's directory or a git checkout
  (``probe_dir``: the temporary directory when it is on that filesystem, else the
  nearest ancestor outside them), and always removed, also on Ctrl-C and SIGTERM
  (signal handlers raise ``ProbeInterrupted`` so ``finally`` runs; a signal that comes
  while the file is created is held until its name is known, so no name can leak).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

from .. import progress as _progress
from ..io.direct import ALIGN, align_up, aligned_empty   # O_DIRECT alignment (formats/pack.md)
from ..k3_dims import EXPERT_BYTES
from ..units import size_texts
from . import mounts

EXPERT_READ_BYTES = EXPERT_BYTES      # one real routed expert (model.md §3.5), = 4284 x 4096
SEQ_BLOCK = 8 << 20                   # sequential reads: 8 MiB blocks
QUEUE_DEPTHS = (1, 4, 16)
SEQ_DEPTHS = (1, 4)
DEFAULT_PROBE_BYTES = 1_000_000_000   # temporary probe file (1 GB)
PROBE_PREFIX = ".k3-doctor-probe-"
DATA_FRACTION = 0.9                   # allocated / apparent size for "holds real data"
MIN_MODEL_BYTES = 256 << 20           # below this the model's shards are too small to time
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class ProbeInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived during a probe; raised so cleanup runs."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def interrupt_on_signals():
    """Turn SIGTERM and SIGHUP into ProbeInterrupted in the main thread while inside."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_it(signum, frame):
        raise ProbeInterrupted(signum)

    old = {s: signal.signal(s, raise_it) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def existing_ancestor(path) -> Path:
    p = Path(os.path.abspath(path))
    while not p.exists():
        p = p.parent
    return p


def holds_data(path) -> bool:
    """True when the file's allocated blocks cover most of its size (not a sparse file)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_size > 0 and st.st_blocks * 512 >= DATA_FRACTION * st.st_size


def _open_read(path, direct: bool) -> int:
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    if direct:
        flags |= os.O_DIRECT
    return os.open(path, flags)


def o_direct_check(path) -> tuple:
    """(works, note): open ``path`` with O_DIRECT and read its first aligned block."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this platform has no O_DIRECT"
    try:
        fd = _open_read(path, True)
    except OSError as e:
        return False, f"O_DIRECT open fails: {e.strerror}"
    try:
        os.preadv(fd, [aligned_empty(ALIGN)], 0)
    except OSError as e:
        return False, f"O_DIRECT read fails: {e.strerror}"
    finally:
        os.close(fd)
    return True, None


def _create_probe(directory, made: dict) -> None:
    """Create a new probe file and put its ``fd`` and ``path`` in ``made`` before any
    signal can interrupt: while the file is created, SIGINT, SIGTERM and SIGHUP are only
    noted, then raised again once the caller can remove the file. (Blocking them is not
    enough: a blocked signal's handler runs as soon as it is unblocked, before the name
    is returned, and another thread of the process, e.g. the kernels' team, takes a
    signal this thread blocks, its handler still raising here.)"""
    if threading.current_thread() is not threading.main_thread():
        made["fd"], made["path"] = tempfile.mkstemp(prefix=PROBE_PREFIX, suffix=".tmp",
                                                    dir=directory)
        return                           # signal handlers only ever run in the main thread
    pending = []
    old = {s: signal.signal(s, lambda signum, frame: pending.append(signum))
           for s in (*_SIGNALS, signal.SIGINT)}
    try:
        made["fd"], made["path"] = tempfile.mkstemp(prefix=PROBE_PREFIX, suffix=".tmp",
                                                    dir=directory)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    for signum in dict.fromkeys(pending):
        signal.raise_signal(signum)      # to the handlers in force again


@contextlib.contextmanager
def probe_file(directory, nbytes: int, bar=None):
    """A temporary file of ``nbytes`` (rounded up to 4096) of random bytes, fsynced and
    dropped from the page cache, in ``directory``; removed on exit whatever happens."""
    nbytes = max(ALIGN, (int(nbytes) + ALIGN - 1) // ALIGN * ALIGN)
    made: dict = {}
    try:
        _create_probe(directory, made)
        fd = made["fd"]
        try:
            block = bytearray(os.urandom(min(SEQ_BLOCK, nbytes)))
            done = 0
            while done < nbytes:
                n = min(len(block), nbytes - done)
                block[:8] = done.to_bytes(8, "little")   # no two blocks alike (dedup)
                view = memoryview(block)[:n]
                while view:
                    k = os.write(fd, view)
                    view = view[k:]
                done += n
                if bar is not None:
                    bar.update(n)
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(made.pop("fd"))
        yield made["path"]
    finally:
        if "fd" in made:                 # interrupted before the write loop began
            os.close(made.pop("fd"))
        if "path" in made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(made["path"])


class _Reads:
    """Reads of ``size`` bytes issued by ``depth`` threads, each into its own
    page-aligned buffer, until ``next_job`` is exhausted, ``seconds`` pass or ``stop``."""

    def __init__(self, next_job, depth: int, size: int, seconds: float, bar=None):
        self.next_job, self.depth, self.size = next_job, depth, size
        self.seconds, self.bar = seconds, bar
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.total = 0
        self.errors = []

    def _worker(self, deadline: float) -> None:
        buf = aligned_empty(self.size)
        try:
            while not self.stop.is_set() and time.perf_counter() < deadline:
                with self.lock:
                    job = self.next_job()
                if job is None:
                    return
                fd, off = job
                n = os.preadv(fd, [buf], off)
                with self.lock:
                    self.total += n
                if self.bar is not None:
                    self.bar.update(n)
        except OSError as e:
            self.errors.append(e)

    def run(self) -> float:
        """Bytes per second over the wall time of the whole batch."""
        t0 = time.perf_counter()
        threads = [threading.Thread(target=self._worker, args=(t0 + self.seconds,),
                                    daemon=True) for _ in range(self.depth)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.05)       # short joins: signal handlers run in between
        finally:
            self.stop.set()
            for t in threads:
                t.join()
        if self.errors:
            raise self.errors[0]
        elapsed = time.perf_counter() - t0
        return self.total / elapsed if elapsed > 0 and self.total else 0.0


def _sequential_jobs(fds_sizes, block: int):
    state = {"i": 0, "off": 0}

    def next_job():
        while state["i"] < len(fds_sizes):
            fd, size = fds_sizes[state["i"]]
            if state["off"] < size:
                off = state["off"]
                state["off"] += block
                return fd, off
            state["i"] += 1
            state["off"] = 0
        return None
    return next_job


def _random_jobs(fds_sizes, size: int, max_reads: int, seed: int):
    rng = random.Random(seed)
    usable = [(fd, s) for fd, s in fds_sizes if s >= size]
    weights = [s for _, s in usable]
    left = [max_reads]

    def next_job():
        if not usable or left[0] <= 0:
            return None
        left[0] -= 1
        fd, s = rng.choices(usable, weights)[0]
        return fd, rng.randrange(0, (s - size) // ALIGN + 1) * ALIGN
    return next_job


def sequential_read_rate(regions, *, seconds: float = 1.0, depth: int = 4) -> float | None:
    """B/s of O_DIRECT reads of SEQ_BLOCK blocks walking ``regions`` [(path, start, end)]
    in order with ``depth`` in flight, for at most ``seconds``; None when O_DIRECT is
    unavailable (a buffered figure would time the page cache) or no whole block fits."""
    jobs = []
    fds: dict = {}
    try:
        for path, start, end in regions:
            off = align_up(start)
            while off + SEQ_BLOCK <= end:
                if path not in fds:
                    try:
                        fds[path] = _open_read(path, True)
                    except (OSError, AttributeError):
                        return None
                jobs.append((fds[path], off))
                off += SEQ_BLOCK
        if not jobs:
            return None
        it = iter(jobs)
        return _Reads(lambda: next(it, None), depth, SEQ_BLOCK, seconds).run() or None
    except OSError:
        return None
    finally:
        for fd in fds.values():
            os.close(fd)


def measure_reads(files, *, direct: bool, seq_seconds: float = 3.0,
                  rand_seconds: float = 1.5, progress: bool = False, label: str = "") -> dict:
    """Time sequential (8 MiB blocks, depths SEQ_DEPTHS) and one-expert random reads
    (depths QUEUE_DEPTHS) on ``files`` [(path, size)]. Without O_DIRECT each file's
    cached pages are dropped first and the figures are flagged ``cached``."""
    fds = []
    try:
        for path, size in files:
            fd = _open_read(path, direct)
            fds.append((fd, size))
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        total = sum(s for _, s in fds)
        seq, rand = {}, {}
        bar = _progress.bar(unit="B", unit_scale=True, desc=f"reads {label}", show=progress)
        try:
            for depth in SEQ_DEPTHS:
                bar.set_description(f"{label} sequential x{depth}")
                # one pass at most: a second pass could come from a cache below us
                seq[depth] = _Reads(_sequential_jobs(fds, SEQ_BLOCK), depth, SEQ_BLOCK,
                                    seq_seconds / len(SEQ_DEPTHS), bar).run()
            for depth in QUEUE_DEPTHS:
                bar.set_description(f"{label} random 17.5 MB x{depth}")
                max_reads = max(4 * depth, 48)
                rand[depth] = _Reads(_random_jobs(fds, EXPERT_READ_BYTES, max_reads, depth),
                                     depth, EXPERT_READ_BYTES, rand_seconds, bar).run()
        finally:
            bar.close()
    finally:
        for fd, _ in fds:
            os.close(fd)
    usable_rand = any(s >= EXPERT_READ_BYTES for _, s in files)
    best_seq = max(seq.values(), default=0.0)
    best_depth = max(rand, key=rand.get) if usable_rand and rand else None
    return {"direct": direct, "cached": not direct, "bytes_available": total,
            "seq_bps": {str(k): v for k, v in seq.items()}, "seq_best_bps": best_seq,
            "rand_read_bytes": EXPERT_READ_BYTES,
            "rand_bps": {str(k): v for k, v in rand.items()} if usable_rand else {},
            "rand_best_depth": best_depth,
            "rand_best_bps": rand[best_depth] if best_depth is not None else None}


def model_files_with_data(paths) -> list:
    """[(path, size)] of the files that hold real (non-hole) data."""
    out = []
    for p in paths:
        if holds_data(p):
            out.append((str(p), os.stat(p).st_size))
    return out


def in_git_checkout(path) -> bool:
    """True when ``path`` or one of its ancestors holds a ``.git`` (a work tree)."""
    p = Path(os.path.abspath(path))
    return any((q / ".git").exists() for q in (p, *p.parents))


def probe_dir(directory, avoid=(), tmp=None) -> Path | None:
    """A writable directory on ``directory``'s filesystem for a probe file, never inside
    an ``avoid`` directory (the model's, the pack's) or a git checkout: the temporary
    directory (``tmp``, default ``tempfile.gettempdir()``) when it is on that filesystem,
    else the nearest such ancestor of ``directory``; None when there is none."""
    d = existing_ancestor(directory)
    dev = os.stat(d).st_dev
    fenced = [Path(os.path.abspath(a)) for a in avoid]

    def fits(c: Path) -> bool:
        try:
            same = os.stat(c).st_dev == dev
        except OSError:
            return False
        inside = any(c == f or f in c.parents for f in fenced)
        return same and not inside and os.access(c, os.W_OK | os.X_OK) \
            and not in_git_checkout(c)

    t = Path(os.path.abspath(tmp if tmp is not None else tempfile.gettempdir()))
    for c in (t, d, *d.parents):
        if fits(c):
            return c
    return None


def probe_storage(directory, *, model_files=(), measure: bool = True,
                  probe_bytes: int = DEFAULT_PROBE_BYTES, seq_seconds: float = 3.0,
                  rand_seconds: float = 1.5, progress: bool = False,
                  min_model_bytes: int = MIN_MODEL_BYTES, avoid=(), tmp=None) -> dict:
    """Filesystem, free space, O_DIRECT and (with ``measure``) read speed for
    ``directory`` (or its nearest existing ancestor). Reads the ``model_files`` that hold
    real data when they total ``min_model_bytes`` and one holds two experts, else a
    temporary file of ``probe_bytes`` in ``probe_dir(directory, avoid, tmp)``."""
    d = existing_ancestor(directory)
    point, fstype = mounts.mount_of(d)
    usage = shutil.disk_usage(d)
    info = {"directory": str(directory), "exists": Path(directory).exists(),
            "probe_dir": None, "mount_point": point, "filesystem": fstype,
            "device": os.stat(d).st_dev, "free_bytes": usage.free, "total_bytes": usage.total,
            "o_direct": None, "o_direct_note": None, "measured": False, "measured_on": None,
            "reads": None, "notes": []}
    data = model_files_with_data(model_files)
    sparse = [str(p) for p in model_files if str(p) not in {f for f, _ in data}]
    if sparse:
        info["notes"].append(f"{len(sparse)} model file(s) are sparse or nearly empty "
                             "(holes read as zeros); not measured on them")
    use_model = sum(s for _, s in data) >= min_model_bytes and \
        any(s >= 2 * EXPERT_READ_BYTES for _, s in data)
    if data and not use_model:
        info["notes"].append("the model's files are too small to time reads on")
    with interrupt_on_signals():
        if data:       # an existing file answers the O_DIRECT question without writing
            info["o_direct"], info["o_direct_note"] = o_direct_check(data[0][0])
        if use_model:
            if measure:
                info["reads"] = measure_reads(data, direct=info["o_direct"],
                                              seq_seconds=seq_seconds,
                                              rand_seconds=rand_seconds, progress=progress,
                                              label=Path(directory).name or str(directory))
                info["measured"], info["measured_on"] = True, "model shards"
            return info
        where = probe_dir(directory, avoid=(directory, *avoid), tmp=tmp)
        if where is None:
            info["notes"].append("no writable directory on this filesystem outside the "
                                 "model, the pack and any git checkout: no probe file, "
                                 "O_DIRECT and read speed not measured")
            return info
        info["probe_dir"] = str(where)
        size = ALIGN if not measure else probe_bytes
        if measure and usage.free < 2 * size:
            free, probe = size_texts(usage.free, size)
            info["notes"].append(f"only {free} free: no {probe} probe file, read speed not "
                                 "measured")
            size, measure = ALIGN, False
        if not measure and info["o_direct"] is not None:
            return info
        bar = _progress.bar(total=size, unit="B", unit_scale=True,
                            desc=f"writing probe in {where}", show=progress and measure)
        try:
            with probe_file(where, size, bar) as path:
                bar.close()
                if info["o_direct"] is None:
                    info["o_direct"], info["o_direct_note"] = o_direct_check(path)
                if measure:
                    files = [(path, os.stat(path).st_size)]
                    info["reads"] = measure_reads(files, direct=info["o_direct"],
                                                  seq_seconds=seq_seconds,
                                                  rand_seconds=rand_seconds,
                                                  progress=progress,
                                                  label=d.name or str(d))
                    info["measured"], info["measured_on"] = True, "temporary file"
        finally:
            bar.close()
    if info["measured"] and not info["reads"]["rand_bps"]:
        info["notes"].append("probe smaller than two experts: random reads not measured")
    return info
