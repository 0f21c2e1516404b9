"""The few LLVM-level primitives the k3 kernels need that numba does not offer.

Owns: the one numba-side BF16 widening (bits << 16, the same rule as
``libk3.io.dtypes.bf16_to_f32``; scalar ``widen_f32`` / ``widen_f64``, vector inside
``vfma``) and an 8-lane float64 vector type ``f64x8`` with ``vzero``, ``vlane``,
``vfma``, ``vfma_even``/``vfma_odd``, ``vload``, ``vstore`` and ``vwiden``, and a cache
``prefetch`` hint, from which the fixed-order dot products of ``_dot.py`` are built.
Does not own: any model math, any summation order (``_dot.py`` fixes that).

WHY a vector type at all. Numba disables LLVM's SLP vectoriser and never lets the loop
vectoriser reassociate a floating-point reduction (no fastmath, on purpose:
model.md §7). A dot product written with 16 scalar f64 partial sums therefore compiles to
scalar code, about four times slower than the same 16 partial sums held in two 8-lane
vectors (bench/README.md, "Arithmetic"). The vector form changes nothing numerically: lane l of the vector
holds exactly the partial sum a scalar loop would keep in accumulator l, each lane is
updated in the same order, and every product of a BF16 or f32 weight with an f32
activation is exact in f64, so the fused multiply-add rounds exactly where a separate
multiply and add would (only the addition rounds). No reassociation ever happens.

Every function here is portable LLVM IR (generic vectors and ``llvm.fma``); on a machine
without AVX-512 LLVM splits the 8 lanes into narrower registers, with the same results.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, models, register_model

_F64 = ir.DoubleType()
_F32 = ir.FloatType()
_V = ir.VectorType(_F64, 8)


class F64x8Type(types.Type):
    """Eight float64 lanes held in one LLVM vector register (never leaves compiled code)."""

    def __init__(self):
        super().__init__(name="f64x8")


f64x8 = F64x8Type()


@register_model(F64x8Type)
class _F64x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V)


def _is_operand_array(a) -> bool:
    return (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"
            and a.dtype in (types.uint16, types.float32, types.float64))


def _widen_vector(builder, raw, dtype):
    """<8 x i16> BF16 bits, <8 x float> or <8 x double> -> <8 x double>, exactly."""
    if dtype == types.float64:
        return raw
    if dtype == types.uint16:
        i32 = ir.VectorType(ir.IntType(32), 8)
        bits = builder.shl(builder.zext(raw, i32), ir.Constant(i32, [16] * 8))
        raw = builder.bitcast(bits, ir.VectorType(_F32, 8))
    return builder.fpext(raw, _V)


def _load8(context, builder, aryty, ary, index_type, index):
    """Load 8 consecutive elements ary[index : index + 8] as an LLVM vector."""
    a = context.make_array(aryty)(context, builder, ary)
    i = context.cast(builder, index, index_type, types.intp)
    ptr = builder.gep(a.data, [i])
    elem = context.get_data_type(aryty.dtype)
    vptr = builder.bitcast(ptr, ir.VectorType(elem, 8).as_pointer())
    return builder.load(vptr, align=aryty.dtype.bitwidth // 8)


@intrinsic
def widen_f32(typingctx, w):
    """Scalar weight -> float32: uint16 BF16 bits are widened by bits << 16 (model.md §5.0),
    a float32 is returned unchanged. The numba twin of ``io.dtypes.bf16_to_f32``."""
    if w not in (types.uint16, types.float32):
        return None
    sig = types.float32(w)

    def codegen(context, builder, signature, args):
        if signature.args[0] == types.float32:
            return args[0]
        bits = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(bits, _F32)

    return sig, codegen


@intrinsic
def widen_f64(typingctx, w):
    """Scalar operand -> float64, exactly: uint16 BF16 bits via ``widen_f32``, float32
    by extension, float64 unchanged (the scalar twin of ``vfma``'s operand rule)."""
    if w not in (types.uint16, types.float32, types.float64):
        return None
    sig = types.float64(w)

    def codegen(context, builder, signature, args):
        t = signature.args[0]
        if t == types.float64:
            return args[0]
        val = args[0]
        if t == types.uint16:
            bits = builder.shl(builder.zext(val, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            val = builder.bitcast(bits, _F32)
        return builder.fpext(val, _F64)

    return sig, codegen


@intrinsic
def vzero(typingctx):
    """An f64x8 of +0.0 (accumulators start at +0.0, so a -0 product never leaks a -0)."""
    sig = f64x8()

    def codegen(context, builder, signature, args):
        return ir.Constant(_V, [0.0] * 8)

    return sig, codegen


@intrinsic
def vlane(typingctx, v, lane):
    """Lane ``lane`` (0..7) of an f64x8 as a float64."""
    if v != f64x8 or not isinstance(lane, types.Integer):
        return None
    sig = types.float64(v, lane)

    def codegen(context, builder, signature, args):
        return builder.extract_element(args[0], args[1])

    return sig, codegen


@intrinsic
def vfma(typingctx, acc, w, i, x, j):
    """acc[l] + f64(widen(w[i + l])) * f64(x[j + l]) for l = 0..7, lane by lane.

    w, x: 1-D C-contiguous uint16 (BF16 bits), float32, or float64 holding widened
    float32 values (a vector reused many times, widened once by the caller). The caller
    guarantees i + 8 <= len(w) and j + 8 <= len(x) (no bounds check). The product of two
    such values is exact in f64, so this equals acc + w * x with one rounding per lane."""
    if not (acc == f64x8 and _is_operand_array(w) and _is_operand_array(x)
            and isinstance(i, types.Integer) and isinstance(j, types.Integer)):
        return None
    sig = f64x8(acc, w, i, x, j)

    def codegen(context, builder, signature, args):
        vacc, vw, vi, vx, vj = args
        _, tw, ti, tx, tj = signature.args
        wd = _widen_vector(builder, _load8(context, builder, tw, vw, ti, vi), tw.dtype)
        xd = _widen_vector(builder, _load8(context, builder, tx, vx, tj, vj), tx.dtype)
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V, [_V, _V, _V]), "llvm.fma.v8f64")
        return builder.call(fma, [wd, xd, vacc])

    return sig, codegen


def _widen_half(context, builder, aryty, ary, index_type, index, odd):
    """Elements i, i+2, .., i+14 (odd: i+1, .., i+15) of a uint16 BF16 or float32 array as
    <8 x double>, exactly. BF16: the 16 elements are read as eight 32-bit words, whose low
    half (the even element, little-endian) widens by << 16 and whose high half (the odd
    one) by clearing the low 16 bits: no zero-extension shuffle per element."""
    a = context.make_array(aryty)(context, builder, ary)
    ptr = builder.gep(a.data, [context.cast(builder, index, index_type, types.intp)])
    if aryty.dtype == types.uint16:
        i32 = ir.VectorType(ir.IntType(32), 8)
        words = builder.load(builder.bitcast(ptr, i32.as_pointer()), align=2)
        if odd:
            bits = builder.and_(words, ir.Constant(i32, [-65536] * 8))
        else:
            bits = builder.shl(words, ir.Constant(i32, [16] * 8))
        return builder.fpext(builder.bitcast(bits, ir.VectorType(_F32, 8)), _V)
    v16 = builder.load(builder.bitcast(ptr, ir.VectorType(_F32, 16).as_pointer()), align=4)
    half = builder.shuffle_vector(v16, ir.Constant(ir.VectorType(_F32, 16), None),
                                  ir.Constant(ir.VectorType(ir.IntType(32), 8),
                                              [2 * k + int(odd) for k in range(8)]))
    return builder.fpext(half, _V)


def _vfma_half(odd, name, doc):
    def typer(typingctx, acc, w, i, x, j):
        if not (acc == f64x8 and isinstance(w, types.Array) and w.ndim == 1
                and w.layout == "C" and w.dtype in (types.uint16, types.float32)
                and _is_operand_array(x) and isinstance(i, types.Integer)
                and isinstance(j, types.Integer)):
            return None
        sig = f64x8(acc, w, i, x, j)

        def codegen(context, builder, signature, args):
            vacc, vw, vi, vx, vj = args
            _, tw, ti, tx, tj = signature.args
            wd = _widen_half(context, builder, tw, vw, ti, vi, odd)
            xd = _widen_vector(builder, _load8(context, builder, tx, vx, tj, vj), tx.dtype)
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_V, [_V, _V, _V]), "llvm.fma.v8f64")
            return builder.call(fma, [wd, xd, vacc])

        return sig, codegen
    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


vfma_even = _vfma_half(False, "vfma_even", """acc[l] + widen(w[i + 2l]) * f64(x[j + l]) for
l = 0..7: the even elements of the 16 at w[i] (uint16 BF16 bits or float32) against eight
consecutive x (float64 holding widened values, or float32); one rounding per lane, as
``vfma``. Unchecked bounds.""")
vfma_odd = _vfma_half(True, "vfma_odd", """``vfma_even`` for the odd elements w[i + 2l + 1].""")


@intrinsic
def vload(typingctx, a, i):
    """a[i : i + 8] of a 1-D C-contiguous float64 array as an f64x8 (unchecked bounds):
    a partial sum kept in memory between the column blocks of a blocked product."""
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"
            and a.dtype == types.float64 and isinstance(i, types.Integer)):
        return None
    sig = f64x8(a, i)

    def codegen(context, builder, signature, args):
        return _load8(context, builder, signature.args[0], args[0], signature.args[1], args[1])

    return sig, codegen


@intrinsic
def vstore(typingctx, a, i, v):
    """a[i : i + 8] = v for a 1-D C-contiguous float64 array (unchecked bounds)."""
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"
            and a.dtype == types.float64 and isinstance(i, types.Integer) and v == f64x8):
        return None
    sig = types.void(a, i, v)

    def codegen(context, builder, signature, args):
        aryty, ity = signature.args[0], signature.args[1]
        arr = context.make_array(aryty)(context, builder, args[0])
        ptr = builder.gep(arr.data, [context.cast(builder, args[1], ity, types.intp)])
        builder.store(args[2], builder.bitcast(ptr, _V.as_pointer()), align=8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def vwiden(typingctx, w, i):
    """w[i : i + 8] (uint16 BF16 bits or float32, 1-D C-contiguous) widened exactly to an
    f64x8 (unchecked bounds): a weight block widened once for many tokens."""
    if not (_is_operand_array(w) and isinstance(i, types.Integer)):
        return None
    sig = f64x8(w, i)

    def codegen(context, builder, signature, args):
        tw, ti = signature.args
        return _widen_vector(builder, _load8(context, builder, tw, args[0], ti, args[1]),
                             tw.dtype)

    return sig, codegen


@intrinsic
def prefetch(typingctx, a, i):
    """Hint the cache line holding a[i] into the cache (no effect on any value; an address
    past the array's end is allowed: a prefetch never faults)."""
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"
            and isinstance(i, types.Integer)):
        return None
    sig = types.void(a, i)

    def codegen(context, builder, signature, args):
        aryty, ity = signature.args
        arr = context.make_array(aryty)(context, builder, args[0])
        ptr = builder.gep(arr.data, [context.cast(builder, args[1], ity, types.intp)])
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p] + [ir.IntType(32)] * 3),
            "llvm.prefetch.p0i8")
        i32 = ir.IntType(32)
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen
