"""The trunk's streaming strategies, chosen once from the budget's plan by ``open_trunk``:
the ring of two slots or more with its read-ahead thread (``_RingTrunk``), and the
floor's one slot, each layer handed out while it lands (``_FloorTrunk``).

Owns: which slot a layer is read into and when, the read-ahead, and handing a layer out.
Does not own: the pinned layers, reading a layer into a buffer, its CRC, or binding its
bytes to arrays (``libk3.stream.trunk.TrunkStreamer``, which both strategies extend).

Why two slots: one is computed on while the reader fills the next. One slot, for the
largest layer, is the minimum that can work, and the floor keeps the disk busy in it all
the same: the next ring layer is read from the moment the layer in use is handed out,
into the room the slot has beside it and, as the forward releases it, into the rest (no
byte of the layer in use is written while it is in use: a reader that overwrote the slot
in use would feed the forward half-replaced weights); and a layer is handed out while it
is still landing, each tensor bound once the bytes before its end are in (``landing``),
so the forward computes a layer's first tensors while its later ones are read
(bench/README.md "Trunk compression"). Slot rules: never hand out bytes being read,
never read into bytes in use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from ..budget import plan_trunk
from ..config import K3Config
from ..io.direct import HUGE_PAGE, FileSet, ReadCancelled, align_up
from .landing import Landing
from .trunk import READ_AHEAD_DEPTH, TrunkStreamer


def open_trunk(cfg: K3Config, runs: list, budget: int, files: FileSet,
               verify_reads: str = "first") -> TrunkStreamer:
    """The streamer for ``runs`` (``libk3.stream.trunk.LayerRun``) at ``budget`` bytes:
    the floor when the plan has one slot, else the ring (no slot: every layer pinned).
    ``verify_reads`` is one of ``libk3.stream.trunk.VERIFY_READS``."""
    plan = plan_trunk([r.held_bytes for r in runs], budget)
    mode = _FloorTrunk if len(plan.slots) == 1 else _RingTrunk
    return mode(cfg, runs, plan, files, verify_reads)


class _RingTrunk(TrunkStreamer):
    """Ring layers through two slots or more: a reader thread fills the next free slot
    with the next ring layer while the forward computes on another (none when every
    layer is pinned)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        # slot tag: None (free), ("reading", L, gen), ("ready", L, gen), ("inuse", L, gen)
        self._tag = [None] * self.n_slots
        self._base = [0] * self.n_slots
        self._gen = 0
        self._read_ptr = 0
        self._expect = self.ring[0] if self.ring else None
        self._error = None
        self._thread = None
        if self.n_slots >= 2:
            self._pool = ThreadPoolExecutor(max_workers=READ_AHEAD_DEPTH,
                                            thread_name_prefix="k3-trunk-io")
            self._thread = threading.Thread(target=self._reader, name="k3-trunk-reader",
                                            daemon=True)
            self._thread.start()

    def _streamed(self, L: int) -> Mapping:
        t0 = time.perf_counter()
        with self._cond:
            if self._expect != L:
                self._resync(L)
            while True:
                if self._error is not None:
                    raise self._error
                hit = next((i for i, t in enumerate(self._tag)
                            if t is not None and t[0] == "ready" and t[1] == L
                            and t[2] == self._gen), None)
                if hit is not None:
                    break
                self._cond.wait()
            self._tag[hit] = ("inuse", L, self._gen)
            self._expect = self._ring_next(L)
        self.stats["wait_seconds"] += time.perf_counter() - t0
        return self._bind(L, self._slots[hit], self._base[hit])

    def _release_streamed(self, L: int) -> None:
        with self._cond:
            for i, t in enumerate(self._tag):
                if t is not None and t[0] == "inuse" and t[1] == L:
                    self._tag[i] = None
            self._cond.notify_all()

    def _resync(self, L: int) -> None:
        """The forward asked for another layer than the reader prepared (an aborted pass):
        drop prepared slots and restart the read-ahead at L. Caller holds the lock."""
        self._gen += 1
        for i, t in enumerate(self._tag):
            if t is not None and t[0] == "ready":
                self._tag[i] = None
        self._read_ptr = self.ring.index(L)
        self._expect = L
        self._cond.notify_all()

    def _reader(self) -> None:
        try:
            while True:
                with self._cond:
                    while True:
                        L = self.ring[self._read_ptr]
                        need = self._need[L]
                        i = next((j for j, t in enumerate(self._tag)
                                  if t is None and self.slot_bytes[j] >= need), None)
                        if self._stop or i is not None:
                            break
                        self._cond.wait()
                    if self._stop:
                        return
                    gen = self._gen
                    self._tag[i] = ("reading", L, gen)
                    self._read_ptr = (self._read_ptr + 1) % len(self.ring)
                base = self._read(L, self._slots[i], background=True)
                with self._cond:
                    self._base[i] = base
                    self._tag[i] = ("ready", L, gen) if gen == self._gen else None
                    self._cond.notify_all()
        except ReadCancelled:               # closing: the layer being read is not needed
            return
        except BaseException as e:          # surfaced to the forward thread in layer()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _close_streaming(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class _FloorTrunk(TrunkStreamer):
    """Ring layers through one slot: the layer in use (a ``_Fill``, its region of the
    slot) is handed out while it lands; the next one's fill starts as it is handed out,
    into the room beside it and, once it is released, into its bytes; a fill is counted
    when it ends, so a read-ahead nobody takes is not counted as read."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._use = None
        self._fill = None
        self._space = threading.Condition()     # the region in use changed
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3-trunk-fill")

    def _streamed(self, L: int) -> Mapping:
        if self._use is not None:
            raise RuntimeError(f"layer {L} asked for before layer {self._use.layer} "
                               "was released")
        fill, self._fill = self._fill, None
        if fill is not None and fill.layer != L:   # read ahead for another layer (an
            self._end_fill(fill)                   # aborted pass): let it end first
            fill = None
        if fill is None:
            fill = self._start_fill(L)
        with self._space:
            self._use = fill
        if not self._stop:
            self._fill = self._start_fill(self._ring_next(L))
        self.stats["binds"] += 1
        return _LandingLayer(self, L, fill)

    def _release_streamed(self, L: int) -> None:
        fill = self._use
        if fill is None or fill.layer != L:
            return
        try:
            self._end_fill(fill)
        finally:
            with self._space:
                self._use = None
                self._space.notify_all()

    def _place(self, L: int) -> int:
        """Where layer L's region of the slot starts: after the layer in use if it fits
        there (on a huge-page boundary if that fits too), else at the start."""
        use, need, room = self._use, self._need[L], self.slot_bytes[0]
        if use is not None:
            for at in (-(-use.end // HUGE_PAGE) * HUGE_PAGE, align_up(use.end)):
                if at + need <= room:
                    return at
        return 0

    def _start_fill(self, L: int) -> "_Fill":
        """Start reading layer L into its region of the one slot on the fill thread
        (after any fill before it: one thread)."""
        at = self._place(L)
        fill = _Fill(L, dict.fromkeys(self.stats, 0), at, at + self._need[L])
        fill.future = self._filler.submit(self._fill_slot, fill)
        return fill

    def _fill_slot(self, fill: "_Fill") -> None:
        try:
            self._read(fill.layer, self._slots[0][fill.at:], tally=fill.tally,
                       landing=fill.landing,
                       admit=lambda lo, hi, depth: self._admit(fill, lo, hi, depth))
        except BaseException as e:
            fill.landing.fail(e)
            raise
        fill.landing.finish()

    def _admit(self, fill: "_Fill", lo: int, hi: int, depth: int) -> int:
        """Wait until bytes [lo, hi) of ``fill``'s region are clear of the layer in use;
        then the pieces in flight allowed: the lane's ``depth`` while no layer is in use,
        else the read-ahead's, after any urgent (expert) read (the read is then ahead of
        the forward, whose expert reads must not queue behind it)."""
        a, b = fill.at + lo, fill.at + hi
        with self._space:
            while True:
                if self._cancel.is_set():
                    raise ReadCancelled()
                use = self._use
                if use is None or use is fill or b <= use.at or a >= use.end:
                    break
                if not threading.main_thread().is_alive():   # exiting without close():
                    raise ReadCancelled()                    # the release will not come
                self._space.wait(1.0)
        if use is None or use is fill:
            return depth
        self.files.gate.wait_clear(drives=self.files.get(self.runs[fill.layer].path).drives)
        return min(depth, self._pieces.shapes["bg"][1])

    def _end_fill(self, fill: "_Fill") -> None:
        """Wait for every byte of ``fill`` (the slot is then free to read into), count it,
        and raise its error, if any (a damaged or unreadable pack)."""
        t0 = time.perf_counter()
        try:
            fill.future.result()
        finally:
            self.stats["wait_seconds"] += time.perf_counter() - t0
            with self._cond:
                for k, v in fill.tally.items():
                    self.stats[k] += v

    def _close_streaming(self) -> None:
        with self._space:
            self._space.notify_all()
        self._filler.shutdown(wait=True)          # a read ahead nobody will use stops first


class _Fill:
    """The floor slot's read of one layer: its region of the slot (``at`` to ``end``: the
    layer's read buffer), which prefix of the region is final, the read's future and
    counters."""

    __slots__ = ("layer", "tally", "at", "end", "landing", "future")

    def __init__(self, layer: int, tally: dict, at: int, end: int):
        self.layer, self.tally, self.at, self.end = layer, tally, at, end
        self.landing = Landing()
        self.future = None


class _LandingLayer(Mapping):
    """The floor slot's layer, handed out while it lands: a tensor is bound when first
    asked for, once the bytes before its end are final (waiting counts as the forward's
    wait). Same arrays as ``TrunkStreamer._bind``; valid until the layer's release."""

    def __init__(self, streamer: TrunkStreamer, L: int, fill: _Fill):
        self._ts, self._L, self._fill = streamer, L, fill
        self._run = streamer.runs[L]
        self._at = self._run.buffer_at          # where the run starts in its region
        self._bound: dict = {}

    def __getitem__(self, sfx: str):
        arr = self._bound.get(sfx)
        if arr is None:
            sub, nb, dt, shape = self._run.tensors[sfx]
            t0 = time.perf_counter()
            self._fill.landing.wait(self._at + sub + nb)
            self._ts.stats["wait_seconds"] += time.perf_counter() - t0
            arr = self._bound[sfx] = self._ts._bind_one(self._L, sfx, self._ts._slots[0],
                                                        self._fill.at + self._at)
        return arr

    def __iter__(self):
        return iter(self._run.tensors)

    def __len__(self) -> int:
        return len(self._run.tensors)
