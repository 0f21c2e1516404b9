"""The one fixed-order float64 dot product behind every k3 matrix-vector product.

Owns: ``dot16`` (one row), ``dot16_x4`` (four rows sharing the activation loads), the
even/odd forms for BF16 weights against float64 activations regrouped by ``split16``
(``dot16_eo``; ``dot16_rows12``: twelve rows, one token; ``dot16_rows6_t2``: six rows,
two tokens; ``dot16_rows3_t4``: three rows, four tokens), the span steps of the
widen-once product (``span_x4_t3``/``_t2``/``_t1``: four rows times three, two or one
tokens over a column span of weights widened once, ``finish16``), the summation order of
formats/model/numerics.md section 2. It follows the order the public C engine documents
(model.md §7.2; "remainder added sequentially" read as: after the reduction), so k3's
BF16/F32 matvecs should match it bit for bit (not checked: no C engine output is
available here):

* 16 f64 partial sums a_0..a_15 start at +0.0; element i < 16*floor(n/16) is added to
  a_(i mod 16), in increasing i (so each a_l is a sequential sum);
* b_l = (a_l + a_(l+4)) + (a_(l+8) + a_(l+12)) for l = 0..3; s = (b0 + b1) + (b2 + b3);
* the remaining n mod 16 elements are added to s one by one, in increasing i;
* the caller rounds s to float32 once.

Does not own: widening (``_simd``), threading (callers ``prange`` over rows only, so a
row's result never depends on the thread count or on which rows share a ``dot16_x4``).

Every product is exact in f64 (BF16 x f32: 8 + 24 significant bits; f32 x f32: 48), so the
only roundings are the additions listed above. ``dot16_x4`` performs, for each of its
rows, exactly the operations ``dot16`` performs; it exists to keep eight independent
vector chains in flight. The even/odd forms hold a_0, a_2, .., a_14 in one vector and
a_1, .., a_15 in the other: each a_l still gets its elements in increasing i, and the
reduction names the same a_l (``_reduce_eo``); they widen two BF16 weights per 32-bit
word without a zero-extension, in registers, once for up to four tokens
(bench/README.md, "Arithmetic").
"""

from __future__ import annotations

from numba import njit

from ._simd import vfma, vfma_even, vfma_odd, vlane, vload, vstore, vzero, widen_f64


@njit(cache=True, inline="always")
def _reduce16(lo, hi):
    """(lanes 0..7, lanes 8..15) -> ((b0 + b1) + (b2 + b3)), b_l as in the module doc."""
    b0 = (vlane(lo, 0) + vlane(lo, 4)) + (vlane(hi, 0) + vlane(hi, 4))
    b1 = (vlane(lo, 1) + vlane(lo, 5)) + (vlane(hi, 1) + vlane(hi, 5))
    b2 = (vlane(lo, 2) + vlane(lo, 6)) + (vlane(hi, 2) + vlane(hi, 6))
    b3 = (vlane(lo, 3) + vlane(lo, 7)) + (vlane(hi, 3) + vlane(hi, 7))
    return (b0 + b1) + (b2 + b3)


@njit(cache=True, inline="always")
def _tail(s, w, x, start, n):
    """s + sum of w[i] * x[i] for i = start..n-1, added one by one."""
    for i in range(start, n):
        s += widen_f64(w[i]) * widen_f64(x[i])
    return s


@njit(cache=True, inline="always")
def dot16(w, x):
    """float64 sum_i widen(w[i]) * x[i] in the fixed 16-lane order (not rounded).

    w: [n] uint16 BF16 bits or float32, C-contiguous; x: [n] float32, C-contiguous,
    len(x) >= len(w) = n. Either may also be float64 holding exactly widened f32/BF16
    values (a reused operand widened once: MLA queries). Must not become: a reduction whose grouping
    depends on n's alignment, the thread count, or numba's vectoriser."""
    n = w.shape[0]
    n16 = n - n % 16
    lo = vzero()
    hi = vzero()
    for i in range(0, n16, 16):
        lo = vfma(lo, w, i, x, i)
        hi = vfma(hi, w, i + 8, x, i + 8)
    return _tail(_reduce16(lo, hi), w, x, n16, n)


@njit(cache=True, inline="always")
def dot16_x4(w0, w1, w2, w3, x):
    """(dot16(w0, x), dot16(w1, x), dot16(w2, x), dot16(w3, x)), bit for bit, in one pass
    over x. All four rows have the same length n."""
    n = w0.shape[0]
    n16 = n - n % 16
    l0 = vzero()
    h0 = vzero()
    l1 = vzero()
    h1 = vzero()
    l2 = vzero()
    h2 = vzero()
    l3 = vzero()
    h3 = vzero()
    for i in range(0, n16, 16):
        l0 = vfma(l0, w0, i, x, i)
        h0 = vfma(h0, w0, i + 8, x, i + 8)
        l1 = vfma(l1, w1, i, x, i)
        h1 = vfma(h1, w1, i + 8, x, i + 8)
        l2 = vfma(l2, w2, i, x, i)
        h2 = vfma(h2, w2, i + 8, x, i + 8)
        l3 = vfma(l3, w3, i, x, i)
        h3 = vfma(h3, w3, i + 8, x, i + 8)
    return (_tail(_reduce16(l0, h0), w0, x, n16, n),
            _tail(_reduce16(l1, h1), w1, x, n16, n),
            _tail(_reduce16(l2, h2), w2, x, n16, n),
            _tail(_reduce16(l3, h3), w3, x, n16, n))


@njit(cache=True)
def split16(x, xs):
    """xs[i + k] = x[i + 2k] and xs[i + 8 + k] = x[i + 2k + 1] (k = 0..7) as float64 for
    every whole 16-column chunk at i: the activations of the even/odd products, made once
    per token and call. Columns past the last whole chunk are left alone (the tail uses x)."""
    n16 = x.shape[0] - x.shape[0] % 16
    for i in range(0, n16, 16):
        for k in range(8):
            xs[i + k] = x[i + 2 * k]
            xs[i + 8 + k] = x[i + 2 * k + 1]


@njit(cache=True, inline="always")
def _reduce_eo(e, o):
    """``_reduce16`` for lane vectors held even/odd: lane k of e is a_(2k), of o a_(2k+1)."""
    b0 = (vlane(e, 0) + vlane(e, 2)) + (vlane(e, 4) + vlane(e, 6))
    b1 = (vlane(o, 0) + vlane(o, 2)) + (vlane(o, 4) + vlane(o, 6))
    b2 = (vlane(e, 1) + vlane(e, 3)) + (vlane(e, 5) + vlane(e, 7))
    b3 = (vlane(o, 1) + vlane(o, 3)) + (vlane(o, 5) + vlane(o, 7))
    return (b0 + b1) + (b2 + b3)


@njit(cache=True, inline="always")
def _eo_pair(e0, o0, w0, xs0, e1, o1, w1, xs1, i):
    """One 16-column chunk at i of two (row, token) pairs' even/odd lane vectors: row w0
    against token xs0, row w1 against token xs1 (two rows of one token, or one row of two)."""
    return (vfma_even(e0, w0, i, xs0, i), vfma_odd(o0, w0, i, xs0, i + 8),
            vfma_even(e1, w1, i, xs1, i), vfma_odd(o1, w1, i, xs1, i + 8))


@njit(cache=True, inline="always")
def dot16_eo(w, xs, x):
    """``dot16(w, x)`` bit for bit, from xs = ``split16(x)`` (w: uint16 BF16 bits or
    float32)."""
    n = w.shape[0]
    n16 = n - n % 16
    e = vzero()
    o = vzero()
    for i in range(0, n16, 16):
        e = vfma_even(e, w, i, xs, i)
        o = vfma_odd(o, w, i, xs, i + 8)
    return _tail(_reduce_eo(e, o), w, x, n16, n)


@njit(cache=True, inline="always")
def dot16_rows12(W, r, xs, x):
    """(dot16(W[r], x), .., dot16(W[r + 11], x)) bit for bit, in one pass over xs =
    ``split16(x)``: twelve rows' 24 lane vectors stay in registers."""
    n = W.shape[1]
    n16 = n - n % 16
    w0, w1, w2, w3 = W[r], W[r + 1], W[r + 2], W[r + 3]
    w4, w5, w6, w7 = W[r + 4], W[r + 5], W[r + 6], W[r + 7]
    w8, w9, w10, w11 = W[r + 8], W[r + 9], W[r + 10], W[r + 11]
    e0 = o0 = e1 = o1 = e2 = o2 = e3 = o3 = vzero()
    e4 = o4 = e5 = o5 = e6 = o6 = e7 = o7 = vzero()
    e8 = o8 = e9 = o9 = e10 = o10 = e11 = o11 = vzero()
    for i in range(0, n16, 16):
        e0, o0, e1, o1 = _eo_pair(e0, o0, w0, xs, e1, o1, w1, xs, i)
        e2, o2, e3, o3 = _eo_pair(e2, o2, w2, xs, e3, o3, w3, xs, i)
        e4, o4, e5, o5 = _eo_pair(e4, o4, w4, xs, e5, o5, w5, xs, i)
        e6, o6, e7, o7 = _eo_pair(e6, o6, w6, xs, e7, o7, w7, xs, i)
        e8, o8, e9, o9 = _eo_pair(e8, o8, w8, xs, e9, o9, w9, xs, i)
        e10, o10, e11, o11 = _eo_pair(e10, o10, w10, xs, e11, o11, w11, xs, i)
    return (_tail(_reduce_eo(e0, o0), w0, x, n16, n), _tail(_reduce_eo(e1, o1), w1, x, n16, n),
            _tail(_reduce_eo(e2, o2), w2, x, n16, n), _tail(_reduce_eo(e3, o3), w3, x, n16, n),
            _tail(_reduce_eo(e4, o4), w4, x, n16, n), _tail(_reduce_eo(e5, o5), w5, x, n16, n),
            _tail(_reduce_eo(e6, o6), w6, x, n16, n), _tail(_reduce_eo(e7, o7), w7, x, n16, n),
            _tail(_reduce_eo(e8, o8), w8, x, n16, n), _tail(_reduce_eo(e9, o9), w9, x, n16, n),
            _tail(_reduce_eo(e10, o10), w10, x, n16, n),
            _tail(_reduce_eo(e11, o11), w11, x, n16, n))


@njit(cache=True, inline="always")
def dot16_rows6_t2(W, r, xsa, xa, xsb, xb):
    """dot16 of rows W[r] .. W[r + 5] with token a, then with token b (a 12-tuple) bit for
    bit, each weight chunk loaded once for both tokens (xsa, xsb: ``split16`` of xa, xb)."""
    n = W.shape[1]
    n16 = n - n % 16
    w0, w1, w2, w3, w4, w5 = W[r], W[r + 1], W[r + 2], W[r + 3], W[r + 4], W[r + 5]
    e0 = o0 = e1 = o1 = e2 = o2 = e3 = o3 = e4 = o4 = e5 = o5 = vzero()
    f0 = p0 = f1 = p1 = f2 = p2 = f3 = p3 = f4 = p4 = f5 = p5 = vzero()
    for i in range(0, n16, 16):
        e0, o0, e1, o1 = _eo_pair(e0, o0, w0, xsa, e1, o1, w1, xsa, i)
        f0, p0, f1, p1 = _eo_pair(f0, p0, w0, xsb, f1, p1, w1, xsb, i)
        e2, o2, e3, o3 = _eo_pair(e2, o2, w2, xsa, e3, o3, w3, xsa, i)
        f2, p2, f3, p3 = _eo_pair(f2, p2, w2, xsb, f3, p3, w3, xsb, i)
        e4, o4, e5, o5 = _eo_pair(e4, o4, w4, xsa, e5, o5, w5, xsa, i)
        f4, p4, f5, p5 = _eo_pair(f4, p4, w4, xsb, f5, p5, w5, xsb, i)
    return (_tail(_reduce_eo(e0, o0), w0, xa, n16, n), _tail(_reduce_eo(e1, o1), w1, xa, n16, n),
            _tail(_reduce_eo(e2, o2), w2, xa, n16, n), _tail(_reduce_eo(e3, o3), w3, xa, n16, n),
            _tail(_reduce_eo(e4, o4), w4, xa, n16, n), _tail(_reduce_eo(e5, o5), w5, xa, n16, n),
            _tail(_reduce_eo(f0, p0), w0, xb, n16, n), _tail(_reduce_eo(f1, p1), w1, xb, n16, n),
            _tail(_reduce_eo(f2, p2), w2, xb, n16, n), _tail(_reduce_eo(f3, p3), w3, xb, n16, n),
            _tail(_reduce_eo(f4, p4), w4, xb, n16, n), _tail(_reduce_eo(f5, p5), w5, xb, n16, n))


@njit(cache=True, inline="always")
def dot16_rows3_t4(W, r, XS, X, t):
    """dot16 of rows W[r], W[r + 1], W[r + 2] with tokens X[t] .. X[t + 3] (row-major
    12-tuple: row 0's four tokens first) bit for bit, each weight chunk loaded and
    widened once for the four tokens (XS[u]: ``split16`` of X[u])."""
    n = W.shape[1]
    n16 = n - n % 16
    w0, w1, w2 = W[r], W[r + 1], W[r + 2]
    xa, xb, xc, xd = XS[t], XS[t + 1], XS[t + 2], XS[t + 3]
    e0a = o0a = e0b = o0b = e0c = o0c = e0d = o0d = vzero()
    e1a = o1a = e1b = o1b = e1c = o1c = e1d = o1d = vzero()
    e2a = o2a = e2b = o2b = e2c = o2c = e2d = o2d = vzero()
    for i in range(0, n16, 16):
        e0a, o0a, e0b, o0b = _eo_pair(e0a, o0a, w0, xa, e0b, o0b, w0, xb, i)
        e0c, o0c, e0d, o0d = _eo_pair(e0c, o0c, w0, xc, e0d, o0d, w0, xd, i)
        e1a, o1a, e1b, o1b = _eo_pair(e1a, o1a, w1, xa, e1b, o1b, w1, xb, i)
        e1c, o1c, e1d, o1d = _eo_pair(e1c, o1c, w1, xc, e1d, o1d, w1, xd, i)
        e2a, o2a, e2b, o2b = _eo_pair(e2a, o2a, w2, xa, e2b, o2b, w2, xb, i)
        e2c, o2c, e2d, o2d = _eo_pair(e2c, o2c, w2, xc, e2d, o2d, w2, xd, i)
    Xa, Xb, Xc, Xd = X[t], X[t + 1], X[t + 2], X[t + 3]
    return (_tail(_reduce_eo(e0a, o0a), w0, Xa, n16, n), _tail(_reduce_eo(e0b, o0b), w0, Xb, n16, n),
            _tail(_reduce_eo(e0c, o0c), w0, Xc, n16, n), _tail(_reduce_eo(e0d, o0d), w0, Xd, n16, n),
            _tail(_reduce_eo(e1a, o1a), w1, Xa, n16, n), _tail(_reduce_eo(e1b, o1b), w1, Xb, n16, n),
            _tail(_reduce_eo(e1c, o1c), w1, Xc, n16, n), _tail(_reduce_eo(e1d, o1d), w1, Xd, n16, n),
            _tail(_reduce_eo(e2a, o2a), w2, Xa, n16, n), _tail(_reduce_eo(e2b, o2b), w2, Xb, n16, n),
            _tail(_reduce_eo(e2c, o2c), w2, Xc, n16, n), _tail(_reduce_eo(e2d, o2d), w2, Xd, n16, n))


@njit(cache=True, inline="always")
def span_x4_t2(Wb, kb, X, xa, xb, n, acc, at):
    """Continue the 16 lane vectors of four rows x two tokens over n columns (n % 16 == 0):
    row r's weights are Wb[r * kb :][:n] (float64, widened once for every token), token
    a's activations X[xa:][:n], token b's X[xb:][:n]; the vectors of (token u, row r) are
    acc[at + 16 * (4u + r):][:16] before and after. Every lane gets the additions
    ``dot16`` gives it, in the same order: cutting a row into column spans only moves its
    vectors through memory between spans."""
    r1, r2, r3 = kb, 2 * kb, 3 * kb
    l0a = vload(acc, at)
    h0a = vload(acc, at + 8)
    l1a = vload(acc, at + 16)
    h1a = vload(acc, at + 24)
    l2a = vload(acc, at + 32)
    h2a = vload(acc, at + 40)
    l3a = vload(acc, at + 48)
    h3a = vload(acc, at + 56)
    l0b = vload(acc, at + 64)
    h0b = vload(acc, at + 72)
    l1b = vload(acc, at + 80)
    h1b = vload(acc, at + 88)
    l2b = vload(acc, at + 96)
    h2b = vload(acc, at + 104)
    l3b = vload(acc, at + 112)
    h3b = vload(acc, at + 120)
    for i in range(0, n, 16):
        l0a = vfma(l0a, Wb, i, X, xa + i)
        h0a = vfma(h0a, Wb, i + 8, X, xa + i + 8)
        l0b = vfma(l0b, Wb, i, X, xb + i)
        h0b = vfma(h0b, Wb, i + 8, X, xb + i + 8)
        l1a = vfma(l1a, Wb, r1 + i, X, xa + i)
        h1a = vfma(h1a, Wb, r1 + i + 8, X, xa + i + 8)
        l1b = vfma(l1b, Wb, r1 + i, X, xb + i)
        h1b = vfma(h1b, Wb, r1 + i + 8, X, xb + i + 8)
        l2a = vfma(l2a, Wb, r2 + i, X, xa + i)
        h2a = vfma(h2a, Wb, r2 + i + 8, X, xa + i + 8)
        l2b = vfma(l2b, Wb, r2 + i, X, xb + i)
        h2b = vfma(h2b, Wb, r2 + i + 8, X, xb + i + 8)
        l3a = vfma(l3a, Wb, r3 + i, X, xa + i)
        h3a = vfma(h3a, Wb, r3 + i + 8, X, xa + i + 8)
        l3b = vfma(l3b, Wb, r3 + i, X, xb + i)
        h3b = vfma(h3b, Wb, r3 + i + 8, X, xb + i + 8)
    vstore(acc, at, l0a)
    vstore(acc, at + 8, h0a)
    vstore(acc, at + 16, l1a)
    vstore(acc, at + 24, h1a)
    vstore(acc, at + 32, l2a)
    vstore(acc, at + 40, h2a)
    vstore(acc, at + 48, l3a)
    vstore(acc, at + 56, h3a)
    vstore(acc, at + 64, l0b)
    vstore(acc, at + 72, h0b)
    vstore(acc, at + 80, l1b)
    vstore(acc, at + 88, h1b)
    vstore(acc, at + 96, l2b)
    vstore(acc, at + 104, h2b)
    vstore(acc, at + 112, l3b)
    vstore(acc, at + 120, h3b)


@njit(cache=True, inline="always")
def span_x4_t3(Wb, kb, X, xa, xb, xc, n, acc, at):
    """``span_x4_t2`` for three tokens a, b, c: the vectors of (token u, row r) are
    acc[at + 16 * (4u + r):][:16]; each widened weight load serves three tokens."""
    r1, r2, r3 = kb, 2 * kb, 3 * kb
    l0a = vload(acc, at)
    h0a = vload(acc, at + 8)
    l1a = vload(acc, at + 16)
    h1a = vload(acc, at + 24)
    l2a = vload(acc, at + 32)
    h2a = vload(acc, at + 40)
    l3a = vload(acc, at + 48)
    h3a = vload(acc, at + 56)
    l0b = vload(acc, at + 64)
    h0b = vload(acc, at + 72)
    l1b = vload(acc, at + 80)
    h1b = vload(acc, at + 88)
    l2b = vload(acc, at + 96)
    h2b = vload(acc, at + 104)
    l3b = vload(acc, at + 112)
    h3b = vload(acc, at + 120)
    l0c = vload(acc, at + 128)
    h0c = vload(acc, at + 136)
    l1c = vload(acc, at + 144)
    h1c = vload(acc, at + 152)
    l2c = vload(acc, at + 160)
    h2c = vload(acc, at + 168)
    l3c = vload(acc, at + 176)
    h3c = vload(acc, at + 184)
    for i in range(0, n, 16):
        l0a = vfma(l0a, Wb, i, X, xa + i)
        h0a = vfma(h0a, Wb, i + 8, X, xa + i + 8)
        l0b = vfma(l0b, Wb, i, X, xb + i)
        h0b = vfma(h0b, Wb, i + 8, X, xb + i + 8)
        l0c = vfma(l0c, Wb, i, X, xc + i)
        h0c = vfma(h0c, Wb, i + 8, X, xc + i + 8)
        l1a = vfma(l1a, Wb, r1 + i, X, xa + i)
        h1a = vfma(h1a, Wb, r1 + i + 8, X, xa + i + 8)
        l1b = vfma(l1b, Wb, r1 + i, X, xb + i)
        h1b = vfma(h1b, Wb, r1 + i + 8, X, xb + i + 8)
        l1c = vfma(l1c, Wb, r1 + i, X, xc + i)
        h1c = vfma(h1c, Wb, r1 + i + 8, X, xc + i + 8)
        l2a = vfma(l2a, Wb, r2 + i, X, xa + i)
        h2a = vfma(h2a, Wb, r2 + i + 8, X, xa + i + 8)
        l2b = vfma(l2b, Wb, r2 + i, X, xb + i)
        h2b = vfma(h2b, Wb, r2 + i + 8, X, xb + i + 8)
        l2c = vfma(l2c, Wb, r2 + i, X, xc + i)
        h2c = vfma(h2c, Wb, r2 + i + 8, X, xc + i + 8)
        l3a = vfma(l3a, Wb, r3 + i, X, xa + i)
        h3a = vfma(h3a, Wb, r3 + i + 8, X, xa + i + 8)
        l3b = vfma(l3b, Wb, r3 + i, X, xb + i)
        h3b = vfma(h3b, Wb, r3 + i + 8, X, xb + i + 8)
        l3c = vfma(l3c, Wb, r3 + i, X, xc + i)
        h3c = vfma(h3c, Wb, r3 + i + 8, X, xc + i + 8)
    vstore(acc, at, l0a)
    vstore(acc, at + 8, h0a)
    vstore(acc, at + 16, l1a)
    vstore(acc, at + 24, h1a)
    vstore(acc, at + 32, l2a)
    vstore(acc, at + 40, h2a)
    vstore(acc, at + 48, l3a)
    vstore(acc, at + 56, h3a)
    vstore(acc, at + 64, l0b)
    vstore(acc, at + 72, h0b)
    vstore(acc, at + 80, l1b)
    vstore(acc, at + 88, h1b)
    vstore(acc, at + 96, l2b)
    vstore(acc, at + 104, h2b)
    vstore(acc, at + 112, l3b)
    vstore(acc, at + 120, h3b)
    vstore(acc, at + 128, l0c)
    vstore(acc, at + 136, h0c)
    vstore(acc, at + 144, l1c)
    vstore(acc, at + 152, h1c)
    vstore(acc, at + 160, l2c)
    vstore(acc, at + 168, h2c)
    vstore(acc, at + 176, l3c)
    vstore(acc, at + 184, h3c)


@njit(cache=True, inline="always")
def span_x4_t1(Wb, kb, X, xa, n, acc, at):
    """``span_x4_t2`` for one token (an odd token count's last)."""
    r1, r2, r3 = kb, 2 * kb, 3 * kb
    l0 = vload(acc, at)
    h0 = vload(acc, at + 8)
    l1 = vload(acc, at + 16)
    h1 = vload(acc, at + 24)
    l2 = vload(acc, at + 32)
    h2 = vload(acc, at + 40)
    l3 = vload(acc, at + 48)
    h3 = vload(acc, at + 56)
    for i in range(0, n, 16):
        l0 = vfma(l0, Wb, i, X, xa + i)
        h0 = vfma(h0, Wb, i + 8, X, xa + i + 8)
        l1 = vfma(l1, Wb, r1 + i, X, xa + i)
        h1 = vfma(h1, Wb, r1 + i + 8, X, xa + i + 8)
        l2 = vfma(l2, Wb, r2 + i, X, xa + i)
        h2 = vfma(h2, Wb, r2 + i + 8, X, xa + i + 8)
        l3 = vfma(l3, Wb, r3 + i, X, xa + i)
        h3 = vfma(h3, Wb, r3 + i + 8, X, xa + i + 8)
    vstore(acc, at, l0)
    vstore(acc, at + 8, h0)
    vstore(acc, at + 16, l1)
    vstore(acc, at + 24, h1)
    vstore(acc, at + 32, l2)
    vstore(acc, at + 40, h2)
    vstore(acc, at + 48, l3)
    vstore(acc, at + 56, h3)


@njit(cache=True, inline="always")
def finish16(acc, at, w, x, n16, n):
    """The sum ``dot16`` returns, from lane vectors kept at acc[at:][:16] after columns
    0..n16-1: the fixed reduction, then the tail n16..n-1 one by one."""
    return _tail(_reduce16(vload(acc, at), vload(acc, at + 8)), w, x, n16, n)
