"""The trunk: every layer's non-expert weights, pinned in RAM up to a budget, the rest
streamed through slots by one of the strategies of ``libk3.stream.trunk_modes``.

Owns: where each layer's run lives (``LayerRun``, from the shards or a pack), and the
streamer's shared half (``TrunkStreamer``): the pinned layers, reading a layer into a
buffer with its CRC checked, binding a layer's bytes to named arrays, and the provider
interface ``layer(L)`` / ``release(L)``. Does not own: the math (a bound layer holds
exactly what ``ResidentWeights.layer`` returns), how the unpinned layers stream (the ring
and the floor, ``libk3.stream.trunk_modes``, whose ``open_trunk`` builds a streamer), the
expert cache, or reading a layer in pieces and decoding a compressed one
(``libk3.stream.piece_reader``).

Why largest-first pinning: every token visits layers 0..n-1 in order, a cyclic scan on
which LRU scores zero; a pinned layer is a hit on every token, so the hit rate is the
pinned bytes' share, and pinning the largest layers first also shrinks the ring slots
(a slot must hold the largest UNpinned layer).
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
from ..budget import TrunkPlan
from ..pack.schema import crc_mismatch
from ..io.direct import ALIGN, FileSet, align_down, align_up, aligned_empty, window_bytes
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
    layers, reading and binding are shared here; what streams the rest is a subclass
    (``libk3.stream.trunk_modes``: ``_streamed``, ``_release_streamed``,
    ``_close_streaming``), chosen once from the plan by ``open_trunk``."""

    def __init__(self, cfg: K3Config, runs: list, plan: TrunkPlan, files: FileSet,
                 verify_reads: str = "first"):
        if verify_reads not in VERIFY_READS:
            raise ValueError(f"verify_reads must be one of {VERIFY_READS}")
        self.cfg = cfg
        self.runs = runs
        self.files = files
        self.verify_reads = verify_reads
        self._verified: set = set()   # layers whose bytes matched their CRC in this process
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
