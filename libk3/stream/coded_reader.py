"""Reading a compressed trunk layer (formats/pack.md "Compressed trunk") into a ring slot
or a pinned buffer: its stored bytes in pieces through two small staging buffers, each
piece decoded while the next is read.

Owns: the staging buffers (two per lane of at most STAGE_BYTES: one lane for the
read-ahead thread, one for reads on the forward's thread), the piece schedule and the
read / decode timings. Does not own: the codec and its checks
(``libk3.stream.trunk_codec``), which layer goes where (``libk3.stream.trunk``).

Why pieces: staging a whole compressed layer would add ~0.7 of the largest layer to the
fixed overhead; two pieces per lane add 4 x STAGE_BYTES in all, and reading one piece
while decoding the other overlaps the disk with the decoder.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from ..io.direct import aligned_empty, window_bytes
from .trunk_codec import Codec

STAGE_BYTES = 8 << 20        # stored bytes per piece (a block is at most ~257 KiB)


class CodedReader:
    def __init__(self, files, threads: int):
        self.files = files
        self.codec = Codec(threads)
        self._lanes: dict = {}
        self._groups: dict = {}

    def _lane(self, name: str):
        if name not in self._lanes:
            self._lanes[name] = ([aligned_empty(window_bytes(STAGE_BYTES)) for _ in range(2)],
                                 ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix=f"k3-stage-{name}"))
        return self._lanes[name]

    def read(self, run, buf, check: bool, lane: str, **read_kw) -> tuple:
        """Decode layer ``run`` (a LayerRun with ``blocks``) into ``buf`` from offset 0;
        with ``check``, every block's CRC first. ``read_kw`` goes to ``read_window`` (the
        read-ahead's gate, pool and cancel). Returns (stored bytes read, read seconds,
        decode seconds)."""
        plan = run.blocks
        groups = self._groups.get(run.layer)
        if groups is None:
            groups = self._groups[run.layer] = plan.groups(STAGE_BYTES)
        f = self.files.get(run.path)
        bufs, stage = self._lane(lane)

        def fetch(g):
            lo, hi = groups[g]
            a = int(plan.in_off[lo])
            n = int(plan.in_off[hi - 1] + plan.in_len[hi - 1]) - a
            t0 = time.perf_counter()
            at = f.read_window(run.offset + a, n, bufs[g % 2], what=f"layer {run.layer} trunk",
                               **read_kw)
            return at, time.perf_counter() - t0

        read_s = decode_s = 0.0
        fut = stage.submit(fetch, 0) if groups else None
        try:
            for g, (lo, hi) in enumerate(groups):
                at, dt = fut.result()
                fut = stage.submit(fetch, g + 1) if g + 1 < len(groups) else None
                read_s += dt
                t0 = time.perf_counter()
                self.codec.decode(plan, lo, hi, bufs[g % 2], at, buf, check, run.path,
                                  run.layer)
                decode_s += time.perf_counter() - t0
        finally:
            if fut is not None:
                fut.exception()       # the next piece's read lands before its buffer is reused
        return run.stored, read_s, decode_s

    def close(self) -> None:
        for _, stage in self._lanes.values():
            stage.shutdown(wait=True)
        self.codec.close()
