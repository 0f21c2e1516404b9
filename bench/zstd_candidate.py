"""The codec k3 shipped before the nibble code, kept to measure against it
(bench/trunk_compress.py; not used by k3): per block of 128 Ki values, the sign+mantissa
plane raw, then one zstd frame (level 1) of the exponent plane.

It stores about 0.06 less of raw than the nibble code but decodes at ~1-1.5 GB/s of
output per core here (bench/README.md "Trunk compression").
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zstandard
from numba import njit

BLOCK_VALUES = 128 << 10
LEVEL = 1                      # level 1 compressed the plane as well as 3 and 9


@njit(cache=True, nogil=True)
def split_planes(u16, exponent, sign_mantissa):
    for i in range(u16.shape[0]):
        v = u16[i]
        exponent[i] = (v >> 7) & 0xFF
        sign_mantissa[i] = ((v >> 8) & 0x80) | (v & 0x7F)


@njit(cache=True, nogil=True)
def merge_planes(exponent, sign_mantissa, out):
    for i in range(exponent.shape[0]):
        m = np.uint16(sign_mantissa[i])
        out[i] = ((m & 0x80) << 8) | (np.uint16(exponent[i]) << 7) | (m & 0x7F)


class Encoded:
    def __init__(self, blocks, n):
        self.blocks = blocks                   # (k, sign+mantissa bytes, zstd frame)
        self.n = n
        self.stored = sum(len(sm) + len(fr) for _, sm, fr in blocks)


def encode_all(u16) -> Encoded:
    c = zstandard.ZstdCompressor(level=LEVEL, write_checksum=False, write_content_size=True,
                                 write_dict_id=False)
    out = []
    for a in range(0, u16.size, BLOCK_VALUES):
        blk = u16[a:a + BLOCK_VALUES]
        e, m = np.empty(blk.size, np.uint8), np.empty(blk.size, np.uint8)
        split_planes(blk, e, m)
        out.append((blk.size, m.tobytes(), c.compress(e)))
    return Encoded(out, u16.size)


def decode_all(e: Encoded, out16, threads: int) -> None:
    nb = len(e.blocks)
    cuts = [nb * t // threads for t in range(threads + 1)]

    def work(r):
        d = zstandard.ZstdDecompressor()
        at = sum(k for k, _, _ in e.blocks[:r[0]])
        for k, sm, frame in e.blocks[r[0]:r[1]]:
            exp = np.frombuffer(d.decompress(frame, max_output_size=k), np.uint8)
            merge_planes(exp, np.frombuffer(sm, np.uint8), out16[at:at + k])
            at += k

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(work, zip(cuts[:-1], cuts[1:])))
