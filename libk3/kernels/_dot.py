"""The one fixed-order float64 dot product behind every k3 matrix-vector product.

Owns: ``dot16`` (one row), ``dot16_x4`` (four rows sharing the activation loads) and
``dot16_x4_t2`` (four rows times two tokens sharing the weight loads: prefill), the
span steps of the widen-once product (``span_x4_t3``/``_t2``/``_t1``: four rows times three,
two or one tokens over a column span of weights widened once), the
summation order of formats/model/numerics.md section 2. It follows the order the public C engine
documents (model.md §7.2; "remainder added sequentially" read as: after the reduction),
so k3's BF16/F32 matvecs should match it bit for bit (not checked: no C engine output is
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
vector chains in flight, and ``dot16_x4_t2`` to load and widen each weight chunk once for
two tokens (both measured in bench/README.md, "Arithmetic").
"""

from __future__ import annotations

from numba import njit

from ._simd import vfma, vlane, vload, vstore, vzero, widen_f64


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


@njit(cache=True, inline="always")
def dot16_x4_t2(w0, w1, w2, w3, xa, xb):
    """dot16_x4(w0..w3, xa) + dot16_x4(w0..w3, xb) (one flat 8-tuple) bit for bit, in one pass: each
    weight chunk is loaded and widened once for both tokens (prefill, speculative
    verify). Every (row, token) pair keeps its own two accumulators, updated in the
    order ``dot16`` uses."""
    n = w0.shape[0]
    n16 = n - n % 16
    l0a = vzero()
    h0a = vzero()
    l1a = vzero()
    h1a = vzero()
    l2a = vzero()
    h2a = vzero()
    l3a = vzero()
    h3a = vzero()
    l0b = vzero()
    h0b = vzero()
    l1b = vzero()
    h1b = vzero()
    l2b = vzero()
    h2b = vzero()
    l3b = vzero()
    h3b = vzero()
    for i in range(0, n16, 16):
        l0a = vfma(l0a, w0, i, xa, i)
        h0a = vfma(h0a, w0, i + 8, xa, i + 8)
        l0b = vfma(l0b, w0, i, xb, i)
        h0b = vfma(h0b, w0, i + 8, xb, i + 8)
        l1a = vfma(l1a, w1, i, xa, i)
        h1a = vfma(h1a, w1, i + 8, xa, i + 8)
        l1b = vfma(l1b, w1, i, xb, i)
        h1b = vfma(h1b, w1, i + 8, xb, i + 8)
        l2a = vfma(l2a, w2, i, xa, i)
        h2a = vfma(h2a, w2, i + 8, xa, i + 8)
        l2b = vfma(l2b, w2, i, xb, i)
        h2b = vfma(h2b, w2, i + 8, xb, i + 8)
        l3a = vfma(l3a, w3, i, xa, i)
        h3a = vfma(h3a, w3, i + 8, xa, i + 8)
        l3b = vfma(l3b, w3, i, xb, i)
        h3b = vfma(h3b, w3, i + 8, xb, i + 8)
    return (_tail(_reduce16(l0a, h0a), w0, xa, n16, n),
            _tail(_reduce16(l1a, h1a), w1, xa, n16, n),
            _tail(_reduce16(l2a, h2a), w2, xa, n16, n),
            _tail(_reduce16(l3a, h3a), w3, xa, n16, n),
            _tail(_reduce16(l0b, h0b), w0, xb, n16, n),
            _tail(_reduce16(l1b, h1b), w1, xb, n16, n),
            _tail(_reduce16(l2b, h2b), w2, xb, n16, n),
            _tail(_reduce16(l3b, h3b), w3, xb, n16, n))


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
