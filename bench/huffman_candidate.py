"""A codec candidate we measured against the chosen one (bench/trunk_compress.py; not
used by k3): a numba canonical Huffman decoder for the BF16 exponent plane.

A coded block of k values stores: 256 code lengths (one byte per exponent value, 0 =
absent), the k sign+mantissa bytes ``(v >> 8 & 0x80) | (v & 0x7f)``, then the k exponents
``v >> 7 & 0xff`` as canonical Huffman codes of at most MAX_BITS bits, packed LSB first.
MAX_BITS = 12: every code decodes with one lookup in a 4096-entry table, and each table
entry holds up to 3 whole codes (codes average ~2.6 bits). Per core it decoded at about
0.4-0.6 of zstd's rate on the same bytes, far below the 4-bit code's (bench/README.md
"Trunk compression").
"""

from __future__ import annotations

import heapq
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

MAX_BITS = 12
TABLE = 1 << MAX_BITS
LENGTHS = 256                  # bytes of code lengths at the start of a coded block
# decode status of a block
OK, BAD_LENGTHS, BAD_STREAM = 0, 1, 2
RAW, CODED = 0, 1              # block kinds


def code_lengths(counts) -> np.ndarray:
    """Huffman code lengths (uint8[256], at most MAX_BITS) for symbol ``counts``; a lone
    symbol gets length 1, absent symbols 0. Deterministic: ties break by symbol. Over-long
    codes are avoided by halving the counts (keeping them >= 1) and rebuilding."""
    counts = np.asarray(counts, dtype=np.int64).copy()
    present = np.flatnonzero(counts)
    out = np.zeros(256, np.uint8)
    if present.size == 0:
        return out
    if present.size == 1:
        out[present[0]] = 1
        return out
    while True:
        heap = [(int(counts[s]), int(s), [int(s)]) for s in present]
        heapq.heapify(heap)
        depth = np.zeros(256, np.int64)
        while len(heap) > 1:
            c1, k1, s1 = heapq.heappop(heap)
            c2, k2, s2 = heapq.heappop(heap)
            for s in s1:
                depth[s] += 1
            for s in s2:
                depth[s] += 1
            heapq.heappush(heap, (c1 + c2, min(k1, k2), s1 + s2))
        if depth.max() <= MAX_BITS:
            out[:] = depth
            return out
        counts[present] = np.maximum(counts[present] >> 1, 1)


@njit(cache=True)
def canonical_codes(lengths, codes):
    """Fill ``codes`` (uint32[256]) with each symbol's canonical code, bit-reversed for an
    LSB-first stream. Returns False if the lengths over-fill the code space (Kraft > 1) or
    exceed MAX_BITS."""
    bl_count = np.zeros(MAX_BITS + 1, np.int64)
    for s in range(256):
        if lengths[s] > MAX_BITS:
            return False
        bl_count[lengths[s]] += 1
    bl_count[0] = 0
    kraft = 0
    for n in range(1, MAX_BITS + 1):
        kraft += bl_count[n] << (MAX_BITS - n)
    if kraft > TABLE:
        return False
    next_code = np.zeros(MAX_BITS + 2, np.int64)
    code = 0
    for n in range(1, MAX_BITS + 1):
        code = (code + bl_count[n - 1]) << 1
        next_code[n] = code
    for s in range(256):
        n = lengths[s]
        if n:
            c = next_code[n]
            next_code[n] += 1
            r = 0
            for _ in range(n):
                r = (r << 1) | (c & 1)
                c >>= 1
            codes[s] = r
        else:
            codes[s] = 0
    return True


@njit(cache=True)
def exponent_counts(u16, counts):
    """counts[e] += number of values of ``u16`` (BF16 bit patterns) with exponent byte e."""
    for i in range(u16.shape[0]):
        counts[(u16[i] >> 7) & 0xFF] += 1


@njit(cache=True)
def encode_block(u16, lengths, codes, out):
    """Write one coded block of ``u16`` into ``out`` (uint8, at least
    ``coded_bound(len(u16))`` bytes); returns the bytes written. ``lengths``/``codes`` from
    ``code_lengths`` / ``canonical_codes`` over this block's exponents."""
    k = u16.shape[0]
    for s in range(256):
        out[s] = lengths[s]
    pos = LENGTHS
    for i in range(k):
        v = u16[i]
        out[pos + i] = ((v >> 8) & 0x80) | (v & 0x7F)
    pos += k
    buf = np.uint64(0)
    nbits = 0
    for i in range(k):
        e = (u16[i] >> 7) & 0xFF
        buf |= np.uint64(codes[e]) << np.uint64(nbits)
        nbits += lengths[e]
        while nbits >= 8:
            out[pos] = np.uint8(buf & np.uint64(0xFF))
            pos += 1
            buf >>= np.uint64(8)
            nbits -= 8
    if nbits > 0:
        out[pos] = np.uint8(buf & np.uint64(0xFF))
        pos += 1
    return pos


def coded_bound(k: int) -> int:
    """Most bytes a coded block of k values can take."""
    return LENGTHS + k + (k * MAX_BITS + 7) // 8


@njit(cache=True, nogil=True)
def _fill_table(lengths, codes, single, table):
    """``table[j]`` for every MAX_BITS-bit window j: up to 3 whole codes at its low end,
    as symbols (bits 0..23), how many (bits 24..25; 0 = no code starts there) and their
    total length (bits 26..29). Why several: codes average ~2.6 bits, so one lookup
    usually yields 3 values (1 per lookup decoded at a third of the rate)."""
    single[:] = 0
    for s in range(256):
        n = lengths[s]
        if n:
            for j in range(codes[s], TABLE, 1 << n):
                single[j] = (n << 8) | s
    for j in range(TABLE):
        ent = 0
        used = 0
        cnt = 0
        while cnt < 3:
            e = single[(j >> used) & (TABLE - 1)]
            n = e >> 8
            if n == 0 or used + n > MAX_BITS:
                break
            ent |= (e & 0xFF) << (8 * cnt)
            used += n
            cnt += 1
        table[j] = ent | (cnt << 24) | (used << 26)


@njit(cache=True, nogil=True)
def _decode_coded(src, a, n_in, out, o, k, single, table, codes):
    """One coded block: ``n_in`` bytes of ``src`` at ``a`` -> k BF16 values of ``out``
    (uint16) from ``o``. Refills 7 bytes at a time, then 4 lookups (4 x 12 bits fit in
    the >= 56 bits a refill leaves); bytes past the stream read as zero bits, and a stream
    that ran short is caught by the bit count at the end."""
    if n_in < LENGTHS + k:
        return BAD_LENGTHS
    lengths = src[a:a + LENGTHS]
    if not canonical_codes(lengths, codes):
        return BAD_LENGTHS
    _fill_table(lengths, codes, single, table)
    sm = a + LENGTHS
    pos = sm + k
    end = a + n_in
    buf = np.uint64(0)
    nbits = 0
    hole = 0
    virtual = 0             # zero bits appended past the end of the stream
    mask = np.uint64(TABLE - 1)
    i = 0
    while i < k:
        if pos + 8 <= end:
            w = np.uint64(0)
            for j in range(8):
                w |= np.uint64(src[pos + j]) << np.uint64(8 * j)
            buf |= w << np.uint64(nbits)
            pos += (63 - nbits) >> 3
            nbits |= 56
        else:
            while nbits <= 56:
                if pos < end:
                    buf |= np.uint64(src[pos]) << np.uint64(nbits)
                    pos += 1
                else:
                    virtual += 8
                nbits += 8
        for _ in range(4):
            if i + 3 <= k:
                ent = table[np.int64(buf & mask)]
                cnt = (ent >> 24) & 3
                n = ent >> 26
                for j in range(3):      # values past cnt are overwritten by the next lookup
                    e = (ent >> (8 * j)) & 0xFF
                    m = src[sm + i + j]
                    out[o + i + j] = ((np.uint16(m) & 0x80) << 8) | (np.uint16(e) << 7) | (m & 0x7F)
            else:                       # the last values: one code each, no bits past them
                ent = single[np.int64(buf & mask)]
                cnt = np.uint32(ent != 0)
                n = ent >> 8
                e = ent & 0xFF
                m = src[sm + i]
                out[o + i] = ((np.uint16(m) & 0x80) << 8) | (np.uint16(e) << 7) | (m & 0x7F)
            hole |= cnt == 0
            buf >>= np.uint64(n)
            nbits -= n
            i += cnt
            if i >= k or cnt == 0:
                break
        if hole:
            return BAD_STREAM
    if nbits < virtual:
        return BAD_STREAM        # codes used bits past the end of the stream
    return OK


@njit(cache=True, nogil=True)
def decode_blocks(src, kind, in_off, in_len, out, out_off, out_len, lo, hi, status):
    """Decode blocks ``lo..hi-1`` of a layer: block b reads ``in_len[b]`` bytes of ``src``
    at ``in_off[b]`` and writes ``out_len[b]`` bytes of ``out`` at ``out_off[b]`` (RAW: a
    copy; CODED: ``out_len[b] // 2`` BF16 values). ``status[b]`` gets OK or the reason it
    failed. Never reads or writes outside the given ranges, whatever the bytes say (a
    damaged block is refused by its checksum before it gets here, or fails here). Blocks
    are independent: any split of the range across threads gives the same bytes. Must
    not become: a decoder trusting the lengths table (a lying table over-fills the code
    space and decodes garbage) or reading past ``in_len`` on a short stream."""
    single = np.empty(TABLE, np.uint16)
    table = np.empty(TABLE, np.uint32)
    codes = np.empty(256, np.uint32)
    out16 = out[:out.shape[0] // 2 * 2].view(np.uint16)
    for b in range(lo, hi):
        a, n_in, o, n_out = in_off[b], in_len[b], out_off[b], out_len[b]
        if kind[b] == RAW:
            if n_in != n_out:
                status[b] = BAD_STREAM
                continue
            out[o:o + n_out] = src[a:a + n_in]
            status[b] = OK
        else:
            status[b] = _decode_coded(src, a, n_in, out16, o // 2, n_out // 2, single, table,
                                      codes)


BLOCK_VALUES = 1 << 17           # 256 KiB of output per block, as the chosen codec


class Encoded:
    def __init__(self, src, in_off, in_len, n):
        self.src, self.in_off, self.in_len = src, in_off, in_len
        self.stored = int(in_len.sum())
        nb = in_off.size
        self.kind = np.full(nb, CODED, np.uint8)
        self.out_off = np.arange(nb, dtype=np.int64) * 2 * BLOCK_VALUES
        self.out_len = np.minimum(2 * BLOCK_VALUES, 2 * n - self.out_off)


def encode_all(u16) -> Encoded:
    n = u16.size
    nb = -(-n // BLOCK_VALUES)
    buf = np.empty(nb * coded_bound(BLOCK_VALUES), np.uint8)
    in_off, in_len = np.zeros(nb, np.int64), np.zeros(nb, np.int64)
    codes, pos = np.zeros(256, np.uint32), 0
    for b in range(nb):
        blk = u16[b * BLOCK_VALUES:(b + 1) * BLOCK_VALUES]
        c = np.zeros(256, np.int64)
        exponent_counts(blk, c)
        lengths = code_lengths(c)
        canonical_codes(lengths, codes)
        k = encode_block(blk, lengths, codes, buf[pos:])
        in_off[b], in_len[b] = pos, k
        pos += k
    return Encoded(buf[:pos], in_off, in_len, n)


def decode_all(e: Encoded, out16, threads: int) -> None:
    out = out16.view(np.uint8)
    st = np.zeros(e.in_off.size, np.uint8)
    nb = e.in_off.size
    cuts = [nb * t // threads for t in range(threads + 1)]
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda r: decode_blocks(e.src, e.kind, e.in_off, e.in_len, out, e.out_off,
                                            e.out_len, r[0], r[1], st),
                    zip(cuts[:-1], cuts[1:])))
    assert not st.any()
