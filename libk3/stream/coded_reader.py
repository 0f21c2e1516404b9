"""Reading a compressed trunk layer (formats/pack.md "Compressed trunk") into a ring slot
or a pinned buffer: its stored bytes in pieces through a few small staging buffers,
READ_DEPTH pieces in flight while the landed ones are decoded, a whole piece per decode
thread.

Owns: the staging buffers (READ_DEPTH + DECODE_QUEUE per lane, of at most STAGE_BYTES
each: one lane for the read-ahead thread, one for reads on the forward's thread),
the piece schedule and the read / decode timings. Does not own: the codec and its checks
(``libk3.stream.trunk_codec``), which layer goes where (``libk3.stream.trunk``).

Why pieces: staging a whole compressed layer would add ~0.75 of the largest layer to the
fixed overhead; the pieces add 2 x (READ_DEPTH + DECODE_QUEUE) x STAGE_BYTES (80 MiB)
in all, 40 MiB at the floor (one lane). Why several in flight and a piece per thread: one
piece at a time left the disk idle between pieces, and splitting each piece across the
threads made every piece wait for the slower half. Why a decode queue deeper than the
decode threads: pieces land in bursts, and with a buffer per thread the next reads waited
for the decoders; a pass of the floor loop took 7 % longer (bench/README.md "Trunk
compression").
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from ..io.direct import aligned_empty, window_bytes
from .trunk_codec import Codec

STAGE_BYTES = 4 << 20        # stored bytes per piece (a block is at most ~257 KiB)
READ_DEPTH = 4               # pieces in flight per lane
DECODE_QUEUE = 6             # landed pieces per lane waiting for or in a decoder


class CodedReader:
    def __init__(self, files, threads: int):
        self.files = files
        self.threads = max(1, int(threads))
        self.codec = Codec(1)                # one piece per decode thread
        self._decode = ThreadPoolExecutor(max_workers=self.threads,
                                          thread_name_prefix="k3-decode")
        self._lanes: dict = {}
        self._groups: dict = {}

    def _lane(self, name: str):
        if name not in self._lanes:
            self._lanes[name] = ([aligned_empty(window_bytes(STAGE_BYTES))
                                  for _ in range(READ_DEPTH + DECODE_QUEUE)],
                                 ThreadPoolExecutor(max_workers=READ_DEPTH,
                                                    thread_name_prefix=f"k3-stage-{name}"))
        return self._lanes[name]

    def read(self, run, buf, check: bool, lane: str, **read_kw) -> tuple:
        """Decode layer ``run`` (a LayerRun with ``blocks``) into ``buf`` from offset 0;
        with ``check``, every block's CRC first. ``read_kw`` goes to each piece's
        ``read_window`` (the read-ahead's gate and cancel). Returns (stored bytes read,
        seconds waiting for pieces to land, seconds waiting for the decoders); the two add
        up to the layer's wall time. A bad block raises the first in block order."""
        plan = run.blocks
        groups = self._groups.get(run.layer)
        if groups is None:
            groups = self._groups[run.layer] = plan.groups(STAGE_BYTES)
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
        reads = {g: stage.submit(fetch, g) for g in range(min(READ_DEPTH, len(groups)))}
        decodes: dict = {}
        try:
            for g in range(len(groups)):
                t0 = time.perf_counter()
                at = reads.pop(g).result()
                t1 = time.perf_counter()
                decodes[g] = self._decode.submit(decode, g, at)
                nxt = g + READ_DEPTH                 # its buffer was piece nxt - len(bufs)'s
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
