"""The MXFP4 group decode and the tile steps every MXFP4 kernel is built from.

Owns: the vector decode of one 32-weight group (16 packed bytes -> four f64x8 vectors of
doubled E2M1 values: a float64 table permute on AVX-512 machines, the SSSE3 byte shuffle
on other x86-64, the same values), ``group_sum_x2`` (one row, one token: the decode's
one-token use); the tile steps ``tile_8x1`` (eight lanes), ``tile_4x4``
and ``tile_8x2`` (sixteen: two vectors of eight): RT rows x TT tokens of one group, each
decoded row applied to every token of the tile; and for eight tokens at a time
``decode_to`` (a group decoded once into memory) with ``lanes_pair`` (two rows, the eight
tokens in the lanes: the tree is then seven vector adds, no shuffles). Does not own: the order itself
(formats/model/numerics.md section 3), which tiles a kernel uses (``mxfp4.py``).

WHY tiles of eight (row, token) lanes. The order of section 3 ends each group with a
fixed tree ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)) and a scaled add into the
row sum. Done one (row, token) at a time that tree is a horizontal reduction of one
vector, as costly as the group's four fused multiply-adds. Eight of them side by side
reduce together: three rounds of shuffles and vector adds take eight vectors of lanes
s_0..s_7 to one vector whose lane l is the tree of vector l (each lane adds exactly the
pairs the tree names), and the scaled add then runs on the eight row sums as one vector.
Nothing is reassociated: every (row, token) sum sees the additions of section 3 in its
order. Lane l of a tile is row r0 + l // TT, token t0 + l % TT.

The decode holds 2 * E2M1 (integers) and the group sum is scaled by 2^(s - 128): doubling
is exact in f64 for any f32 activation, so every rounding lands on the same real number
as the undoubled order's (tests/test_kernels_props.py checks it at the extremes).
A scale byte of 255 contributes +0.0 instead of being skipped: the row sum starts at +0.0
and can never become -0.0 (IEEE round-to-nearest gives -0.0 from a sum only when both
terms are -0.0), so adding +0.0 leaves it bit for bit as it was.
"""

from __future__ import annotations

from llvmlite import binding as _llvm_binding
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..io.mxfp4 import E2M1, SCALE_NAN
from ._simd import f64x8

# 2 * E2M1[nibble] as int8 (every doubled E2M1 value is an integer, -12..12; -0 -> 0).
E2M1_X2_INT8 = [int(v * 2) for v in E2M1]
assert all(2 * E2M1[i] == E2M1_X2_INT8[i] for i in range(16))


def _host_has(feature: str) -> bool:
    """Whether this CPU has ``feature`` (LLVM's name), False where the query is unsupported."""
    try:
        return bool(_llvm_binding.get_host_cpu_features().get(feature))
    except Exception:                       # feature query unsupported on this platform
        return False


# The vector decode needs the SSSE3 byte shuffle (every x86-64 CPU since ~2006); elsewhere
# the scalar table path runs, with the same results.
HAVE_PSHUFB = _host_has("ssse3")
# The table decode needs AVX-512F's two-table permute (vpermi2pd).
HAVE_AVX512F = _host_has("avx512f")

_I8x16 = ir.VectorType(ir.IntType(8), 16)
_I64 = ir.IntType(64)
_F64 = ir.DoubleType()
_F64x8 = ir.VectorType(_F64, 8)
_I64x8 = ir.VectorType(_I64, 8)
_ZERO8 = ir.Constant(_F64x8, [0.0] * 8)
_EVEN = range(0, 16, 2)
_ODD = range(1, 16, 2)


def _mask(idx):
    idx = list(idx)
    return ir.Constant(ir.VectorType(ir.IntType(32), len(idx)), idx)


def _fma(builder):
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_F64x8, [_F64x8, _F64x8, _F64x8]), "llvm.fma.v8f64")


def _data(context, builder, aryty, ary):
    return context.make_array(aryty)(context, builder, ary).data


def _index(context, builder, val, ty):
    return context.cast(builder, val, ty, types.intp)


def _decode(builder, ptr):
    """16 packed bytes at ``ptr`` (i8*) -> four <8 x double>: elements 8c .. 8c + 7 of the
    group for c = 0..3, each 2 * E2M1 (low nibble = even element)."""
    if HAVE_AVX512F:
        return _decode_permute(builder, ptr)
    return _decode_pshufb(builder, ptr)


def _decode_permute(builder, ptr):
    """``_decode`` through a 16-entry float64 table: each 64-bit lane k of the packed
    word holding elements 8c .. 8c + 7 is shifted right by 4 * (element within the word),
    which brings that element's nibble to bits 0..3, and the two-table permute (which
    reads only those bits) looks up 2 * E2M1 as a double: no byte shuffles, no
    int -> float conversion. The same values as the byte-shuffle path, bit for bit."""
    words = builder.load(builder.bitcast(ptr, ir.VectorType(_I64, 2).as_pointer()), align=1)
    permute = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_F64x8, [_F64x8, _I64x8, _F64x8]),
        "llvm.x86.avx512.vpermi2var.pd.512")
    low = ir.Constant(_F64x8, [float(v) for v in E2M1_X2_INT8[:8]])
    high = ir.Constant(_F64x8, [float(v) for v in E2M1_X2_INT8[8:]])
    out = []
    for c in range(4):
        word = builder.shuffle_vector(words, words, _mask([c // 2] * 8))
        shifts = ir.Constant(_I64x8, [32 * (c % 2) + 4 * k for k in range(8)])
        out.append(builder.call(permute, [low, builder.lshr(word, shifts), high]))
    return out


def _decode_pshufb(builder, ptr):
    """``_decode`` through the SSSE3 byte shuffle and an int8 -> double conversion."""
    raw = builder.load(builder.bitcast(ptr, _I8x16.as_pointer()), align=1)
    lo = builder.and_(raw, ir.Constant(_I8x16, [15] * 16))
    hi = builder.lshr(raw, ir.Constant(_I8x16, [4] * 16))
    pshufb = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_I8x16, [_I8x16, _I8x16]), "llvm.x86.ssse3.pshuf.b.128")
    lut = ir.Constant(_I8x16, E2M1_X2_INT8)
    lv = builder.call(pshufb, [lut, lo])
    hv = builder.call(pshufb, [lut, hi])
    elems = (builder.shuffle_vector(lv, hv, _mask(k // 2 + 16 * (k % 2) for k in range(16))),
             builder.shuffle_vector(lv, hv, _mask(8 + k // 2 + 16 * (k % 2) for k in range(16))))
    return [builder.sitofp(builder.shuffle_vector(elems[c // 2], elems[c // 2],
                                                  _mask(8 * (c % 2) + k for k in range(8))),
                           _F64x8)
            for c in range(4)]


def _load_x(builder, xptr):
    """The 32 activations of one group (float64) as four <8 x double>."""
    return [builder.load(builder.bitcast(builder.gep(xptr, [ir.Constant(_I64, 8 * c)]),
                                         _F64x8.as_pointer()), align=8) for c in range(4)]


def _lanes(builder, w, xv):
    """s_0..s_7 of one (row, token): from +0.0, s_l += w_c[l] * x[8c + l], c = 0..3."""
    acc = _ZERO8
    fma = _fma(builder)
    for c in range(4):
        acc = builder.call(fma, [w[c], xv[c], acc])
    return acc


def _pairs(builder, a, b, first, second):
    return builder.fadd(builder.shuffle_vector(a, b, _mask(first)),
                        builder.shuffle_vector(a, b, _mask(second)))


def _tree8(builder, v):
    """Eight vectors of lanes s_0..s_7 -> one vector, lane l = the section 3 tree of v[l]."""
    # round 1: (s_k + s_(k+4)), k = 0..3, of two vectors per result
    p = [_pairs(builder, v[2 * i], v[2 * i + 1], (0, 1, 2, 3, 8, 9, 10, 11),
                (4, 5, 6, 7, 12, 13, 14, 15)) for i in range(4)]
    # round 2: (p0 + p1), (p2 + p3) of four vectors per result
    q = [_pairs(builder, p[2 * i], p[2 * i + 1], _EVEN, _ODD) for i in range(2)]
    # round 3: (p0 + p1) + (p2 + p3), all eight
    return _pairs(builder, q[0], q[1], _EVEN, _ODD)


def _scaled_add(builder, acc, g, sbytes, tt):
    """acc + (g * 2^(s - 128)) lane by lane, +0.0 for a 255 scale; sbytes: RT i8 values,
    lane l takes sbytes[l // tt]."""
    s = [builder.zext(b, _I64) for b in sbytes]
    sv = ir.Constant(_I64x8, ir.Undefined)
    for lane in range(8):
        sv = builder.insert_element(sv, s[lane // tt], ir.Constant(ir.IntType(32), lane))
    # 2^(s - 128) as IEEE bits: biased exponent s - 128 + 1023, valid for s = 0..254
    bits = builder.shl(builder.add(sv, ir.Constant(_I64x8, [1023 - 128] * 8)),
                       ir.Constant(_I64x8, [52] * 8))
    scale = builder.bitcast(bits, _F64x8)
    nan = builder.icmp_unsigned("==", sv, ir.Constant(_I64x8, [SCALE_NAN] * 8))
    term = builder.select(nan, _ZERO8, builder.fmul(g, scale))
    return builder.fadd(acc, term)


def _make_tile(rt: int, tt: int):
    """The tile step of ``rt`` rows x ``tt`` tokens as a numba intrinsic: rt * tt = 8 takes
    and returns one f64x8, rt * tt = 16 a pair (vector v holds rows v * 8 // tt ..)."""

    @intrinsic
    def tile(typingctx, acc, P, po, pstride, S, so, sstride, X, xo, xstride):
        ints = (po, pstride, so, sstride, xo, xstride)
        if not ((acc == f64x8 if rt * tt == 8 else acc == types.UniTuple(f64x8, rt * tt // 8))
                and all(isinstance(i, types.Integer) for i in ints)
                and isinstance(P, types.Array) and P.dtype == types.uint8 and P.ndim == 1
                and isinstance(S, types.Array) and S.dtype == types.uint8 and S.ndim == 1
                and isinstance(X, types.Array) and X.dtype == types.float64 and X.ndim == 1):
            return None
        sig = acc(acc, P, po, pstride, S, so, sstride, X, xo, xstride)

        def codegen(context, builder, signature, args):
            vacc, vP, vpo, vps, vS, vso, vss, vX, vxo, vxs = args
            t = signature.args
            pdata = _data(context, builder, t[1], vP)
            sdata = _data(context, builder, t[4], vS)
            xdata = _data(context, builder, t[7], vX)
            po_, ps_ = _index(context, builder, vpo, t[2]), _index(context, builder, vps, t[3])
            so_, ss_ = _index(context, builder, vso, t[5]), _index(context, builder, vss, t[6])
            xo_, xs_ = _index(context, builder, vxo, t[8]), _index(context, builder, vxs, t[9])
            xptrs = [builder.gep(xdata, [builder.add(xo_, builder.mul(xs_, ir.Constant(xs_.type, k)))])
                     for k in range(tt)]
            ws, sbytes = [], []
            for r in range(rt):
                rk = ir.Constant(ps_.type, r)
                ws.append(_decode(builder, builder.gep(pdata, [builder.add(po_, builder.mul(ps_, rk))])))
                sbytes.append(builder.load(builder.gep(sdata, [builder.add(so_, builder.mul(ss_, rk))])))
            sums = [None] * (rt * tt)
            for k, xp in enumerate(xptrs):
                xv = _load_x(builder, xp)
                for r in range(rt):
                    sums[r * tt + k] = _lanes(builder, ws[r], xv)
            if rt * tt == 8:
                return _scaled_add(builder, vacc, _tree8(builder, sums), sbytes, tt)
            outs = []
            for v in range(rt * tt // 8):
                rows = sbytes[v * 8 // tt:(v + 1) * 8 // tt]
                outs.append(_scaled_add(builder, builder.extract_value(vacc, v),
                                        _tree8(builder, sums[8 * v:8 * v + 8]), rows, tt))
            return context.make_tuple(builder, signature.return_type, outs)

        return sig, codegen

    tile.__doc__ = (f"acc + the scaled group sums of {rt} row(s) x {tt} token(s): packed rows at "
                    "P[po + r * pstride :][:16], scale bytes S[so + r * sstride], activations "
                    "(float64) X[xo + k * xstride :][:32]; lane l = (row l // TT, token l % TT). "
                    "Unchecked offsets: the caller keeps them in bounds.")
    return tile


tile_8x1 = _make_tile(8, 1)
tile_4x4 = _make_tile(4, 4)
tile_8x2 = _make_tile(8, 2)


@intrinsic
def group_sum_x2(typingctx, packed, q, x, j):
    """float64 sum of one 32-group, 2 * E2M1(nibble) * x, in the order of section 3 of
    formats/model/numerics.md: lanes s_0..s_7 start at +0.0, element j + 8c + l is added to s_l
    in increasing c by a fused multiply-add (exact product: one rounding, the addition's),
    then ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)). Doubling is exact in f64 for
    every f32 activation, so this is exactly twice the scalar group sum.

    packed: [C/2] uint8 row, q = 16 * group; x: [C] float64, j = 32 * group (unchecked)."""
    if not (isinstance(packed, types.Array) and packed.dtype == types.uint8
            and isinstance(x, types.Array) and x.dtype == types.float64
            and isinstance(q, types.Integer) and isinstance(j, types.Integer)):
        return None
    sig = types.float64(packed, q, x, j)

    def codegen(context, builder, signature, args):
        vp, vq, vx, vj = args
        tp, tq, tx, tj = signature.args
        pptr = builder.gep(_data(context, builder, tp, vp), [_index(context, builder, vq, tq)])
        xptr = builder.gep(_data(context, builder, tx, vx), [_index(context, builder, vj, tj)])
        acc = _lanes(builder, _decode(builder, pptr), _load_x(builder, xptr))
        t = builder.fadd(builder.shuffle_vector(acc, acc, _mask(range(4))),
                         builder.shuffle_vector(acc, acc, _mask(range(4, 8))))
        u = builder.fadd(builder.shuffle_vector(t, t, _mask((0, 2))),
                         builder.shuffle_vector(t, t, _mask((1, 3))))
        return builder.fadd(builder.extract_element(u, ir.Constant(ir.IntType(32), 0)),
                            builder.extract_element(u, ir.Constant(ir.IntType(32), 1)))

    return sig, codegen



@intrinsic
def decode_to(typingctx, P, po, W, wo):
    """W[wo : wo + 32] = the doubled E2M1 values of the group packed at P[po :][:16]
    (float64, low nibble = even element): a group decoded once for many tokens."""
    if not (isinstance(P, types.Array) and P.dtype == types.uint8 and P.ndim == 1
            and isinstance(W, types.Array) and W.dtype == types.float64 and W.ndim == 1
            and isinstance(po, types.Integer) and isinstance(wo, types.Integer)):
        return None
    sig = types.void(P, po, W, wo)

    def codegen(context, builder, signature, args):
        vP, vpo, vW, vwo = args
        t = signature.args
        w = _decode(builder, builder.gep(_data(context, builder, t[0], vP),
                                         [_index(context, builder, vpo, t[1])]))
        base = builder.gep(_data(context, builder, t[2], vW), [_index(context, builder, vwo, t[3])])
        for c in range(4):
            dst = builder.gep(base, [ir.Constant(_I64, 8 * c)])
            builder.store(w[c], builder.bitcast(dst, _F64x8.as_pointer()), align=8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def lanes_pair(typingctx, acc, W, wa, wb, S, sa, sb, XT, xo):
    """Tokens in the lanes: acc (two f64x8, lane t = token t of eight) + the scaled group
    sums of two rows whose group is decoded at W[wa :][:32] and W[wb :][:32] (float64,
    ``decode_to``), scale bytes S[sa] and S[sb], over activations laid out token-minor,
    XT[xo + 8 * j + t] = x[t, 32 g + j] (float64).

    s_l is one vector over the eight tokens: element j adds w_j (broadcast) * XT_j to
    s_(j mod 8), j increasing; the tree of section 3 is then seven vector adds, and every
    lane sees exactly the additions its (row, token) sum makes in any other tile."""
    if not (acc == types.UniTuple(f64x8, 2)
            and all(isinstance(i, types.Integer) for i in (wa, wb, sa, sb, xo))
            and isinstance(W, types.Array) and W.dtype == types.float64 and W.ndim == 1
            and isinstance(S, types.Array) and S.dtype == types.uint8 and S.ndim == 1
            and isinstance(XT, types.Array) and XT.dtype == types.float64 and XT.ndim == 1):
        return None
    sig = acc(acc, W, wa, wb, S, sa, sb, XT, xo)

    def codegen(context, builder, signature, args):
        vacc, vW, vwa, vwb, vS, vsa, vsb, vX, vxo = args
        t = signature.args
        wdata = _data(context, builder, t[1], vW)
        sdata = _data(context, builder, t[4], vS)
        xdata = _data(context, builder, t[7], vX)
        rows = [_index(context, builder, vwa, t[2]), _index(context, builder, vwb, t[3])]
        sbytes = [builder.load(builder.gep(sdata, [_index(context, builder, v, ty)]))
                  for v, ty in ((vsa, t[5]), (vsb, t[6]))]
        xo_ = _index(context, builder, vxo, t[8])
        fma = _fma(builder)
        i32 = ir.IntType(32)
        zeros8 = ir.Constant(ir.VectorType(i32, 8), [0] * 8)
        sums = [[_ZERO8] * 8 for _ in range(2)]
        for j in range(32):
            xp = builder.gep(xdata, [builder.add(xo_, ir.Constant(xo_.type, 8 * j))])
            xv = builder.load(builder.bitcast(xp, _F64x8.as_pointer()), align=8)
            for r in range(2):
                wj = builder.load(builder.gep(wdata, [builder.add(rows[r], ir.Constant(rows[r].type, j))]))
                splat = builder.shuffle_vector(
                    builder.insert_element(ir.Constant(_F64x8, ir.Undefined), wj, ir.Constant(i32, 0)),
                    ir.Constant(_F64x8, ir.Undefined), zeros8)
                sums[r][j % 8] = builder.call(fma, [splat, xv, sums[r][j % 8]])
        outs = []
        for r in range(2):
            s_ = sums[r]
            g = builder.fadd(builder.fadd(builder.fadd(s_[0], s_[4]), builder.fadd(s_[1], s_[5])),
                             builder.fadd(builder.fadd(s_[2], s_[6]), builder.fadd(s_[3], s_[7])))
            outs.append(_scaled_add(builder, builder.extract_value(vacc, r), g, [sbytes[r]], 8))
        return context.make_tuple(builder, signature.return_type, outs)

    return sig, codegen
