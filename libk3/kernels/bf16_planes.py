"""The coded block of the compressed trunk (formats/pack.md "Compressed trunk"): BF16
values as a sign+mantissa plane, a 4-bit exponent plane and a list of escapes, and back.

Owns: the byte-exact block kernels the trunk codec uses (the layout's constants are
``libk3.kernels.bf16_block``).
Does not own: which bytes form a block, checksums or error text
(``libk3.pack.codec``).

BF16 value v (uint16): sign v >> 15, exponent e = (v >> 7) & 0xff, mantissa v & 0x7f. A
coded block of k values is HEADER_BYTES of header (mode, base, two zero bytes, escape
count n as u32), then, in NIBBLE mode: the k sign+mantissa bytes ``(v >> 8 & 0x80) |
(v & 0x7f)``; ceil(k / 2) bytes of 4-bit codes (value 2j in the low half of byte j), code
d < 15 meaning e = base + d and ESCAPE meaning the exponent is in the escape list; n
escape positions (u32, increasing); their n exponent bytes. In VERBATIM mode (a block the
nibble form would not shrink) the k values follow as they are.
Why this code and not an entropy coder: trained weights' exponents sit in a window of
~15 values, so 4 bits hold nearly every exponent; decoding is branch-free and vectorises,
several times faster than zstd, so it keeps up with any disk for a few more stored bytes
(bench/README.md "Trunk compression" has the figures).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import bf16_block
from .bf16_block import (BAD_ESCAPE, BAD_HEADER, BAD_LENGTH, ESCAPE, HEADER_BYTES, MAX_BASE,
                         NIBBLE, OK, VERBATIM, WINDOW)

nibble_bytes = njit(cache=True, nogil=True)(bf16_block.nibble_bytes)
verbatim_bytes = njit(cache=True, nogil=True)(bf16_block.verbatim_bytes)


@njit(cache=True, nogil=True)
def encode_block(u16, out):
    """Write the coded block of ``u16`` (k values) to ``out`` (uint8, at least
    HEADER_BYTES + 2k bytes) and return its stored length. The window's base is the
    lowest that holds the most exponents, so the escapes are fewest."""
    k = u16.shape[0]
    hist = np.zeros(256, np.int64)
    for i in range(k):
        hist[(u16[i] >> 7) & 0xFF] += 1
    held, best, base = 0, -1, 0
    for e in range(256):
        held += hist[e]
        if e >= WINDOW:
            held -= hist[e - WINDOW]
        if held > best:                  # ties keep the lowest base
            best, base = held, max(e - (WINDOW - 1), 0)
    n = k - best
    out[:HEADER_BYTES] = 0
    if nibble_bytes(k, n) >= verbatim_bytes(k):
        out[0] = VERBATIM
        out[HEADER_BYTES:verbatim_bytes(k)] = u16.view(np.uint8)
        return verbatim_bytes(k)
    out[0], out[1] = NIBBLE, base
    for s in range(4):
        out[4 + s] = (n >> (8 * s)) & 0xFF
    sm, nib = HEADER_BYTES, HEADER_BYTES + k
    pos = nib + (k + 1) // 2
    esc = pos + 4 * n
    j = 0
    for i in range(k):
        v = u16[i]
        d = np.int64((v >> 7) & 0xFF) - base
        out[sm + i] = ((v >> 8) & 0x80) | (v & 0x7F)
        if d < 0 or d >= WINDOW:
            for s in range(4):
                out[pos + 4 * j + s] = (i >> (8 * s)) & 0xFF
            out[esc + j] = (v >> 7) & 0xFF
            j += 1
            d = ESCAPE
        if i & 1:
            out[nib + (i >> 1)] |= d << 4
        else:
            out[nib + (i >> 1)] = d
    return esc + n


@njit(cache=True, nogil=True)
def _merge_pairs(sm16, codes, out32, base):
    """Values 2j and 2j+1 from their sign+mantissa byte pair and their code byte; an
    escape's exponent comes out wrong here (masked to 8 bits, so never into the sign) and
    is patched after. Kept apart from the header and escapes so that LLVM vectorises it."""
    for j in range(codes.shape[0]):
        c = np.uint32(codes[j])
        m = np.uint32(sm16[j])
        e0, e1 = (base + (c & 15)) & 0xFF, (base + (c >> 4)) & 0xFF
        out32[j] = (((m & 0x80) << 8) | (e0 << 7) | (m & 0x7F)
                    | ((m & 0x8000) << 16) | (e1 << 23) | ((m & 0x7F00) << 8))


@njit(cache=True, nogil=True)
def _u32(b, at):
    return (np.int64(b[at]) | (np.int64(b[at + 1]) << 8) | (np.int64(b[at + 2]) << 16)
            | (np.int64(b[at + 3]) << 24))


@njit(cache=True, nogil=True)
def decode_block(blk, out):
    """Decode the coded block ``blk`` (uint8, exactly its stored bytes) into ``out``
    (uint8, 2k bytes: k values). Returns OK or the problem; never reads or writes outside
    the two arrays, whatever the bytes say."""
    k = out.shape[0] // 2
    if blk.shape[0] < HEADER_BYTES or blk[2] != 0 or blk[3] != 0:
        return BAD_HEADER
    mode, base, n = blk[0], blk[1], _u32(blk, 4)
    if mode == VERBATIM:
        if n != 0 or base != 0:
            return BAD_HEADER
        if blk.shape[0] != verbatim_bytes(k):
            return BAD_LENGTH
        out[:] = blk[HEADER_BYTES:]
        return OK
    if mode != NIBBLE or base > MAX_BASE or n > k:
        return BAD_HEADER
    if blk.shape[0] != nibble_bytes(k, n):
        return BAD_LENGTH
    sm, nib = HEADER_BYTES, HEADER_BYTES + k
    half = k // 2
    _merge_pairs(blk[sm:sm + 2 * half].view(np.uint16), blk[nib:nib + half],
                 out[:4 * half].view(np.uint32), np.uint32(base))
    out16 = out.view(np.uint16)
    if k & 1:
        m, c = np.uint16(blk[sm + k - 1]), np.uint16(blk[nib + half] & 15)
        out16[k - 1] = ((m & 0x80) << 8) | (((np.uint16(base) + c) & 0xFF) << 7) | (m & 0x7F)
    pos = nib + (k + 1) // 2
    esc = pos + 4 * n
    last = -1
    for j in range(n):
        i = _u32(blk, pos + 4 * j)
        if i <= last or i >= k or (blk[nib + (i >> 1)] >> (4 * (i & 1))) & 15 != ESCAPE:
            return BAD_ESCAPE
        last = i
        out16[i] = (out16[i] & 0x807F) | (np.uint16(blk[esc + j]) << 7)
    return OK


@njit(cache=True, nogil=True)
def decode_blocks(src, kind, in_off, in_len, out, out_off, out_len, lo, hi):
    """Decode blocks lo..hi-1: block b's stored bytes are ``src[in_off[b]:][:in_len[b]]``,
    its output ``out[out_off[b]:][:out_len[b]]``; kind 0 is copied as it is, kind 1
    decoded. Returns (first bad block, its status) or (-1, OK); stops at a bad block. The
    caller has checked that every span lies inside ``src`` and ``out``."""
    for b in range(lo, hi):
        s = src[in_off[b]:in_off[b] + in_len[b]]
        o = out[out_off[b]:out_off[b] + out_len[b]]
        if kind[b] == 0:
            if s.shape[0] != o.shape[0]:
                return b, BAD_LENGTH
            o[:] = s
            continue
        st = decode_block(s, o)
        if st != OK:
            return b, st
    return -1, OK
