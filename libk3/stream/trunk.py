"""The trunk: every layer's non-expert weights, pinned in RAM up to a budget, the rest
streamed through a ring of layer slots filled by a read-ahead thread.

Owns: choosing which layers to pin, binding a layer's bytes to named arrays, and the two
strategies that stream the rest, chosen once from the budget's plan: the ring of two
slots or more with its reader thread (``_RingTrunk``), and the floor's one slot
(``_FloorTrunk``). Does not own: the math (a bound layer holds exactly what
``ResidentWeights.layer`` returns), the expert cache, or reading a layer in pieces and
decoding a compressed one (``libk3.stream.piece_reader``).

Why largest-first pinning: every token visits layers 0..n-1 in order, a cyclic scan on
which LRU scores zero; a pinned layer is a hit on every token, so the hit rate is the
pinned bytes' share, and pinning the largest layers first also shrinks the ring slots
(a slot must hold the largest UNpinned layer).
Why two slots: one is computed on while the reader fills the next. One slot, for the largest layer, is the minimum that
can work, and the floor keeps the disk busy in it all the same: the next ring layer is
read from the moment the layer in use is handed out, into the room the slot has beside
it and, as the forward releases it, into the rest (no byte of the layer in use is
written while it is in use: a reader that overwrote the slot in use would feed the
forward half-replaced weights); and a layer is handed out while it is still landing, each tensor
bound once the bytes before its end are in (``landing``), so the forward computes a
layer's first tensors while its later ones are read (bench/README.md "Trunk
compression"). Slot rules: never hand out bytes being read, never read into bytes in use.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .. import names
from ..config import K3Config
from ..io import inventory
from ..io.dtypes import bound_extra_bytes, matrix_operand, widen
from ..budget import plan_trunk
from ..pack.schema import crc_mismatch
from ..io.direct import (ALIGN, HUGE_PAGE, FileSet, ReadCancelled, align_down, align_up,
                         aligned_empty, window_bytes)
from .landing import Landing


# Trunk read-ahead pieces in flight at once: fewer, smaller pieces read GB-sized layers
# slower, deeper queues expert reads behind the read-ahead (bench/README.md, "Disk and
# read-ahead").
READ_AHEAD_DEPTH = 4
# When a packed layer's CRC is checked: the first time this process reads it (pinned
# layers at load, ring layers on their first pass), or on every read (formats/pack.md).
VERIFY_READS = ("first", "every")


class LayerRun:
    """Where one layer's trunk run lives: file, offset, length, tensors inside it, and the
    CRC-32 its bytes must have (a pack's manifest; None for a run read from the shards).
    In a compressed pack, ``blocks`` (a BlockPlan with its index) and ``stored`` say how
    the run is stored at ``offset``; ``nbytes`` stays the decoded run's length."""

    __slots__ = ("layer", "path", "offset", "nbytes", "tensors", "crc32", "blocks", "stored")

    def __init__(self, layer, path, offset, nbytes, tensors, crc32=None, blocks=None,
                 stored=None):
        self.layer, self.path, self.offset, self.nbytes = layer, str(path), offset, nbytes
        self.tensors = tensors        # suffix -> (suboffset, nbytes, dtype, shape)
        self.crc32 = crc32
        self.blocks, self.stored = blocks, stored

    @property
    def buffer_at(self) -> int:
        """Where the run starts in a buffer it is read into: a compressed run is decoded
        from offset 0, a raw one is read in its aligned window."""
        return 0 if self.blocks is not None else self.offset - align_down(self.offset)

    @property
    def buffer_bytes(self) -> int:
        """The buffer a read of this layer needs: its aligned window, or for a compressed
        layer room to decode it in place (``BlockPlan.in_place``), whichever is larger."""
        if self.blocks is None:
            return window_bytes(self.nbytes)
        return max(window_bytes(self.nbytes),
                   self.blocks.in_place(ALIGN) + align_up(self.stored))

    @property
    def held_bytes(self) -> int:
        """RAM the layer costs once bound: its run plus any F16 tensor's widened copy."""
        return self.nbytes + sum(bound_extra_bytes(dt, nb) for _, nb, dt, _ in self.tensors.values())


def runs_from_checkpoint(ckpt) -> list:
    out = []
    for L in range(ckpt.config.num_hidden_layers):
        run = ckpt.layer_trunk_run(L)
        prefix = names.layer_prefix(L)
        out.append(LayerRun(L, run.path, run.offset, run.nbytes,
                            {n[len(prefix):]: (s, nb, dt, tuple(sh))
                             for n, (s, nb, dt, sh) in run.tensors.items()}))
    return out


def runs_from_pack(pack_dir, manifest: dict, blocks: list | None = None) -> list:
    """The runs of a manifest already checked by ``libk3.pack.schema.open_pack`` (with
    ``blocks``, its block plans, for a compressed trunk)."""
    trunk = Path(pack_dir) / manifest["trunk_file"]
    return [LayerRun(lay["layer"], trunk, lay["file_off"], lay["nbytes"],
                     {sfx: (t["off"], t["nbytes"], t["dtype"], tuple(t["shape"]))
                      for sfx, t in lay["tensors"].items()}, lay["crc32"],
                     blocks[lay["layer"]] if blocks else None, lay.get("stored"))
            for lay in manifest["layers"]]


class _FoldedCrc:
    """The CRC-32 of a layer's payload computed piece by piece on a helper thread while the
    foreground read fetches the next piece (zlib.crc32 and preadv both release the GIL):
    at the floor every layer's first read is foreground, and a whole-trunk CRC after each
    read would add its time to the first token."""

    def __init__(self, run: LayerRun, buf):
        self.lo = run.buffer_at                             # the payload inside the window
        self.hi = self.lo + run.nbytes
        self.buf = buf
        self.crc = 0
        self.seconds = 0.0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3-trunk-crc")
        self.last = None

    def _fold(self, a: int, b: int) -> None:
        t0 = time.perf_counter()
        self.crc = zlib.crc32(self.buf[a:b], self.crc)
        self.seconds += time.perf_counter() - t0

    def feed(self, a: int, b: int) -> None:
        a, b = max(a, self.lo), min(b, self.hi)
        if a < b:                    # one worker: pieces fold in order
            self.last = self.pool.submit(self._fold, a, b)

    def result(self) -> tuple:
        """(crc, seconds spent folding) once every piece is in."""
        try:
            if self.last is not None:
                self.last.result()
        finally:
            self.close()
        return self.crc, self.seconds

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class TrunkStreamer:
    """Weight-provider half for trunk layers: ``layer(L)`` / ``release(L)``. The pinned
    layers, reading and binding are shared; what streams the rest is one of two
    strategies, chosen once from the plan: the ring (``_RingTrunk``: two slots or more and
    a read-ahead thread, or none when every layer is pinned) or the floor (``_FloorTrunk``:
    one slot, each layer handed out while it lands). ``TrunkStreamer(...)`` builds the one
    the budget's plan calls for."""

    def __new__(cls, cfg: K3Config, runs: list, budget: int, files: FileSet,
                verify_reads: str = "first"):
        if cls is TrunkStreamer:
            slots = plan_trunk([r.held_bytes for r in runs], budget).slots
            cls = _FloorTrunk if len(slots) == 1 else _RingTrunk
        return super().__new__(cls)

    def __init__(self, cfg: K3Config, runs: list, budget: int, files: FileSet,
                 verify_reads: str = "first"):
        if verify_reads not in VERIFY_READS:
            raise ValueError(f"verify_reads must be one of {VERIFY_READS}")
        self.cfg = cfg
        self.runs = runs
        self.files = files
        self.verify_reads = verify_reads
        self._verified: set = set()   # layers whose bytes matched their CRC in this process
        plan = plan_trunk([r.held_bytes for r in runs], budget)
        self.pinned_plan, capacities = set(plan.pinned), list(plan.slots)
        self.n_slots = len(capacities)
        self.ring = [i for i in range(len(runs)) if i not in self.pinned_plan]
        self._need = [r.buffer_bytes for r in runs]     # a read's buffer, by layer
        room = max((self._need[L] - window_bytes(runs[L].nbytes) for L in self.ring),
                   default=0)                           # a compressed layer's in-place room
        self.slot_bytes = [window_bytes(c) + room for c in capacities]
        self.matrix = [{spec.name[len(names.layer_prefix(L)):]
                        for spec in inventory.layer_trunk(cfg, L) if spec.kind == inventory.MATRIX}
                       for L in range(cfg.num_hidden_layers)]
        self.pinned: dict = {}
        self.stats = {"bytes_read": 0, "read_seconds": 0.0, "wait_seconds": 0.0, "binds": 0,
                      "pinned_hits": 0, "ring_reads": 0, "crc_checks": 0, "crc_seconds": 0.0,
                      "bytes_decoded": 0, "decode_seconds": 0.0}
        self._pieces = None         # the floor's and a compressed pack's reader (its
        if self.n_slots == 1 or any(r.blocks is not None for r in runs):  # decoder uses
            import numba                                                  # every thread)

            from .piece_reader import PieceReader
            self._pieces = PieceReader(files, numba.get_num_threads())
        self._slots = [aligned_empty(b) for b in self.slot_bytes]
        self._cond = threading.Condition()
        self._stop = False
        self._cancel = threading.Event()     # set by close(): abandon the read-ahead
        self._pool = None                    # the ring's read-ahead pieces

    # ---- reading and binding ---------------------------------------------------------
    def _checks(self, run: LayerRun) -> bool:
        """Whether this read of ``run`` checks its CRC (``verify_reads``)."""
        return ((run.crc32 is not None or run.blocks is not None)
                and (self.verify_reads == "every" or run.layer not in self._verified))

    def _read(self, L: int, buf, background: bool = False, tally: dict | None = None,
              landing: Landing | None = None, admit=None) -> int:
        """Read layer L into ``buf``; returns where its run starts. Counters go to
        ``tally`` (default: ``stats``). ``landing`` and ``admit`` (the floor's slot: see
        ``PieceReader.read``) learn each final prefix of ``buf`` and say when a part of it
        may be written, except for a raw run whose CRC is checked: its one CRC covers the
        whole run, so nothing of it is final before the whole is read and matched."""
        tally = self.stats if tally is None else tally
        run = self.runs[L]
        check = self._checks(run)
        if run.blocks is not None or (landing is not None and not check):
            return self._read_pieces(run, buf, background, tally, check, landing, admit)
        if admit is not None:
            admit(0, self._need[L], 1)
        folded = _FoldedCrc(run, buf) if check and not background else None
        t0 = time.perf_counter()
        try:
            base = self.files.get(run.path).read_window(
                run.offset, run.nbytes, buf, what=f"layer {L} trunk",
                yield_to=self.files.gate if background else None,
                pool=self._pool if background else None, depth=READ_AHEAD_DEPTH,
                cancel=self._cancel if background else None,
                on_piece=folded.feed if folded is not None else None)
        except BaseException:
            if folded is not None:
                folded.close()
            raise
        dt = time.perf_counter() - t0
        with self._cond:
            tally["bytes_read"] += run.nbytes
            tally["read_seconds"] += dt
        if folded is not None:
            self._crc_result(run, *folded.result(), tally)
        elif check:
            self._check_crc(run, buf, base, tally)
        return base

    def _read_pieces(self, run: LayerRun, buf, background: bool, tally: dict, check: bool,
                     landing: Landing | None, admit=None) -> int:
        """Read ``run`` into ``buf`` through the piece reader: a compressed layer decoded
        (its blocks' CRCs checked with ``check``: a block is final once it matched and
        decoded), or a raw one whose CRC is not due."""
        kw = dict(yield_to=self.files.gate) if background else {}
        cancel = self._cancel if background or landing is not None else None
        nread, dt, dec = self._pieces.read(run, buf, check, "bg" if background else "fg",
                                           landing, cancel, admit, **kw)
        with self._cond:
            tally["bytes_read"] += nread
            tally["read_seconds"] += dt
            if run.blocks is not None:
                tally["bytes_decoded"] += run.nbytes
                tally["decode_seconds"] += dec
            tally["crc_checks"] += int(check)
        if check and run.blocks is not None and run.crc32 is not None:
            # the blocks' own CRCs match what the index says; the decoded layer must be
            # the one the manifest's crc32 names (as k3-pack verify checks it), or a block
            # rewritten with a recomputed index would decode into other weights
            self._check_crc(run, buf, run.buffer_at, tally)
        elif check:
            self._verified.add(run.layer)
        return run.buffer_at

    def _check_crc(self, run: LayerRun, buf, base: int, tally: dict) -> None:
        """Refuse bytes that differ from the manifest's CRC. On the read-ahead thread for
        ring layers, so it overlaps compute (zlib.crc32 releases the GIL)."""
        t0 = time.perf_counter()
        crc = zlib.crc32(buf[base:base + run.nbytes])
        self._crc_result(run, crc, time.perf_counter() - t0, tally)

    def _crc_result(self, run: LayerRun, crc: int, seconds: float, tally: dict) -> None:
        with self._cond:
            tally["crc_checks"] += 1
            tally["crc_seconds"] += seconds
        if crc != run.crc32:      # where: a striped trunk names its stripe files
            raise crc_mismatch(self.files.where(run.path, run.offset, run.nbytes), run.layer,
                               run.crc32, crc)
        self._verified.add(run.layer)

    def _bind(self, L: int, buf, base: int) -> dict:
        """suffix -> array, every tensor of layer L (``_bind_one``)."""
        self.stats["binds"] += 1
        return {sfx: self._bind_one(L, sfx, buf, base) for sfx in self.runs[L].tensors}

    def _bind_one(self, L: int, sfx: str, buf, base: int):
        """A matrix in the dtype the run records for it (a view of ``buf`` when aligned,
        ``matrix_operand``), a vector widened to f32."""
        sub, nb, dt, shape = self.runs[L].tensors[sfx]
        raw = buf[base + sub: base + sub + nb]
        if sfx in self.matrix[L]:
            return matrix_operand(raw, dt, shape)
        return np.ascontiguousarray(widen(raw, dt, shape), dtype=np.float32)

    # ---- the provider interface -----------------------------------------------------
    def layer(self, L: int) -> Mapping:
        if L in self.pinned:
            self.stats["pinned_hits"] += 1
            return self.pinned[L]
        if L in self.pinned_plan:
            buf = aligned_empty(self._need[L])
            self.pinned[L] = self._bind(L, buf, self._read(L, buf))
            return self.pinned[L]
        self.stats["ring_reads"] += 1
        return self._streamed(L)

    def release(self, L: int) -> None:
        if L not in self.pinned_plan:
            self._release_streamed(L)

    def _ring_next(self, L: int) -> int:
        """The ring layer a pass reads after ring layer L (after the last, the first)."""
        return self.ring[(self.ring.index(L) + 1) % len(self.ring)]

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cancel.set()
            self._cond.notify_all()
        self._close_streaming()
        if self._pieces is not None:
            self._pieces.close()

    def describe(self) -> dict:
        return {"pinned_layers": sorted(self.pinned_plan), "ring_slots": self.n_slots,
                "slot_bytes": self.slot_bytes,
                "pinned_bytes": sum(self.runs[L].nbytes for L in self.pinned_plan)}


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
