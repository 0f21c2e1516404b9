"""Dense matrix-vector and matrix-block products with BF16 (or float32) weights.

Owns: ``matvec`` (one token, decode) and ``matmul`` (a block of T tokens, prefill) for
every dense trunk matrix (model.md §5.5-§5.8, §7.1, §7.2). Does not own: the
summation order (``_dot.dot16``, formats/model/numerics.md section 2), MXFP4 experts
(``mxfp4.py``), any choice of which weights to multiply.

Weights stay BF16 in memory as raw uint16 bit patterns and are widened (bits << 16)
eight at a time inside the dot product; no float32 copy of W exists at any point
(model.md §7.1: the always-active set would double). The same compiled code accepts float32
weights (small matrices, conformance vectors, test oracles): the dtype of W selects the
widening at compile time.

Threads split output rows only, in groups of four rows (``dot16_x4``), and each row's
arithmetic is identical whichever group and thread it lands in: outputs are bit-identical
at any thread count, and ``matmul`` row t equals ``matvec`` of token t bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import team

from ._dot import (dot16, dot16_x4, dot16_x4_t2, finish16, span_x4_t1, span_x4_t2,
                   span_x4_t3)
from ._simd import prefetch, vstore, vwiden

# Columns of a block of rows widened to float64 at once, then applied to every token of
# the call; GROUPS four-row groups share each span of the tokens (their widened span,
# 16 KB, stays in L1 beside three tokens' span; bench/README.md "Arithmetic").
SPAN = 256
GROUPS = 2
# From this many tokens on, matmul widens each weight once for all of them.
WIDEN_ONCE_FROM = 3


@njit(cache=True, parallel=True)
def matvec(W, x, y):
    """y[o] = f32( sum_i widen(W[o, i]) * x[i] ), f64 sums in the dot16 order.

    W: [O, I] uint16 BF16 bits or float32, C-contiguous. x: [I] float32, C-contiguous.
    y: [O] float32, written. model.md §7.2 row 1. Must not become: an f32 accumulation, a
    float32 copy of W, a split of one row's sum across threads, or numpy's BLAS (whose
    summation order depends on the library and the thread count)."""
    O, I = W.shape
    if x.shape[0] != I or y.shape[0] != O:
        raise ValueError("matvec: W is [O, I], x must be [I] and y [O]")
    groups = O // 4
    nt = team.narrow(W.nbytes)
    for g in prange(groups + 1):
        if g < groups:
            o = 4 * g
            a, b, c, d = dot16_x4(W[o], W[o + 1], W[o + 2], W[o + 3], x)
            y[o] = np.float32(a)
            y[o + 1] = np.float32(b)
            y[o + 2] = np.float32(c)
            y[o + 3] = np.float32(d)
        else:
            for o in range(4 * groups, O):
                y[o] = np.float32(dot16(W[o], x))
    team.widen(nt)


@njit(cache=True, inline="always")
def _rows_widened(W, X64, Xf, Y, g0, mg, Wb, acc):
    """Rows 4 * g0 .. 4 * (g0 + mg) - 1 (mg four-row groups) for every token: each SPAN of
    these rows is widened to float64 once into Wb and applied to all tokens, three at a
    time (the last block two or one) and every four-row group in turn (the tokens' SPAN
    stays in L1 across the groups); lane vectors wait in acc between spans, those of
    token t0 + u of the block starting at t0, group m, row r at 64 * (t0 * mg + m * k + u)
    + 16 * r (k: the block's tokens); then the reduction and the tail of ``dot16`` per
    (token, row)."""
    T, I = Xf.shape
    n16 = I - I % 16
    acc[:] = 0.0
    for k0 in range(0, n16, SPAN):
        n = min(SPAN, n16 - k0)
        for r in range(4 * mg):
            row = W[4 * g0 + r]
            for i in range(0, n, 8):
                vstore(Wb, r * SPAN + i, vwiden(row, k0 + i))
            for i in range(0, SPAN, 64 // row.itemsize):   # next span's lines, ahead of use
                prefetch(row, k0 + SPAN + i)
        for t0 in range(0, T, 3):
            k = min(3, T - t0)
            for m in range(mg):
                wm = Wb[4 * m * SPAN:]
                at = 64 * (t0 * mg + m * k)
                if k == 3:
                    span_x4_t3(wm, SPAN, X64, t0 * I + k0, (t0 + 1) * I + k0,
                               (t0 + 2) * I + k0, n, acc, at)
                elif k == 2:
                    span_x4_t2(wm, SPAN, X64, t0 * I + k0, (t0 + 1) * I + k0, n, acc, at)
                else:
                    span_x4_t1(wm, SPAN, X64, t0 * I + k0, n, acc, at)
    for t in range(T):
        t0 = t - t % 3
        k = min(3, T - t0)
        for r in range(4 * mg):
            at = 64 * (t0 * mg + (r // 4) * k + t % 3) + 16 * (r % 4)
            o = 4 * g0 + r
            Y[t, o] = np.float32(finish16(acc, at, W[o], Xf[t], n16, I))


@njit(cache=True, parallel=True)
def matmul(W, X, Y):
    """Y[t, o] = matvec(W, X[t])[o] for every token t, bit for bit.

    W: [O, I] uint16 BF16 bits or float32. X: [T, I] float32. Y: [T, O] float32, written.
    Each group of four weight rows is read from memory once for all T tokens; from
    WIDEN_ONCE_FROM tokens on it is also widened once (a SPAN of columns at a time), not
    once per pair of tokens. Must not become: a blocked GEMM that splits the I-axis sum
    differently from ``matvec`` (prefill and decode would then disagree)."""
    O, I = W.shape
    T = X.shape[0]
    if X.shape[1] != I or Y.shape[0] != T or Y.shape[1] != O:
        raise ValueError("matmul: W is [O, I], X must be [T, I] and Y [T, O]")
    groups = O // 4
    nt = team.narrow(W.nbytes * T)
    first = 0                                  # the first four-row group the pair path takes
    if T >= WIDEN_ONCE_FROM:
        X64 = X.astype(np.float64).reshape(-1)
        for b in prange((groups + GROUPS - 1) // GROUPS):
            mg = min(GROUPS, groups - GROUPS * b)
            _rows_widened(W, X64, X, Y, GROUPS * b, mg, np.empty(4 * GROUPS * SPAN),
                          np.empty(64 * GROUPS * T))
        first = groups                         # only the rows past the last group are left
    for g in prange(first, groups + 1):
        if g < groups:
            o = 4 * g
            for t in range(0, T - 1, 2):
                a0, a1, a2, a3, b0, b1, b2, b3 = dot16_x4_t2(W[o], W[o + 1], W[o + 2],
                                                             W[o + 3], X[t], X[t + 1])
                Y[t, o] = np.float32(a0)
                Y[t, o + 1] = np.float32(a1)
                Y[t, o + 2] = np.float32(a2)
                Y[t, o + 3] = np.float32(a3)
                Y[t + 1, o] = np.float32(b0)
                Y[t + 1, o + 1] = np.float32(b1)
                Y[t + 1, o + 2] = np.float32(b2)
                Y[t + 1, o + 3] = np.float32(b3)
            if T % 2:
                t = T - 1
                a, b, c, d = dot16_x4(W[o], W[o + 1], W[o + 2], W[o + 3], X[t])
                Y[t, o] = np.float32(a)
                Y[t, o + 1] = np.float32(b)
                Y[t, o + 2] = np.float32(c)
                Y[t, o + 3] = np.float32(d)
        else:
            for o in range(4 * groups, O):
                for t in range(T):
                    Y[t, o] = np.float32(dot16(W[o], X[t]))
    team.widen(nt)
