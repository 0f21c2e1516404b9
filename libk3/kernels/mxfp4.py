"""Matrix-vector products straight from packed MXFP4 expert weights (spec K3-MODEL.md 4.2).

Owns: ``matvec`` (one token) and ``matmul`` (T tokens, bit-identical per token) over
``weight_packed`` [R, C/2] uint8 and ``weight_scale`` [R, C/32] uint8, without ever
materialising a float copy of the expert (an f32 expert is 132 MB; a token touches 1,472
of them). Does not own: the E2M1 table and the decode for the float64 reference and tests
(``libk3.io.mxfp4``; the pair table below is built from that table, so there is one
source of truth), expert I/O, routing.

Traps this module exists to get right: the LOW nibble is the EVEN element; scale byte
255 (NaN in the MX spec) makes its whole 32-group contribute nothing (the group is
skipped, so even an inf or NaN activation under it is ignored); the exponent bias is 127.

Order (formats/numerics.md section 3): per 32-group, 8 f64 partial sums s_0..s_7 start
at +0.0 and element j of the group goes to s_(j mod 8) in increasing j; the group sum is
((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)); it is multiplied by 2^(s - 127)
(exact) and added to the row sum in increasing group order; one rounding to f32. E2M1
values times f32 activations are exact in f64, so only these additions round. This is
the order of the public C engine (spec PRIOR-ART.md section 10).

WHY scalar code with a byte -> (low, high) table: a byte gives both of its E2M1 values
with one table load. An 8-lane vector decode (shifts, selects, int -> f64) measured no
faster on the dev machine (both about 6.5 GFLOP/s per core on 3072 x 3584; the loop is
bound by loads, not arithmetic), so the simpler form stays.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..io.mxfp4 import E2M1, SCALE_NAN


def _pair_table() -> np.ndarray:
    """[256, 2] float64: (E2M1[byte & 15], E2M1[byte >> 4]) = (even, odd) element."""
    b = np.arange(256)
    return np.stack([E2M1[b & 15], E2M1[b >> 4]], axis=1).astype(np.float64)


def _scale_table() -> np.ndarray:
    """[256] float64: 2^(s - 127); entry 255 is never read (the group is skipped)."""
    s = np.arange(256)
    return np.where(s == SCALE_NAN, 0.0, np.ldexp(1.0, s - 127))


# Frozen into the compiled code as constants (numba reads module arrays at compile time).
E2M1_PAIRS = _pair_table()
POW2 = _scale_table()
_NAN_SCALE = np.uint8(SCALE_NAN)


@njit(cache=True, inline="always")
def _row_dot(p, s, x):
    """float64 sum over one packed row. p: [C/2] uint8, s: [C/32] uint8, x: [C] float64."""
    acc = 0.0
    for g in range(s.shape[0]):
        sg = s[g]
        if sg == _NAN_SCALE:
            continue
        q = 16 * g
        j = 32 * g
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
        for c in range(4):
            b0 = p[q]
            b1 = p[q + 1]
            b2 = p[q + 2]
            b3 = p[q + 3]
            s0 += E2M1_PAIRS[b0, 0] * x[j]
            s1 += E2M1_PAIRS[b0, 1] * x[j + 1]
            s2 += E2M1_PAIRS[b1, 0] * x[j + 2]
            s3 += E2M1_PAIRS[b1, 1] * x[j + 3]
            s4 += E2M1_PAIRS[b2, 0] * x[j + 4]
            s5 += E2M1_PAIRS[b2, 1] * x[j + 5]
            s6 += E2M1_PAIRS[b3, 0] * x[j + 6]
            s7 += E2M1_PAIRS[b3, 1] * x[j + 7]
            q += 4
            j += 8
        acc += (((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7))) * POW2[sg]
    return acc


@njit(cache=True, inline="always")
def _check(packed, scales, C):
    R = packed.shape[0]
    if C % 32 != 0 or packed.shape[1] * 2 != C or scales.shape[0] != R or scales.shape[1] * 32 != C:
        raise ValueError("mxfp4: packed must be [R, C/2] and scales [R, C/32] with C % 32 == 0")


@njit(cache=True, parallel=True)
def matvec(packed, scales, x, y):
    """y[r] = f32( sum_g 2^(scales[r,g]-127) * sum_{j in g} E2M1(nibble(r, j)) * x[j] ).

    packed: [R, C/2] uint8 (low nibble = even j). scales: [R, C/32] uint8 (E8M0; 255 =
    group contributes nothing). x: [C] float32. y: [R] float32, written. Spec 4.2, 7.2.
    Must not become: a nibble swap (same statistics, wrong positions), a decode of the
    whole expert to float, an f32 group sum, or a 0 * NaN from a 255 group."""
    R = packed.shape[0]
    C = x.shape[0]
    _check(packed, scales, C)
    if y.shape[0] != R:
        raise ValueError("mxfp4.matvec: y must be [R]")
    x64 = x.astype(np.float64)
    for r in prange(R):
        y[r] = np.float32(_row_dot(packed[r], scales[r], x64))


@njit(cache=True, parallel=True)
def matmul(packed, scales, X, Y):
    """Y[t] = matvec(packed, scales, X[t]) bit for bit, for X [T, C] and Y [T, R] float32.
    Each packed row is read once for all T tokens."""
    R = packed.shape[0]
    T, C = X.shape
    _check(packed, scales, C)
    if Y.shape[0] != T or Y.shape[1] != R:
        raise ValueError("mxfp4.matmul: Y must be [T, R]")
    X64 = X.astype(np.float64)
    for r in prange(R):
        for t in range(T):
            Y[t, r] = np.float32(_row_dot(packed[r], scales[r], X64[t]))
