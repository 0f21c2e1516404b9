"""Matrix-vector products straight from packed MXFP4 expert weights (model.md §4.2).

Owns: ``matvec`` (one token) and ``matmul`` (T tokens, bit-identical per token) over
``weight_packed`` [R, C/2] uint8 and ``weight_scale`` [R, C/32] uint8, without ever
materialising a float copy of the expert (an f32 expert is 132 MB; a token touches 1,472
of them). Does not own: the E2M1 table and the decode for the float64 reference and tests
(``libk3.io.mxfp4``; the pair table below is built from that table, so there is one
source of truth), expert I/O, routing.

Traps this module exists to get right: the LOW nibble is the EVEN element; scale byte
255 (NaN in the MX spec) makes its whole 32-group contribute nothing (the group is
never added, so even an inf or NaN activation under it is ignored); the exponent bias
is 127.

Order (formats/model/numerics.md section 3): per 32-group, 8 f64 partial sums s_0..s_7 start
at +0.0 and element j of the group goes to s_(j mod 8) in increasing j; the group sum is
((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)); it is multiplied by 2^(s - 127)
(exact) and added to the row sum in increasing group order; one rounding to f32. Rows
are processed two at a time sharing the x loads; each row's arithmetic is unchanged. E2M1
values times f32 activations are exact in f64, so only these additions round. This is
the order the public C engine documents (model.md §7.2).

WHY a vector decode: the scalar table decode (a byte -> (low, high) pair, eight f64 lanes
as scalars) is bound by loads, and decoding a whole group at once (on AVX-512 a 16-entry
float64 table permute per eight nibbles; elsewhere 16 bytes -> nibbles -> one 16-entry
int8 byte shuffle per nibble half -> f64 lanes; then four fused multiply-adds into the
eight lanes of section 3) is faster with the same sums (bench/README.md, "Arithmetic").
The table holds 2 * E2M1 (all integers) and the group sum is scaled by 2^(s - 128):
doubling is exact in f64 for any f32 activation, so every rounding lands on the same real
number as the scalar path's. The scalar ``_row_dot2`` stays as the path for CPUs without
SSSE3 and as the test oracle of the vector one.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import team
from ._mxfp4_tile import (HAVE_PSHUFB, decode_to, group_sum_x2, lanes_pair, tile_4x4, tile_8x1,
                          tile_8x2)
from ._simd import vlane, vload, vstore, vzero
from ..config import MXFP4_GROUP
from ..io.mxfp4 import E2M1, SCALE_NAN


def _pair_table() -> np.ndarray:
    """[256, 2] float64: (E2M1[byte & 15], E2M1[byte >> 4]) = (even, odd) element."""
    b = np.arange(256)
    return np.stack([E2M1[b & 15], E2M1[b >> 4]], axis=1).astype(np.float64)


def _scale_table() -> np.ndarray:
    """[256] float64: 2^(s - 127); entry 255 is never read (the group is skipped)."""
    s = np.arange(256)
    return np.where(s == SCALE_NAN, 0.0, np.ldexp(1.0, s - 127))


# Groups of a block's eight rows decoded at once for all its token blocks (8 x 4 x 32
# float64: 8 KB of L1 beside one token block's activations; bench/README.md "Arithmetic").
CHUNK = 4
# From this many tokens past a multiple of eight, they take a padded block of lanes (its
# unused lanes cost less than the tiles would; bench/README.md "Arithmetic").
PAD_FROM = 7

# Frozen into the compiled code as constants (numba reads module arrays at compile time).
E2M1_PAIRS = _pair_table()
POW2 = _scale_table()
POW2_HALF = POW2 * 0.5        # 2^(s - 128): the scale of the doubled E2M1 values below
_NAN_SCALE = np.uint8(SCALE_NAN)

@njit(cache=True, inline="always")
def _row_dot2_vec(pa, sa, pb, sb, x):
    """``_row_dot2`` bit for bit through the vector decode: each doubled group sum is
    scaled by 2^(s - 128) instead of 2^(s - 127), the same real number, so the same
    rounding."""
    acc_a = 0.0
    acc_b = 0.0
    for g in range(sa.shape[0]):
        ga = group_sum_x2(pa, 16 * g, x, 32 * g)
        gb = group_sum_x2(pb, 16 * g, x, 32 * g)
        if sa[g] != _NAN_SCALE:
            acc_a += ga * POW2_HALF[sa[g]]
        if sb[g] != _NAN_SCALE:
            acc_b += gb * POW2_HALF[sb[g]]
    return acc_a, acc_b


@njit(cache=True, inline="always")
def _row_dot2(pa, sa, pb, sb, x):
    """float64 sums of two packed rows a and b against one x (each row in the order of
    section 3 of formats/model/numerics.md, independently of the other row).

    pa, pb: [C/2] uint8; sa, sb: [C/32] uint8; x: [C] float64. Two rows per pass share
    every x load (the loop is bound by loads)."""
    acc_a = 0.0
    acc_b = 0.0
    for g in range(sa.shape[0]):
        q = 16 * g
        j = 32 * g
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
        b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = 0.0
        for c in range(4):
            x0 = x[j]
            x1 = x[j + 1]
            x2 = x[j + 2]
            x3 = x[j + 3]
            x4 = x[j + 4]
            x5 = x[j + 5]
            x6 = x[j + 6]
            x7 = x[j + 7]
            u0 = pa[q]
            u1 = pa[q + 1]
            u2 = pa[q + 2]
            u3 = pa[q + 3]
            a0 += E2M1_PAIRS[u0, 0] * x0
            a1 += E2M1_PAIRS[u0, 1] * x1
            a2 += E2M1_PAIRS[u1, 0] * x2
            a3 += E2M1_PAIRS[u1, 1] * x3
            a4 += E2M1_PAIRS[u2, 0] * x4
            a5 += E2M1_PAIRS[u2, 1] * x5
            a6 += E2M1_PAIRS[u3, 0] * x6
            a7 += E2M1_PAIRS[u3, 1] * x7
            u0 = pb[q]
            u1 = pb[q + 1]
            u2 = pb[q + 2]
            u3 = pb[q + 3]
            b0 += E2M1_PAIRS[u0, 0] * x0
            b1 += E2M1_PAIRS[u0, 1] * x1
            b2 += E2M1_PAIRS[u1, 0] * x2
            b3 += E2M1_PAIRS[u1, 1] * x3
            b4 += E2M1_PAIRS[u2, 0] * x4
            b5 += E2M1_PAIRS[u2, 1] * x5
            b6 += E2M1_PAIRS[u3, 0] * x6
            b7 += E2M1_PAIRS[u3, 1] * x7
            q += 4
            j += 8
        # a 255 group was multiplied (possibly into NaN) but is never added
        if sa[g] != _NAN_SCALE:
            acc_a += (((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7))) * POW2[sa[g]]
        if sb[g] != _NAN_SCALE:
            acc_b += (((b0 + b4) + (b1 + b5)) + ((b2 + b6) + (b3 + b7))) * POW2[sb[g]]
    return acc_a, acc_b


# The row pair used by matvec and matmul (resolved when they compile).
_row_pair = _row_dot2_vec if HAVE_PSHUFB else _row_dot2


@njit(cache=True, inline="always")
def _check(packed, scales, C):
    # the unrolled loops of _row_dot2 assume MXFP4_GROUP == 32 (model.md §4.2)
    R = packed.shape[0]
    if C % MXFP4_GROUP != 0 or packed.shape[1] * 2 != C or scales.shape[0] != R \
            or scales.shape[1] * MXFP4_GROUP != C:
        raise ValueError("mxfp4: packed must be [R, C/2] and scales [R, C/32] with C % 32 == 0")


@njit(cache=True, inline="always")
def _store(acc, Y, t0, r0, tt):
    """Lane l of a tile (row r0 + l // tt, token t0 + l % tt) rounded once into Y."""
    for lane in range(8):
        Y[t0 + lane % tt, r0 + lane // tt] = np.float32(vlane(acc, lane))


@njit(cache=True, inline="always")
def _block_lanes(P, S, XT, Y, r0, C, Wd, acc):
    """Rows r0 .. r0 + 7 for the first 8 * nb tokens (nb blocks of eight, XT token-minor:
    ``_token_minor``) into Y [T, R]: CHUNK groups of the eight rows decoded once into Wd,
    then applied to every token block, two rows at a time with the tokens in the lanes;
    the row sums wait in acc (8 rows x nb blocks x 8 lanes) between chunks."""
    G = C // MXFP4_GROUP
    half = C // 2
    nb = acc.shape[0] // 64
    acc[:] = 0.0
    for g0 in range(0, G, CHUNK):
        ng = min(CHUNK, G - g0)
        for r in range(8):
            for k in range(ng):
                decode_to(P, (r0 + r) * half + 16 * (g0 + k), Wd, (r * CHUNK + k) * 32)
        for b in range(nb):
            for ra in range(0, 8, 2):
                ia, ib = (ra * nb + b) * 8, ((ra + 1) * nb + b) * 8
                a = (vload(acc, ia), vload(acc, ib))
                for k in range(ng):
                    g = g0 + k
                    a = lanes_pair(a, Wd, (ra * CHUNK + k) * 32, ((ra + 1) * CHUNK + k) * 32,
                                   S, (r0 + ra) * G + g, (r0 + ra + 1) * G + g,
                                   XT, (b * C + 32 * g) * 8)
                vstore(acc, ia, a[0])
                vstore(acc, ib, a[1])
    T = Y.shape[0]
    for r in range(8):
        for b in range(nb):
            for lane in range(min(8, T - 8 * b)):      # a padded last block's extra lanes
                Y[8 * b + lane, r0 + r] = np.float32(acc[(r * nb + b) * 8 + lane])


@njit(cache=True, inline="always")
def _block_tiles(P, S, X, Y, r0, C, t):
    """Rows r0 .. r0 + 7 for tokens t .. T - 1 (fewer than eight) in tiles of 4x4, 8x2
    and 8x1 rows x tokens, X float64 flat [T * C]."""
    T = Y.shape[0]
    G = C // MXFP4_GROUP
    half = C // 2
    if T - t >= 4:
        for ri in range(0, 8, 4):
            r = r0 + ri
            acc = (vzero(), vzero())
            for g in range(G):
                acc = tile_4x4(acc, P, r * half + 16 * g, half, S, r * G + g, G,
                               X, t * C + 32 * g, C)
            _store(acc[0], Y, t, r, 4)
            _store(acc[1], Y, t, r + 2, 4)
        t += 4
    if T - t >= 2:
        acc = (vzero(), vzero())
        for g in range(G):
            acc = tile_8x2(acc, P, r0 * half + 16 * g, half, S, r0 * G + g, G,
                           X, t * C + 32 * g, C)
        _store(acc[0], Y, t, r0, 2)
        _store(acc[1], Y, t, r0 + 4, 2)
        t += 2
    if T - t >= 1:
        acc = vzero()
        for g in range(G):
            acc = tile_8x1(acc, P, r0 * half + 16 * g, half, S, r0 * G + g, G,
                           X, t * C + 32 * g, C)
        _store(acc, Y, t, r0, 1)


@njit(cache=True)
def _token_minor(X64, nb):
    """The first 8 * nb tokens of X64 [T, C] as nb blocks of [C, 8]: element (t, j) of
    block b at (b * C + j) * 8 + t, so one load gives column j of eight tokens; lanes
    past T (a padded last block) hold +0.0."""
    T, C = X64.shape
    XT = np.zeros(nb * C * 8)
    for b in range(nb):
        for j in range(C):
            for k in range(min(8, T - 8 * b)):
                XT[(b * C + j) * 8 + k] = X64[8 * b + k, j]
    return XT


@njit(cache=True, inline="always")
def _rows_one_by_one(packed, scales, X64, Y, r_lo, R):
    """Rows r_lo .. R - 1 (the rows no tile covers, or every row without SSSE3), two at a
    time, token by token."""
    for a in range(r_lo, R, 2):
        b = min(a + 1, R - 1)             # an odd last row is paired with itself
        for t in range(Y.shape[0]):
            ya, yb = _row_pair(packed[a], scales[a], packed[b], scales[b], X64[t])
            Y[t, a] = np.float32(ya)
            Y[t, b] = np.float32(yb)


@njit(cache=True, parallel=True)
def _matmul_into(packed, scales, X64, Y):
    """Y [T, R] from X64 [T, C] (float64): blocks of eight rows across threads; in each,
    the tokens eight at a time in the lanes (``_block_lanes``), the rest in tiles."""
    R = packed.shape[0]
    T, C = X64.shape
    blocks = R // 8 if HAVE_PSHUFB else 0
    P = packed.reshape(-1)
    S = scales.reshape(-1)
    X = X64.reshape(-1)
    nb = (T // 8 + (T % 8 >= PAD_FROM)) if blocks else 0
    XT = _token_minor(X64, nb)
    nt = team.narrow(packed.nbytes * 2 * T)
    for b in prange(blocks + 1):
        if b < blocks:
            if nb:
                _block_lanes(P, S, XT, Y, 8 * b, C, np.empty(8 * CHUNK * 32), np.empty(64 * nb))
            _block_tiles(P, S, X, Y, 8 * b, C, min(8 * nb, T))
        else:
            _rows_one_by_one(packed, scales, X64, Y, 8 * blocks, R)
    team.widen(nt)


@njit(cache=True)
def matvec(packed, scales, x, y):
    """y[r] = f32( sum_g 2^(scales[r,g]-127) * sum_{j in g} E2M1(nibble(r, j)) * x[j] ).

    packed: [R, C/2] uint8 (low nibble = even j). scales: [R, C/32] uint8 (E8M0; 255 =
    group contributes nothing). x: [C] float32. y: [R] float32, written. model.md §4.2, §7.2.
    Must not become: a nibble swap (same statistics, wrong positions), a decode of the
    whole expert to float, an f32 group sum, or a 0 * NaN from a 255 group."""
    R = packed.shape[0]
    C = x.shape[0]
    _check(packed, scales, C)
    if y.shape[0] != R:
        raise ValueError("mxfp4.matvec: y must be [R]")
    _matmul_into(packed, scales, x.astype(np.float64).reshape(1, C), y.reshape(1, R))


@njit(cache=True)
def matmul(packed, scales, X, Y):
    """Y[t] = matvec(packed, scales, X[t]) bit for bit, for X [T, C] and Y [T, R] float32.
    Each group of a packed row is decoded once per tile and applied to all its tokens
    (prefill, lockstep widths, verify blocks: the tokens routed to one expert)."""
    R = packed.shape[0]
    T, C = X.shape
    _check(packed, scales, C)
    if Y.shape[0] != T or Y.shape[1] != R:
        raise ValueError("mxfp4.matmul: Y must be [T, R]")
    _matmul_into(packed, scales, np.ascontiguousarray(X).astype(np.float64), Y)
