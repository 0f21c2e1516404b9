"""Page-aligned buffers and positioned reads that use O_DIRECT where the filesystem allows.

Owns: allocating aligned arenas (private anonymous mmap: page-aligned, counted in RSS only
when touched, so the budget is what we allocate), opening a file for direct reads with a
buffered fallback, and reading the 4096-aligned window that encloses an unaligned byte
range, and the per-drive read queues every read goes through (``DriveQueue``: its own
requests in flight and, with a throttle, its own token bucket). Does not own: what to read
(``trunk``, ``experts``) or a striped trunk's layout (``libk3.pack.stripes``).

Why O_DIRECT: streamed bytes are used once per token; through the page cache they would
evict each other and count against the machine, not against k3's budget, and under a
cgroup memory limit the page cache's reclaim slows buffered reads further.
Why huge pages: a direct read lands in the buffer's physical pages, and a request to the
disk carries a bounded number of discontiguous segments; into scattered 4 KiB pages a
large read goes out as several smaller requests and takes longer than into 2 MiB pages,
which go out whole (bench/README.md "Trunk compression"). So a buffer of at least a huge page starts on a huge-page boundary and its
whole huge pages are advised MADV_HUGEPAGE (a hint: without THP it is 4 KiB pages as
before); its tail stays in small pages so touching it costs no more RSS than its bytes.
Why a window: O_DIRECT needs offset, length and buffer aligned to the block size; an
expert run starts anywhere (17,547,264 bytes happens to be a multiple of 4096, but run
starts are not), so we read the aligned window around it and hand out a view.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, K3IOError

ALIGN = 4096
HUGE_PAGE = 2 << 20            # x86-64 and arm64 (4 KiB base pages) transparent huge page
YIELD_CHUNK = 4 << 20          # trunk read-ahead yields to expert reads every 4 MiB
FOLD_CHUNK = 32 << 20          # a foreground read hands over pieces this size (on_piece)
DRIVE_DEPTH = 16               # a drive queue's requests in flight unless k3-doctor measured one


def align_down(n: int) -> int:
    return n - n % ALIGN


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def aligned_empty(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array of ``nbytes`` (rounded up to ALIGN), private to this
    process; from HUGE_PAGE bytes on, huge-page aligned with its whole huge pages advised
    MADV_HUGEPAGE (module docstring)."""
    n = max(ALIGN, align_up(nbytes))
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if n < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.frombuffer(mmap.mmap(-1, n, flags=flags), dtype=np.uint8)
    mm = mmap.mmap(-1, n + HUGE_PAGE, flags=flags)       # untouched slack: address space only
    whole = np.frombuffer(mm, dtype=np.uint8)
    skip = -whole.ctypes.data % HUGE_PAGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, skip, n - n % HUGE_PAGE)
    except OSError:                                      # no THP in this kernel: small pages
        pass
    return whole[skip:skip + n]


class ReadCancelled(Exception):
    """A background read stopped between pieces because its owner is closing."""


def window_bytes(nbytes: int) -> int:
    """Largest aligned window any ``nbytes`` range can need."""
    return align_up(nbytes) + 2 * ALIGN


class ReadGate:
    """Lets reads on the critical path go first. Expert reads (the layer being computed
    waits for them) run inside ``urgent(drives)``; the trunk read-ahead (needed only when
    this layer is done) reads in chunks and waits at each chunk boundary while an urgent
    read is in flight on one of its ``drives`` (any drive when not given: reads of other
    drives do not compete, so they do not wait). A drive is a device (st_dev), not a
    queue: two directories of one disk compete. Only the order of reads changes, never
    their bytes."""

    def __init__(self):
        self._busy: dict = {}              # device (st_dev, or None: unknown) -> count
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def urgent(self, drives=None):
        keys = (None,) if drives is None else tuple(drives)
        with self._cond:
            for k in keys:
                self._busy[k] = self._busy.get(k, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                for k in keys:
                    self._busy[k] -= 1
                    if not self._busy[k]:
                        del self._busy[k]
                        self._cond.notify_all()

    def _blocked(self, drives) -> bool:
        return bool(self._busy) if drives is None else \
            any(d in self._busy for d in (None, *drives))

    def wait_clear(self, timeout: float = 1.0, drives=None) -> None:
        with self._cond:
            if self._blocked(drives):
                self._cond.wait_for(lambda: not self._blocked(drives), timeout)


class TokenBucket:
    """Caps a queue's read rate at ``rate`` bytes/s: a read of n bytes takes n tokens,
    refilled at ``rate`` up to ``burst``; a read finding too few waits for the debt to be
    refilled (so a read larger than the burst still passes, and the long-run rate is
    ``rate``). ``clock`` and ``sleep`` are injectable so the arithmetic tests with a fake
    clock."""

    def __init__(self, rate: float, burst: float | None = None, clock=time.monotonic,
                 sleep=time.sleep):
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(rate / 10, 1 << 20))
        self.clock, self.sleep = clock, sleep
        self.tokens = self.burst
        self.last = clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> float:
        """Take ``n`` tokens, sleeping as long as the rate requires; returns the wait."""
        with self._lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            self.tokens -= n
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            self.sleep(wait)
        return wait


class DriveQueue:
    """One drive's reads: a pool of ``depth`` threads (its requests in flight) and, with
    ``throttle_mbps``, a token bucket capping its read rate. Reads of files on different
    drives go through different queues, so they proceed at once."""

    def __init__(self, name: str, depth: int = DRIVE_DEPTH, throttle_mbps: float | None = None):
        self.name, self.depth = name, max(1, int(depth))
        self.device = os.stat(name).st_dev if os.path.isdir(name) else None
        self.bucket = TokenBucket(throttle_mbps * 1e6) if throttle_mbps else None
        self.pool = ThreadPoolExecutor(max_workers=self.depth,
                                       thread_name_prefix="k3-drive")
        self.bytes_read = 0
        self.throttle_seconds = 0.0
        self._lock = threading.Lock()

    def _run(self, n: int, fn, args):
        waited = self.bucket.take(n) if self.bucket is not None else 0.0
        got = fn(*args)
        with self._lock:
            self.bytes_read += got
            self.throttle_seconds += waited
        return got

    def submit(self, n: int, fn, *args) -> Future:
        return self.pool.submit(self._run, n, fn, args)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class DirectFile:
    """One read-only file; ``direct`` tells whether O_DIRECT is in use. With a ``queue``
    (its drive's ``DriveQueue``), every read goes through that queue."""

    def __init__(self, path, use_direct: bool = True, queue: DriveQueue | None = None):
        self.path = str(path)
        self.queue = queue
        self.size = os.stat(self.path).st_size
        self.direct = False
        self.fd = -1
        if use_direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                probe = aligned_empty(ALIGN)
                os.preadv(fd, [memoryview(probe)], 0)
                self.fd, self.direct = fd, True
            except OSError:
                try:
                    os.close(fd)
                except (OSError, UnboundLocalError):
                    pass
        if self.fd < 0:
            try:
                self.fd = os.open(self.path, os.O_RDONLY)
            except OSError as e:
                raise K3IOError(f"cannot open: {e.strerror}", path=self.path) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read_window(self, offset: int, nbytes: int, buf: np.ndarray, what: str = "",
                    yield_to: "ReadGate | None" = None, pool=None, depth: int = 1,
                    cancel: "threading.Event | None" = None, on_piece=None) -> int:
        """Read the aligned window around [offset, offset+nbytes) into ``buf`` (aligned,
        at least ``window_bytes(nbytes)``); returns where the payload starts in ``buf``.
        A short read at the end of the file is fine if it covers the payload. With
        ``yield_to``, read in YIELD_CHUNK pieces and let urgent reads go first; with a
        ``pool`` as well, keep ``depth`` pieces in flight on it (one sequential stream at
        a time reads slower than the disk can: bench/perf.py disk). With ``cancel``, a
        piece-wise read raises ReadCancelled once it is set (a read-ahead nobody will use
        stops within a few pieces instead of reading a whole layer at exit). With
        ``on_piece`` (no ``yield_to``), read in FOLD_CHUNK pieces and call
        ``on_piece(lo, hi)`` with each landed piece's range of ``buf``, in order."""
        start = align_down(offset)
        end = min(align_up(offset + nbytes), align_up(self.size))
        view = memoryview(buf)[:end - start]
        if yield_to is not None and pool is not None and depth > 1:
            got = self._read_pieces(view, start, what, yield_to, pool, depth, cancel)
        else:
            got = 0
            while got < len(view):
                piece = (view[got:got + YIELD_CHUNK] if yield_to is not None else
                         view[got:got + FOLD_CHUNK] if on_piece is not None else view[got:])
                if yield_to is not None:
                    yield_to.wait_clear(drives=self.drives)
                    _check(cancel)
                n = self._pread(piece, start + got, what)
                if n == 0:
                    break
                if on_piece is not None:
                    on_piece(got, got + n)
                got += n
                if n < len(piece):
                    break                           # end of file inside the last block
        if got < offset + nbytes - start:
            raise CheckpointError("file ends early (truncated shard?)", path=self.path,
                                  tensor=what, expected=f"{nbytes} bytes at offset {offset}")
        return offset - start

    @property
    def drives(self):
        """The drives this file's reads go to (its queue's name), for ``ReadGate``."""
        return None if self.queue is None else (self.queue.device,)

    def submit(self, piece, off: int, what: str = "") -> Future:
        """A future of ``_pread``: on the drive's queue, or done now without one."""
        if self.queue is not None:
            return self.queue.submit(len(piece), self._pread_now, piece, off, what)
        fut: Future = Future()
        try:
            fut.set_result(self._pread_now(piece, off, what))
        except BaseException as e:
            fut.set_exception(e)
        return fut

    def _pread(self, piece, off: int, what: str) -> int:
        """Fill ``piece`` from ``off`` (through the drive's queue when there is one)."""
        if self.queue is not None:
            return self.queue.submit(len(piece), self._pread_now, piece, off, what).result()
        return self._pread_now(piece, off, what)

    def _pread_now(self, piece, off: int, what: str) -> int:
        """Fill ``piece`` from ``off``; fewer bytes only at the end of the file."""
        got = 0
        while got < len(piece):
            try:
                n = os.preadv(self.fd, [piece[got:]], off + got)
            except OSError as e:
                raise K3IOError(f"read failed: {e.strerror}", path=self.path, tensor=what) from None
            if n == 0 or (self.direct and n % ALIGN):
                return got + n
            got += n
        return got

    def _read_pieces(self, view, start: int, what: str, gate: "ReadGate", pool, depth: int,
                     cancel=None) -> int:
        """YIELD_CHUNK pieces of ``view`` in order, ``depth`` in flight, each submitted only
        while no urgent read is waiting; returns the bytes read before the first short piece."""
        pieces = [(o, min(YIELD_CHUNK, len(view) - o)) for o in range(0, len(view), YIELD_CHUNK)]
        flight: collections.deque = collections.deque()
        counts = []
        try:
            for o, n in pieces:
                while len(flight) >= depth:
                    counts.append(flight.popleft().result())
                gate.wait_clear(drives=self.drives)
                _check(cancel)
                flight.append(pool.submit(self._pread, view[o:o + n], start + o, what))
            while flight:
                counts.append(flight.popleft().result())
        finally:
            for f in flight:                        # an error above: let the rest land
                f.exception()
        got = 0
        for (_, n), k in zip(pieces, counts):
            got += k
            if k < n:
                break
        return got


def _check(cancel) -> None:
    if cancel is not None and cancel.is_set():
        raise ReadCancelled()


class FileSet:
    """DirectFile per path, opened lazily, once (reader threads ask at the same time),
    each bound to the queue of its drive: one ``DriveQueue`` per directory (a pack's
    directory, each stripe directory, the checkpoint's shard directory), of ``depth``
    (or ``depths[directory]``, k3-doctor's measurement) requests in flight, each capped
    at ``throttle_mbps`` when given. ``register`` puts a file-like object (a striped
    trunk) under a path that is not a file of its own."""

    def __init__(self, use_direct: bool = True, depth: int = DRIVE_DEPTH,
                 throttle_mbps: float | None = None, depths: dict | None = None):
        self.use_direct = use_direct
        self.depth, self.throttle_mbps, self.depths = depth, throttle_mbps, depths or {}
        self.files: dict = {}
        self.queues: dict = {}
        self.gate = ReadGate()          # shared by the trunk ring and the expert cache
        self._lock = threading.Lock()

    def queue_for(self, path) -> DriveQueue:
        """The queue of ``path``'s directory (made on first use, under the set's lock)."""
        key = str(Path(path).resolve().parent)
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = DriveQueue(key, self.depths.get(key, self.depth),
                                              self.throttle_mbps)
        return q

    def register(self, path, f) -> None:
        with self._lock:
            self.files[str(path)] = f

    def get(self, path) -> DirectFile:
        f = self.files.get(str(path))
        if f is None:
            with self._lock:
                f = self.files.get(str(path))
                if f is None:
                    f = self.files[str(path)] = DirectFile(path, self.use_direct,
                                                           self.queue_for(path))
        return f

    def where(self, path, off: int, n: int) -> str:
        """The file holding bytes [off, off + n) of ``path`` (a stripe file, striped)."""
        f = self.files.get(str(path))
        return f.where(off, n) if hasattr(f, "where") else str(path)

    def drive_stats(self) -> dict:
        return {k: {"depth": q.depth, "bytes_read": q.bytes_read,
                    "throttle_seconds": round(q.throttle_seconds, 6)}
                for k, q in self.queues.items()}

    def close(self) -> None:
        with self._lock:
            files, self.files = self.files, {}
            queues, self.queues = self.queues, {}
        for f in files.values():
            f.close()
        for q in queues.values():
            q.close()
