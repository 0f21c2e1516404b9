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

Order (formats/numerics.md section 3): per 32-group, 8 f64 partial sums s_0..s_7 start
at +0.0 and element j of the group goes to s_(j mod 8) in increasing j; the group sum is
((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)); it is multiplied by 2^(s - 127)
(exact) and added to the row sum in increasing group order; one rounding to f32. Rows
are processed two at a time sharing the x loads; each row's arithmetic is unchanged. E2M1
values times f32 activations are exact in f64, so only these additions round. This is
the order the public C engine documents (model.md §7.2).

WHY a vector decode through the SSSE3 byte shuffle: the scalar table decode (a byte ->
(low, high) pair, eight f64 lanes as scalars) is bound by loads, and decoding a whole
group at once (16 bytes -> nibbles -> one 16-entry int8 table lookup per nibble half ->
f64 lanes, four fused multiply-adds into the eight lanes of section 3) is about twice as
fast with the same sums (bench/README.md, "Kernels at the real dimensions"). The table
holds 2 * E2M1 (all integers) and the group sum is scaled by 2^(s - 128): doubling is
exact in f64 for any f32 activation, so every rounding lands on the same real number as
the scalar path's. The scalar ``_row_dot2`` stays as the path for CPUs without SSSE3 and as the test oracle of
the vector one.
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as _llvm_binding
from llvmlite import ir
from numba import njit, prange

from . import team
from numba.core import cgutils, types
from numba.extending import intrinsic

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


# Frozen into the compiled code as constants (numba reads module arrays at compile time).
E2M1_PAIRS = _pair_table()
POW2 = _scale_table()
POW2_HALF = POW2 * 0.5        # 2^(s - 128): the scale of the doubled E2M1 values below
_NAN_SCALE = np.uint8(SCALE_NAN)

# 2 * E2M1[nibble] as int8 (every doubled E2M1 value is an integer, -12..12; -0 -> 0).
E2M1_X2_INT8 = [int(v * 2) for v in E2M1]
assert all(2 * E2M1[i] == E2M1_X2_INT8[i] for i in range(16))


def _host_has_pshufb() -> bool:
    """The vector decode needs the SSSE3 byte shuffle (every x86-64 CPU since ~2006);
    elsewhere the scalar table path runs, with the same results."""
    try:
        return bool(_llvm_binding.get_host_cpu_features().get("ssse3"))
    except Exception:                       # feature query unsupported on this platform
        return False


HAVE_PSHUFB = _host_has_pshufb()

_I8x16 = ir.VectorType(ir.IntType(8), 16)
_F64x8 = ir.VectorType(ir.DoubleType(), 8)


def _mask(idx):
    idx = list(idx)
    return ir.Constant(ir.VectorType(ir.IntType(32), len(idx)), idx)


@intrinsic
def _group_sum_x2(typingctx, packed, q, x, j):
    """float64 sum of one 32-group, 2 * E2M1(nibble) * x, in the order of section 3 of
    formats/numerics.md: lanes s_0..s_7 start at +0.0, element j + 8c + l is added to s_l
    in increasing c by a fused multiply-add (exact product: one rounding, the addition's),
    then ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)). Doubling is exact in f64 for
    every f32 activation, so this is exactly twice the scalar ``_row_dot2`` group sum.

    packed: [C/2] uint8 row, q = 16 * group; x: [C] float64, j = 32 * group (unchecked).
    Decode: 16 bytes -> low / high nibbles -> one SSSE3 byte shuffle each through the
    16-entry int8 table -> interleaved (low nibble = even element) -> int8 -> f64."""
    if not (isinstance(packed, types.Array) and packed.dtype == types.uint8
            and isinstance(x, types.Array) and x.dtype == types.float64
            and isinstance(q, types.Integer) and isinstance(j, types.Integer)):
        return None
    sig = types.float64(packed, q, x, j)

    def codegen(context, builder, signature, args):
        vp, vq, vx, vj = args
        tp, tq, tx, tj = signature.args
        pa = context.make_array(tp)(context, builder, vp)
        qi = context.cast(builder, vq, tq, types.intp)
        raw = builder.load(builder.bitcast(builder.gep(pa.data, [qi]), _I8x16.as_pointer()),
                           align=1)
        lo = builder.and_(raw, ir.Constant(_I8x16, [15] * 16))
        hi = builder.lshr(raw, ir.Constant(_I8x16, [4] * 16))
        pshufb = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_I8x16, [_I8x16, _I8x16]),
            "llvm.x86.ssse3.pshuf.b.128")
        lut = ir.Constant(_I8x16, E2M1_X2_INT8)
        lv = builder.call(pshufb, [lut, lo])
        hv = builder.call(pshufb, [lut, hi])
        elems = (builder.shuffle_vector(lv, hv, _mask(k // 2 + 16 * (k % 2) for k in range(16))),
                 builder.shuffle_vector(lv, hv, _mask(8 + k // 2 + 16 * (k % 2) for k in range(16))))
        xa = context.make_array(tx)(context, builder, vx)
        ji = context.cast(builder, vj, tj, types.intp)
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_F64x8, [_F64x8, _F64x8, _F64x8]), "llvm.fma.v8f64")
        acc = ir.Constant(_F64x8, [0.0] * 8)
        for c in range(4):
            w8 = builder.shuffle_vector(elems[c // 2], elems[c // 2],
                                        _mask(8 * (c % 2) + k for k in range(8)))
            w = builder.sitofp(w8, _F64x8)
            xp = builder.gep(xa.data, [builder.add(ji, ir.Constant(ji.type, 8 * c))])
            xv = builder.load(builder.bitcast(xp, _F64x8.as_pointer()), align=8)
            acc = builder.call(fma, [w, xv, acc])
        t = builder.fadd(builder.shuffle_vector(acc, acc, _mask(range(4))),
                         builder.shuffle_vector(acc, acc, _mask(range(4, 8))))
        u = builder.fadd(builder.shuffle_vector(t, t, _mask((0, 2))),
                         builder.shuffle_vector(t, t, _mask((1, 3))))
        return builder.fadd(builder.extract_element(u, ir.Constant(ir.IntType(32), 0)),
                            builder.extract_element(u, ir.Constant(ir.IntType(32), 1)))

    return sig, codegen


@njit(cache=True, inline="always")
def _row_dot2_vec(pa, sa, pb, sb, x):
    """``_row_dot2`` bit for bit through the vector decode: each doubled group sum is
    scaled by 2^(s - 128) instead of 2^(s - 127), the same real number, so the same
    rounding."""
    acc_a = 0.0
    acc_b = 0.0
    for g in range(sa.shape[0]):
        ga = _group_sum_x2(pa, 16 * g, x, 32 * g)
        gb = _group_sum_x2(pb, 16 * g, x, 32 * g)
        if sa[g] != _NAN_SCALE:
            acc_a += ga * POW2_HALF[sa[g]]
        if sb[g] != _NAN_SCALE:
            acc_b += gb * POW2_HALF[sb[g]]
    return acc_a, acc_b


@njit(cache=True, inline="always")
def _row_dot2(pa, sa, pb, sb, x):
    """float64 sums of two packed rows a and b against one x (each row in the order of
    section 3 of formats/numerics.md, independently of the other row).

    pa, pb: [C/2] uint8; sa, sb: [C/32] uint8; x: [C] float64. Two rows per pass share
    every x load (the loop is bound by loads: +10 % over one row at a time)."""
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


@njit(cache=True, parallel=True)
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
    x64 = x.astype(np.float64)
    nt = team.narrow(packed.nbytes * 2)
    for pair in prange((R + 1) // 2):
        a = 2 * pair
        b = min(a + 1, R - 1)             # an odd last row is paired with itself
        ya, yb = _row_pair(packed[a], scales[a], packed[b], scales[b], x64)
        y[a] = np.float32(ya)
        y[b] = np.float32(yb)
    team.widen(nt)


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
    nt = team.narrow(packed.nbytes * 2 * T)
    for pair in prange((R + 1) // 2):
        a = 2 * pair
        b = min(a + 1, R - 1)
        for t in range(T):
            ya, yb = _row_pair(packed[a], scales[a], packed[b], scales[b], X64[t])
            Y[t, a] = np.float32(ya)
            Y[t, b] = np.float32(yb)
    team.widen(nt)
