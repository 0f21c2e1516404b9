"""The accumulation choice of formats/model/numerics.md section 2, measured: float64 sums (what
k3 computes) against float32 partial sums in the same fixed blocked order.

Prints, from one run, one thread, for a BF16 matrix 4096 x 7168 at 1, 8 and 64 tokens:
k3's ``bf16.matmul`` (float64 lanes, the dot16 order) and a float32 variant written here
for the comparison only (16 float32 partial sums in one 16-lane vector, widened BF16 times
float32 by fused multiply-add, four rows x two tokens per pass, the same reduction tree
over the 16 lanes): GFLOP/s, and the error of each against the exact float64 product
(max |y - exact| / sum |w| |x| over the rows, and the share of rows whose float32 output
differs from the float64 path's). numpy's sgemm and dgemm at the same shape, same run,
for the bounds a library reaches.

    python bench/accumulation.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # BLAS on one core
    os.environ[_v] = "1"

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic, models, register_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402
from kernels import timeit  # noqa: E402

from libk3.kernels import bf16  # noqa: E402

_F32 = ir.FloatType()
_V = ir.VectorType(_F32, 16)


class F32x16Type(types.Type):
    def __init__(self):
        super().__init__(name="f32x16")


f32x16 = F32x16Type()


@register_model(F32x16Type)
class _Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V)


@intrinsic
def _zero(typingctx):
    return f32x16(), lambda c, b, s, a: ir.Constant(_V, [0.0] * 16)


@intrinsic
def _fma(typingctx, acc, w, i, x, j):
    """acc + widen(w[i:i+16]) * x[j:j+16] (BF16 bits, float32), one f32 rounding a lane."""
    sig = f32x16(acc, w, i, x, j)

    def codegen(context, builder, signature, args):
        vacc, vw, vi, vx, vj = args
        _, tw, ti, tx, tj = signature.args

        def load(aryty, ary, ity, idx, elem, n):
            a = context.make_array(aryty)(context, builder, ary)
            p = builder.gep(a.data, [context.cast(builder, idx, ity, types.intp)])
            return builder.load(builder.bitcast(p, ir.VectorType(elem, n).as_pointer()), align=2)
        raw = load(tw, vw, ti, vi, ir.IntType(16), 16)
        i32 = ir.VectorType(ir.IntType(32), 16)
        wv = builder.bitcast(builder.shl(builder.zext(raw, i32), ir.Constant(i32, [16] * 16)), _V)
        xv = load(tx, vx, tj, vj, _F32, 16)
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V, [_V, _V, _V]),
                                           "llvm.fma.v16f32")
        return builder.call(f, [wv, xv, vacc])

    return sig, codegen


@intrinsic
def _lane(typingctx, v, k):
    return types.float32(v, k), lambda c, b, s, a: b.extract_element(a[0], a[1])


@njit(inline="always")
def _reduce(v):
    b0 = (_lane(v, 0) + _lane(v, 4)) + (_lane(v, 8) + _lane(v, 12))
    b1 = (_lane(v, 1) + _lane(v, 5)) + (_lane(v, 9) + _lane(v, 13))
    b2 = (_lane(v, 2) + _lane(v, 6)) + (_lane(v, 10) + _lane(v, 14))
    b3 = (_lane(v, 3) + _lane(v, 7)) + (_lane(v, 11) + _lane(v, 15))
    return (b0 + b1) + (b2 + b3)


@njit(parallel=True)
def matmul_f32(W, X, Y):
    """Y[t, o] = f32 sums of widen(W[o]) * X[t], 16 f32 lanes then the tree (I % 16 == 0,
    O % 4 == 0, T even: the shapes of this benchmark)."""
    O, I = W.shape
    T = X.shape[0]
    for g in prange(O // 4):
        o = 4 * g
        for t in range(0, T, 2):
            a0 = _zero()
            a1 = _zero()
            a2 = _zero()
            a3 = _zero()
            b0 = _zero()
            b1 = _zero()
            b2 = _zero()
            b3 = _zero()
            for i in range(0, I, 16):
                a0 = _fma(a0, W[o], i, X[t], i)
                a1 = _fma(a1, W[o + 1], i, X[t], i)
                a2 = _fma(a2, W[o + 2], i, X[t], i)
                a3 = _fma(a3, W[o + 3], i, X[t], i)
                b0 = _fma(b0, W[o], i, X[t + 1], i)
                b1 = _fma(b1, W[o + 1], i, X[t + 1], i)
                b2 = _fma(b2, W[o + 2], i, X[t + 1], i)
                b3 = _fma(b3, W[o + 3], i, X[t + 1], i)
            Y[t, o] = _reduce(a0)
            Y[t, o + 1] = _reduce(a1)
            Y[t, o + 2] = _reduce(a2)
            Y[t, o + 3] = _reduce(a3)
            Y[t + 1, o] = _reduce(b0)
            Y[t + 1, o + 1] = _reduce(b1)
            Y[t + 1, o + 2] = _reduce(b2)
            Y[t + 1, o + 3] = _reduce(b3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    O, I = 4096, 7168
    Wf = rng.standard_normal((O, I), dtype=np.float32) * 0.02
    W = (Wf.view(np.uint32) >> 16).astype(np.uint16)
    W64 = (W.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    rows = []
    for T in (2, 8, 64):
        X = rng.standard_normal((T, I), dtype=np.float32)
        exact = X.astype(np.float64) @ W64.T
        mag = np.abs(X.astype(np.float64)) @ np.abs(W64).T
        Y64 = np.empty((T, O), np.float32)
        Y32 = np.empty((T, O), np.float32)
        t64, _ = timeit(lambda: bf16.matmul(W, X, Y64), a.repeat)
        t32, _ = timeit(lambda: matmul_f32(W, X, Y32), a.repeat)
        fl = 2 * O * I * T
        e64 = np.max(np.abs(Y64 - exact) / mag)
        e32 = np.max(np.abs(Y32 - exact) / mag)
        diff = np.mean(Y32.view(np.uint32) != Y64.view(np.uint32))
        rows.append([T, f"{fl / t64 / 1e9:.1f}", f"{fl / t32 / 1e9:.1f}", f"{t64 / t32:.2f}x",
                     f"{e64:.1e}", f"{e32:.1e}", f"{100 * diff:.0f} %"])
    print(table(rows, ["tokens", "f64 sums GFLOP/s (k3)", "f32 sums GFLOP/s", "f32 speed-up",
                       "f64 max rel err", "f32 max rel err", "outputs that differ"]))
    A64 = rng.standard_normal((64, I))
    B64 = rng.standard_normal((I, O))
    d, _ = timeit(lambda: A64 @ B64, a.repeat)
    A32, B32 = A64.astype(np.float32), B64.astype(np.float32)
    s, _ = timeit(lambda: A32 @ B32, a.repeat)
    print(f"numpy at 64 x {I} x {O}: dgemm {2 * 64 * I * O / d / 1e9:.1f}, sgemm "
          f"{2 * 64 * I * O / s / 1e9:.1f} GFLOP/s (one thread)")


if __name__ == "__main__":
    main()
