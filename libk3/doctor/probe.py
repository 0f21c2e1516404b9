"""Machine facts for k3-doctor, measured the way k3-run uses the machine.

Owns: Python and package versions, numba's threading layer, cores and ISA flags,
memory (/proc/meminfo and the cgroup v2/v1 limit, or a caller's override), and per
directory: filesystem, free space, whether O_DIRECT works, and read speed (large
sequential reads and one-expert random reads at queue depths 1, 4 and 16). Does not
own: timing k3's kernels (``libk3.engine.timing``: this module imports no kernel and no
model code, so the engine can ask it for memory), deciding anything
(``libk3.doctor.report``, ``libk3.budget``) or printing.

Why these measurements:
* k3-run reads the trunk in large sequential runs and experts as 17,547,264-byte random
  reads (model.md §3.5) from a pool of threads, so those are what is timed, with
  ``os.preadv`` into the engine's buffers (``io.direct.aligned_empty``) under O_DIRECT when
  the filesystem allows it.
* A figure the page cache could satisfy is not disk speed. With O_DIRECT the cache is
  bypassed; without it the file's cached pages are dropped first
  (``posix_fadvise(DONTNEED)``) and the result is still flagged ``cached``.
* The model's own shards are measured when they hold real data. A synthetic
  ``real-sparse`` checkpoint is almost all holes, which read as zeros at memory speed,
  so a file whose allocated blocks cover less than 90 % of its size is not used; a
  temporary file (random bytes, fsynced) is written instead and always removed, also on
  Ctrl-C and SIGTERM (signal handlers raise ``ProbeInterrupted`` so ``finally`` runs;
  signals are blocked while the file is created so no name can leak).
* numba only reports its threading layer after a parallel function has run, so a tiny
  prange function runs first. ``workqueue`` (no TBB or OpenMP) is flagged: it is slower
  and unsafe for concurrent parallel calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from numba import njit, prange

from ..io.direct import ALIGN, align_up, aligned_empty   # O_DIRECT alignment (formats/pack.md)
from ..k3_dims import EXPERT_BYTES

PACKAGES = ("numpy", "numba", "llvmlite", "tokenizers", "safetensors", "zstandard")
ISA_FLAGS = ("avx2", "fma", "avx512f", "asimd", "neon")
EXPERT_READ_BYTES = EXPERT_BYTES      # one real routed expert (model.md §3.5), = 4284 x 4096
SEQ_BLOCK = 8 << 20                   # sequential reads: 8 MiB blocks
QUEUE_DEPTHS = (1, 4, 16)
SEQ_DEPTHS = (1, 4)
DEFAULT_PROBE_BYTES = 1_000_000_000   # temporary probe file (1 GB)
PROBE_PREFIX = ".k3-doctor-probe-"
DATA_FRACTION = 0.9                   # allocated / apparent size for "holds real data"
MIN_MODEL_BYTES = 256 << 20           # below this the model's shards are too small to time
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_UNLIMITED = 1 << 60                  # cgroup v1 reports "no limit" as ~2^63


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


# ---- software and CPU ------------------------------------------------------------------

def package_versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


@njit(cache=True, parallel=True)
def _prange_sum(x):
    """Sum of x via a prange loop: only to make numba pick its threading layer."""
    out = np.zeros_like(x)
    for i in prange(x.shape[0]):
        out[i] = x[i]
    return out.sum()


def threading_layer() -> dict:
    """numba's threading layer after running a tiny parallel function, with a warning
    when it is ``workqueue``."""
    try:
        import numba

        _prange_sum(np.arange(64, dtype=np.float64))
        layer = numba.threading_layer()
        threads = numba.get_num_threads()
    except Exception as e:   # noqa: BLE001 - any failure here is a finding, not a crash
        return {"layer": None, "threads": None,
                "warning": f"numba could not run a parallel function: {type(e).__name__}: {e}"}
    warning = None
    if layer == "workqueue":
        warning = ("numba fell back to the 'workqueue' threading layer: parallel kernels "
                   "are slower and unsafe when called from two threads; install TBB "
                   "(pip install tbb) or an OpenMP runtime (libgomp)")
    return {"layer": layer, "threads": threads, "warning": warning}


def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> dict:
    """Cores this process may use, and which of ISA_FLAGS the CPU reports."""
    flags = set()
    model = None
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("flags", "features") and not flags:
                    flags = set(value.split())
                elif key in ("model name", "cpu model") and model is None:
                    model = value.strip()
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {"model": model, "machine": platform.machine(), "cores_usable": usable,
            "cores_online": os.cpu_count(), "isa": {f: f in flags for f in ISA_FLAGS}}


# ---- memory ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MemoryInfo:
    """Memory as a run may plan with it. ``assumed`` when a caller overrode the probe."""

    total_bytes: int
    available_bytes: int              # MemAvailable
    swap_total_bytes: int
    cgroup_limit_bytes: int | None    # None: no limit applies
    cgroup_source: str | None         # the file the limit came from
    assumed: bool

    @property
    def usable_bytes(self) -> int:
        """min(MemAvailable, cgroup limit): what a run can count on."""
        if self.cgroup_limit_bytes is None:
            return self.available_bytes
        return min(self.available_bytes, self.cgroup_limit_bytes)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["usable_bytes"] = self.usable_bytes
        return d


def assumed_memory(nbytes: int) -> MemoryInfo:
    """A simulated machine with ``nbytes`` of memory, all available, no swap, no cgroup."""
    n = int(nbytes)
    return MemoryInfo(n, n, 0, None, None, assumed=True)


def probe_memory(override_bytes: int | None = None, *, proc: str = "/proc",
                 cgroup_root: str | None = None) -> MemoryInfo:
    """This machine's memory, or ``assumed_memory(override_bytes)`` when given.
    ``proc``/``cgroup_root`` let tests point at a fake tree."""
    if override_bytes is not None:
        return assumed_memory(override_bytes)
    info = _meminfo(Path(proc) / "meminfo")
    limit, source = cgroup_memory_limit(proc=proc, cgroup_root=cgroup_root)
    return MemoryInfo(info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0)),
                      info.get("SwapTotal", 0), limit, source, assumed=False)


def _meminfo(path: Path) -> dict:
    out = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit():
        return None
    v = int(text)
    return None if v >= _UNLIMITED else v


def cgroup_memory_limit(proc: str = "/proc", cgroup_root: str | None = None):
    """(smallest memory limit on this process's cgroup path, the file it came from) or
    (None, None). cgroup v2 ``memory.max`` and v1 ``memory.limit_in_bytes`` ('max' or a
    huge number mean none); limits of parent groups apply too, so the path is walked up."""
    mounts = _mounts(Path(proc) / "self" / "mounts")
    try:
        lines = (Path(proc) / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    best = (None, None)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, cg_path = parts
        if controllers == "":
            version, fname = 2, "memory.max"
            roots = [m for m, (fs, opts) in mounts.items() if fs == "cgroup2"]
        elif "memory" in controllers.split(","):
            version, fname = 1, "memory.limit_in_bytes"
            roots = [m for m, (fs, opts) in mounts.items()
                     if fs == "cgroup" and "memory" in opts.split(",")]
        else:
            continue
        if cgroup_root is not None:
            roots = [cgroup_root]
        for root in roots:
            for f in _walk_cgroup(Path(root), cg_path, fname):
                v = _read_limit(f)
                if v is not None and (best[0] is None or v < best[0]):
                    best = (v, f"cgroup v{version} {f}")
    return best


def _walk_cgroup(root: Path, cg_path: str, fname: str):
    """The limit files from this process's group up to the mount root. When the group's
    directory is not visible (a namespaced mount), the mount root is the group."""
    rel = Path(cg_path.lstrip("/"))
    d = root / rel
    if not d.is_dir():
        d = root
    while True:
        yield d / fname
        if d == root or root not in d.parents:
            break
        d = d.parent


# ---- storage -----------------------------------------------------------------------------

def _unescape_mount(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n") \
        .replace("\\134", "\\")


def _mounts(path) -> dict:
    """{mount point: (fstype, options)}; a later mount on the same point wins."""
    out = {}
    try:
        text = Path(path).read_text()
    except OSError:
        try:
            text = Path("/proc/mounts").read_text()
        except OSError:
            return out
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 4:
            out[_unescape_mount(f[1])] = (f[2], f[3])
    return out


def mount_of(path, mounts: dict | None = None) -> tuple:
    """(mount point, fstype) of the longest mount prefix of ``path``'s real path."""
    mounts = _mounts("/proc/self/mounts") if mounts is None else mounts
    real = os.path.realpath(path)
    best = ("/", mounts.get("/", ("unknown", ""))[0])
    for point, (fs, _) in mounts.items():
        if real == point or real.startswith(point.rstrip("/") + "/"):
            if len(point) >= len(best[0]):
                best = (point, fs)
    return best


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


def _create_probe(directory) -> tuple:
    """(fd, path) of a new probe file; signals blocked so the name cannot be lost."""
    mask = set(_SIGNALS) | {signal.SIGINT}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, mask)
    try:
        return tempfile.mkstemp(prefix=PROBE_PREFIX, suffix=".tmp", dir=directory)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def probe_file(directory, nbytes: int, bar=None):
    """A temporary file of ``nbytes`` (rounded up to 4096) of random bytes, fsynced and
    dropped from the page cache, in ``directory``; removed on exit whatever happens."""
    nbytes = max(ALIGN, (int(nbytes) + ALIGN - 1) // ALIGN * ALIGN)
    path = None
    try:
        fd, path = _create_probe(directory)
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
            os.close(fd)
        yield path
    finally:
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


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
    from tqdm import tqdm

    fds = []
    try:
        for path, size in files:
            fd = _open_read(path, direct)
            fds.append((fd, size))
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        total = sum(s for _, s in fds)
        seq, rand = {}, {}
        bar = tqdm(total=None, unit="B", unit_scale=True, file=sys.stderr,
                   desc=f"reads {label}", disable=not progress, leave=False)
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


def probe_storage(directory, *, model_files=(), measure: bool = True,
                  probe_bytes: int = DEFAULT_PROBE_BYTES, seq_seconds: float = 3.0,
                  rand_seconds: float = 1.5, progress: bool = False,
                  min_model_bytes: int = MIN_MODEL_BYTES) -> dict:
    """Filesystem, free space, O_DIRECT and (with ``measure``) read speed for
    ``directory`` (or its nearest existing ancestor). Reads the ``model_files`` that hold
    real data when they total ``min_model_bytes`` and one holds two experts, else a
    temporary file of ``probe_bytes``."""
    from tqdm import tqdm

    d = existing_ancestor(directory)
    point, fstype = mount_of(d)
    usage = shutil.disk_usage(d)
    info = {"directory": str(directory), "exists": Path(directory).exists(),
            "probe_dir": str(d), "mount_point": point, "filesystem": fstype,
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
        if not os.access(d, os.W_OK):
            info["notes"].append("directory is not writable: no probe file, O_DIRECT and "
                                 "read speed not measured")
            return info
        size = ALIGN if not measure else probe_bytes
        if measure and usage.free < 2 * size:
            info["notes"].append(f"only {usage.free / 1e9:.2f} GB free: no "
                                 f"{size / 1e9:.2f} GB probe file, read speed not measured")
            size, measure = ALIGN, False
        if not measure and info["o_direct"] is not None:
            return info
        bar = tqdm(total=size, unit="B", unit_scale=True, file=sys.stderr,
                   desc=f"writing probe in {d}", disable=not (progress and measure),
                   leave=False)
        try:
            with probe_file(d, size, bar) as path:
                bar.close()
                if info["o_direct"] is None:
                    info["o_direct"], info["o_direct_note"] = o_direct_check(path)
                if measure:
                    files = [(path, os.stat(path).st_size)]
                    info["reads"] = measure_reads(files, direct=info["o_direct"],
                                                  seq_seconds=seq_seconds,
                                                  rand_seconds=rand_seconds,
                                                  progress=progress, label=d.name or str(d))
                    info["measured"], info["measured_on"] = True, "temporary file"
        finally:
            bar.close()
    if info["measured"] and not info["reads"]["rand_bps"]:
        info["notes"].append("probe smaller than two experts: random reads not measured")
    return info


# ---- the whole machine -----------------------------------------------------------------

def probe_machine(memory: MemoryInfo | None = None) -> dict:
    """Python, packages, numba threading, CPU and memory, with warnings."""
    mem = memory if memory is not None else probe_memory()
    cpu = cpu_info()
    thr = threading_layer()
    warnings = []
    if thr["warning"]:
        warnings.append(thr["warning"])
    isa = cpu["isa"]
    if cpu["machine"] in ("x86_64", "AMD64") and not isa["avx2"]:
        warnings.append("no AVX2: numba kernels fall back to scalar code (slow)")
    return {"python": platform.python_version(), "implementation": platform.python_implementation(),
            "platform": platform.platform(), "packages": package_versions(), "numba": thr,
            "cpu": cpu, "memory": mem.to_json(), "warnings": warnings}
