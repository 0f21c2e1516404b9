"""Reading one trunk layer into a buffer in pieces, many in flight: a raw layer's pieces
land where they belong; a compressed layer (formats/pack.md "Compressed trunk") is decoded
in place, its stored bytes read into the buffer's tail and each landed run of blocks
decoded into the buffer's front while later pieces are still being read. Either way a
``Landing`` learns which prefix of the buffer is final as it grows.

Owns: the pieces of a read, the in-place schedule (which blocks decode once a piece has
landed, which earlier decodes each must wait for), the read pools and the read / decode
timings. Does not own: the codec, its checks and where the stored bytes go
(``libk3.pack.codec``, ``BlockPlan.in_place``), which layer goes where or when a
raw layer's whole-run CRC is checked (``libk3.stream.trunk``).

Why in place: staging buffers cost fixed overhead, so they were few and small, and inside
k3-run the compressed pass stayed slower than raw's, which reads a whole layer in one
request; reading into the buffer itself costs at most one
block of room per buffer and lets the queue be as deep as the disk wants (bench/README.md
"Trunk compression"). Why the waits: a block's output never reaches its own stored bytes,
but it may cover an earlier block's, so a run of blocks decodes only after every earlier
run whose stored bytes it would overwrite has been decoded.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..io.direct import ALIGN, ReadCancelled, align_down, align_up, window_bytes
from .landing import Landing
from ..pack.codec import BlockPlan, Codec

# A read pool's shape: (stored bytes per piece, pieces in flight). The floor's one slot
# reads every layer through "fg"; beside a two-slot read-ahead ("bg") that lane only
# loads pinned compressed layers, once. A read ahead of the forward (the read-ahead, or
# the floor's next layer while one is in use) keeps the shallower queue, so expert reads
# are not queued behind it (the raw read-ahead's READ_AHEAD_DEPTH rule).
FOREGROUND = (8 << 20, 16)
READ_AHEAD = (8 << 20, 6)


@dataclasses.dataclass(frozen=True)
class Task:
    """Blocks lo..hi-1, decodable once piece ``piece`` (and every piece before it) has
    landed and the tasks ``after`` have finished."""

    lo: int
    hi: int
    piece: int
    after: tuple


@dataclasses.dataclass(frozen=True)
class Schedule:
    at: int                   # where the stored bytes start in the buffer
    pieces: list              # (offset in the stored span, length), in order
    tasks: list               # Task, in block order


def schedule(plan: BlockPlan, stored: int, piece: int) -> Schedule:
    """How one layer of ``stored`` bytes (blocks ``plan``) is read in pieces of ``piece``
    bytes (a multiple of ALIGN) and decoded in place."""
    at = plan.in_place(ALIGN)
    pieces = [(a, min(piece, stored - a)) for a in range(0, stored, piece)]
    in_end = plan.in_off + plan.in_len
    out_end = plan.out_off + plan.out_len
    tasks: list = []
    lo = 0
    for k, (a, n) in enumerate(pieces):
        hi = int(np.searchsorted(in_end, a + n, side="right"))
        if hi > lo:
            o0, o1 = int(plan.out_off[lo]), int(out_end[hi - 1])
            after = tuple(u for u, t in enumerate(tasks)
                          if at + int(plan.in_off[t.lo]) < o1 and at + int(in_end[t.hi - 1]) > o0)
            tasks.append(Task(lo, hi, k, after))
            lo = hi
    return Schedule(at, pieces, tasks)


class PieceReader:
    def __init__(self, files, threads: int):
        self.files = files
        self.shapes = {"fg": FOREGROUND, "bg": READ_AHEAD}
        self.codec = Codec(1)                # one run of blocks per decode thread
        self._decode = ThreadPoolExecutor(max_workers=max(1, int(threads)),
                                          thread_name_prefix="k3-decode")
        # both made now (threads start on first use): the floor's fill thread and the
        # forward's pinned loads read through "fg" at once
        self._pools = {lane: ThreadPoolExecutor(max_workers=depth,
                                                thread_name_prefix=f"k3-read-{lane}")
                       for lane, (_, depth) in self.shapes.items()}
        self._schedules: dict = {}

    def _fetcher(self, run, buf, at: int, cancel, read_kw: dict):
        """fetch(a, n): the run's stored bytes [a, a+n) from the aligned ``run.offset``
        into ``buf[at + a:]`` (a raw run: its aligned window, ``at`` 0)."""
        f = self.files.get(run.path)
        what = f"layer {run.layer} trunk"
        start = align_down(run.offset)

        def fetch(a, n):
            if cancel is not None and cancel.is_set():    # closing: nobody needs the layer
                raise ReadCancelled()
            return f.read_window(start + a, n, buf[at + a:], what=what, cancel=cancel,
                                 **read_kw)
        return fetch

    def read(self, run, buf, check: bool, lane: str, landing: Landing | None = None,
             cancel=None, admit=None, **read_kw) -> tuple:
        """Read layer ``run`` (a LayerRun) into ``buf``: a raw run's aligned window from
        offset 0, a compressed run decoded from offset 0 (``buf`` holds at least
        ``run.buffer_bytes``); with ``check``, every compressed block's CRC first and
        its decoded values after (NaN or Inf refused; a raw run's CRC is the caller's).
        ``landing`` is told each final prefix; ``cancel`` (an Event) stops the read
        between pieces; ``admit(lo, hi, depth)``, called before bytes ``[lo, hi)`` of
        ``buf`` are written (a piece read, a run of blocks decoded), returns once they
        may be and how many pieces may be in flight then (default: the lane's);
        ``read_kw`` goes to each piece's ``read_window`` (the read-ahead's gate).
        Returns (bytes read, seconds waiting for pieces to land, seconds waiting for the
        decoders); the two add up to the layer's wall time. A bad block raises the first
        in block order."""
        piece, depth = self.shapes[lane]
        plan = run.blocks
        if plan is None:
            if buf.size < window_bytes(run.nbytes):
                raise ValueError(f"layer {run.layer}: buffer too small for its window")
            span = run.buffer_at + run.nbytes                         # payload end in buf
            at, tasks = 0, []
            pieces = [(a, min(piece, span - a)) for a in range(0, span, piece)]
            units = [a + n for a, n in pieces]
        else:
            s = self._schedules.get((run.layer, piece))
            if s is None:
                s = self._schedules[run.layer, piece] = schedule(plan, run.stored, piece)
            if buf.size < s.at + align_up(run.stored):
                raise ValueError(f"layer {run.layer}: buffer too small to decode in place")
            at, pieces, tasks = s.at, s.pieces, s.tasks
            units = [plan.out_off[t.hi - 1] + plan.out_len[t.hi - 1] for t in tasks]
        if landing is not None:
            landing.plan(units)
        fetch = self._fetcher(run, buf, at, cancel, read_kw)
        pool = self._pools[lane]

        def decode(t, after):
            for d in after:
                if d.exception() is not None:     # an earlier block is bad: the layer is
                    return                        # refused, and its bytes are not needed
            self.codec.decode(plan, t.lo, t.hi, buf, at + int(plan.in_off[t.lo]), buf,
                              check, run.path, run.layer, finite=check)

        reads: list = []
        decodes: list = []
        read_s = decode_s = 0.0
        try:
            t_next = 0
            for k in range(len(pieces)):
                while len(reads) < len(pieces):          # keep the queue full
                    a, n = pieces[len(reads)]
                    allowed = depth if admit is None else admit(at + a, at + a + n, depth)
                    if len(reads) > k and len(reads) - k >= allowed:
                        break
                    reads.append(pool.submit(fetch, a, n))
                    if landing is not None and plan is None:
                        reads[-1].add_done_callback(_marker(landing, len(reads) - 1))
                t0 = time.perf_counter()
                reads[k].result()
                read_s += time.perf_counter() - t0
                while t_next < len(tasks) and tasks[t_next].piece == k:
                    t = tasks[t_next]
                    if admit is not None:
                        admit(int(plan.out_off[t.lo]), int(units[t_next]), depth)
                    # submitted in order to a FIFO pool: every task waited on has started
                    d = self._decode.submit(decode, t, [decodes[u] for u in t.after])
                    if landing is not None:      # a task skipped after a bad block ends
                        d.add_done_callback(_marker(landing, t_next))   # past the prefix
                    decodes.append(d)
                    t_next += 1
            t0 = time.perf_counter()
            for d in decodes:
                d.result()
            decode_s += time.perf_counter() - t0
        finally:
            for fut in [*reads, *decodes]:
                fut.exception()       # every read and decode ends before the buffer is reused
        return (run.nbytes if plan is None else run.stored), read_s, decode_s

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._decode.shutdown(wait=True)
        self.codec.close()


def _marker(landing: Landing, k: int):
    """A done-callback marking unit k of ``landing`` if its future succeeded."""
    def mark(fut):
        if not fut.cancelled() and fut.exception() is None:
            landing.mark(k)
    return mark
