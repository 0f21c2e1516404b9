"""Reading a compressed trunk layer (formats/pack.md "Compressed trunk") into a ring slot
or a pinned buffer: its stored bytes in pieces through a few staging buffers, several
pieces in flight while the landed ones are decoded, a whole piece per decode thread.

Owns: the staging buffers, in lanes (one for the read-ahead thread, one for reads on the
forward's thread), the piece schedule and the read / decode timings. Does not own: the
codec and its checks (``libk3.stream.trunk_codec``), which layer goes where
(``libk3.stream.trunk``).

Why pieces: staging a whole compressed layer would add ~0.75 of the largest layer to the
fixed overhead; a LANE adds 64 MiB (the floor has one lane), a SMALL_LANE 12 MiB (the
forward's lane beside a read-ahead only loads pinned layers, once), so at most 76 MiB,
inside the runtime reserve. Why 48 MiB in flight: inside k3-run the disk idles while a
layer computes, and with 16 MiB in flight the compressed trunk pass took 0.87-1.06x of
raw's time, with 48 MiB 0.86-0.89x (64 MiB did better still but overran the reserve at
the real-dims floor; bench/README.md "Trunk compression"). Why a decode queue beside the
pieces in flight: pieces land in bursts, and with no buffer to spare the next reads waited
for the decoders. Why a piece per decode thread: splitting each piece across the threads
made every piece wait for the slower half.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from ..io.direct import aligned_empty, window_bytes
from .trunk_codec import Codec

# A lane's shape: (stored bytes per piece (a block is at most ~257 KiB), pieces in
# flight, landed pieces waiting for or in a decoder).
LANE = (8 << 20, 6, 2)
SMALL_LANE = (4 << 20, 2, 1)


class CodedReader:
    def __init__(self, files, threads: int, read_ahead: bool = False):
        self.files = files
        self.shapes = {"bg": LANE, "fg": SMALL_LANE if read_ahead else LANE}
        self.codec = Codec(1)                # one piece per decode thread
        self._decode = ThreadPoolExecutor(max_workers=max(1, int(threads)),
                                          thread_name_prefix="k3-decode")
        self._lanes: dict = {}
        self._groups: dict = {}

    def _lane(self, name: str):
        if name not in self._lanes:
            piece, depth, queue = self.shapes[name]
            self._lanes[name] = ([aligned_empty(window_bytes(piece))
                                  for _ in range(depth + queue)],
                                 ThreadPoolExecutor(max_workers=depth,
                                                    thread_name_prefix=f"k3-stage-{name}"))
        return self._lanes[name]

    def read(self, run, buf, check: bool, lane: str, **read_kw) -> tuple:
        """Decode layer ``run`` (a LayerRun with ``blocks``) into ``buf`` from offset 0;
        with ``check``, every block's CRC first. ``read_kw`` goes to each piece's
        ``read_window`` (the read-ahead's gate and cancel). Returns (stored bytes read,
        seconds waiting for pieces to land, seconds waiting for the decoders); the two add
        up to the layer's wall time. A bad block raises the first in block order."""
        plan = run.blocks
        piece, depth, _ = self.shapes[lane]
        groups = self._groups.get((run.layer, piece))
        if groups is None:
            groups = self._groups[run.layer, piece] = plan.groups(piece)
        f = self.files.get(run.path)
        bufs, stage = self._lane(lane)

        def fetch(g):
            a, n = plan.span(*groups[g])
            return f.read_window(run.offset + a, n, bufs[g % len(bufs)],
                                 what=f"layer {run.layer} trunk", **read_kw)

        def decode(g, at):
            lo, hi = groups[g]
            self.codec.decode(plan, lo, hi, bufs[g % len(bufs)], at, buf, check, run.path,
                              run.layer)

        read_s = decode_s = 0.0
        reads = {g: stage.submit(fetch, g) for g in range(min(depth, len(groups)))}
        decodes: dict = {}
        try:
            for g in range(len(groups)):
                t0 = time.perf_counter()
                at = reads.pop(g).result()
                t1 = time.perf_counter()
                decodes[g] = self._decode.submit(decode, g, at)
                nxt = g + depth                      # its buffer was piece nxt - len(bufs)'s
                if nxt < len(groups):
                    if nxt - len(bufs) in decodes:
                        decodes.pop(nxt - len(bufs)).result()
                    reads[nxt] = stage.submit(fetch, nxt)
                read_s += t1 - t0
                decode_s += time.perf_counter() - t1
            t0 = time.perf_counter()
            for g in sorted(decodes):
                decodes.pop(g).result()
            decode_s += time.perf_counter() - t0
        finally:
            for fut in [*reads.values(), *decodes.values()]:
                fut.exception()       # every piece lands and decodes before its buffer is reused
        return run.stored, read_s, decode_s

    def close(self) -> None:
        for _, stage in self._lanes.values():
            stage.shutdown(wait=True)
        self._decode.shutdown(wait=True)
        self.codec.close()
