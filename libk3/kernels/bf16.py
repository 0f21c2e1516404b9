"""Dense matrix-vector and matrix-block products with BF16 (or float32) weights.

Owns: ``matvec`` (one token, decode) and ``matmul`` (a block of T tokens, prefill) for
every dense trunk matrix (model.md §5.5-§5.8, §7.1, §7.2). Does not own: the
summation order (``_dot.dot16``, formats/model/numerics.md section 2), MXFP4 experts
(``mxfp4.py``), any choice of which weights to multiply.

Weights stay BF16 in memory as raw uint16 bit patterns and are widened (bits << 16)
inside the dot product, two weights per 32-bit word (the even/odd form of ``_dot``), once
per chunk for up to four tokens; no float32 or float64 copy of W exists at any point
(model.md §7.1: the always-active set would double). The same compiled code accepts float32
weights (small matrices, conformance vectors, test oracles): the dtype of W selects the
widening at compile time.

Threads split output rows only, in groups of rows, and each row's arithmetic is identical
whichever group and thread it lands in: outputs are bit-identical at any thread count,
and ``matmul`` row t equals ``matvec`` of token t bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import team

from ._dot import (dot16, dot16_eo, dot16_rows3_t4, dot16_rows6_t2, dot16_rows12, finish16,
                   span_x4_t1, span_x4_t2, span_x4_t3, split16)
from ._simd import prefetch, vstore, vwiden

# Rows per task: four tokens go over four groups of three rows, two over two groups of six,
# one over all twelve; twelve rows (168 KB at K3's width) stay in L2 between the blocks of
# tokens, and the one-token kernel's twelve weight streams are what the memory system
# rewards (bench/README.md "Arithmetic").
ROWS = 12
# From this many tokens on, matmul widens spans of weights to float64 once into memory for
# all tokens (three tokens per widened load) instead: past that many tokens the
# activations the register path streams per row outgrow L2 (bench/README.md "Arithmetic").
WIDEN_ONCE_FROM = 16
# Columns of a block of rows widened at once, then applied to every token of the call;
# GROUPS four-row groups share each span of the tokens (their widened span, 16 KB, stays
# in L1 beside three tokens' span).
SPAN = 256
GROUPS = 2


@njit(cache=True)
def matvec(W, x, y):
    """y[o] = f32( sum_i widen(W[o, i]) * x[i] ), f64 sums in the dot16 order.

    W: [O, I] uint16 BF16 bits or float32, C-contiguous. x: [I] float32, C-contiguous.
    y: [O] float32, written. model.md §7.2 row 1. Must not become: an f32 accumulation, a
    float32 copy of W, a split of one row's sum across threads, or numpy's BLAS (whose
    summation order depends on the library and the thread count)."""
    O, I = W.shape
    if x.shape[0] != I or y.shape[0] != O:
        raise ValueError("matvec: W is [O, I], x must be [I] and y [O]")
    matmul(W, x.reshape(1, I), y.reshape(1, O))


@njit(cache=True)
def _task(W, XS, X, Y, o):
    """Rows o .. o + ROWS - 1 for every token: blocks of four tokens over four groups of
    three rows, then a pair over two groups of six, then a last token over all twelve."""
    T = X.shape[0]
    t = 0
    while T - t >= 4:
        for sub in range(0, ROWS, 3):
            s = dot16_rows3_t4(W, o + sub, XS, X, t)
            for k in range(12):
                Y[t + k % 4, o + sub + k // 4] = np.float32(s[k])
        t += 4
    if T - t >= 2:
        for sub in range(0, ROWS, 6):
            s = dot16_rows6_t2(W, o + sub, XS[t], X[t], XS[t + 1], X[t + 1])
            for k in range(12):
                Y[t + k // 6, o + sub + k % 6] = np.float32(s[k])
        t += 2
    if T - t == 1:
        s = dot16_rows12(W, o, XS[t], X[t])
        for k in range(12):
            Y[t, o + k] = np.float32(s[k])


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
    Each weight row is read from memory once for all T tokens; below WIDEN_ONCE_FROM
    tokens each 16-column chunk is widened once per four tokens, in registers, from there
    on once for all tokens, into memory (a SPAN at a time). Must not become: a blocked
    GEMM that splits the I-axis sum differently from ``matvec`` (prefill and decode would
    then disagree)."""
    O, I = W.shape
    T = X.shape[0]
    if X.shape[1] != I or Y.shape[0] != T or Y.shape[1] != O:
        raise ValueError("matmul: W is [O, I], X must be [T, I] and Y [T, O]")
    nt = team.narrow(W.nbytes * T)
    if T >= WIDEN_ONCE_FROM:
        groups = O // 4
        X64 = X.astype(np.float64).reshape(-1)
        for b in prange((groups + GROUPS - 1) // GROUPS):
            mg = min(GROUPS, groups - GROUPS * b)
            _rows_widened(W, X64, X, Y, GROUPS * b, mg, np.empty(4 * GROUPS * SPAN),
                          np.empty(64 * GROUPS * T))
        for o in range(4 * groups, O):         # the rows past the last four-row group
            for t in range(T):
                Y[t, o] = np.float32(dot16(W[o], X[t]))
    else:
        XS = np.empty((T, I))                  # each token's activations as split16 makes them
        for t in range(T):
            split16(X[t], XS[t])
        tasks = O // ROWS
        for g in prange(tasks + 1):
            if g < tasks:
                _task(W, XS, X, Y, ROWS * g)
            else:
                for o in range(ROWS * tasks, O):    # the rows past the last task, one by one
                    for t in range(T):
                        Y[t, o] = np.float32(dot16_eo(W[o], XS[t], X[t]))
    team.widen(nt)
