"""The roofline of this CPU and where every k3 kernel sits under it, one core.

Prints, from one run:
1. This core's bounds: the float64 and float32 fused multiply-add peak (a numba
   micro-kernel of twelve independent 512-bit FMA chains, no loads: GFLOP/s per core) and
   the memory read bandwidth of one pass over 512 MB (``bench/kernels.py``'s measure; the
   larger of numpy's and a numba loop's). For comparison, numpy's BLAS (dgemm, sgemm) at
   64 x 7168 x 4096.
2. Every kernel at Kimi K3's dimensions: BF16 matmul 12288 x 7168 at 1/2/8/64 tokens,
   MXFP4 3072 x 3584 at 1/2/8/32 tokens, one KDA step (96 heads x 128 x 128), MLA over
   4,096 positions, the router (896 x 7168 and top-16), RMSNorm and SiTU over 64 x 7168:
   GFLOP/s per core, GB/s of bytes read, and the fraction of the bound that applies (the
   larger of the FMA time at the float64 peak and the read time at the bandwidth: 1.00 is
   at the roof).
3. With --stages: a stage breakdown of one `real-dims` prefill pass (64 tokens) and one
   width-8 lockstep decode pass, resident, at one thread and at --threads: CPU seconds per
   kernel of ``libk3.model.ops`` and the time outside them (Python, numpy glue), each as
   a share of the pass; the wall-time speed-up of each stage at --threads shows what
   stays serial.

    python bench/roofline.py [--repeat 5] [--stages] [--threads 2]

One thread unless --threads; the machine is shared: compare within one run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numba
import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import checkpoint, table  # noqa: E402
from kernels import bandwidth, timeit  # noqa: E402
from kernels import cases as kernels_cases  # noqa: E402

from libk3.io import mxfp4 as io_mxfp4  # noqa: E402
from libk3.kernels import activations, bf16, mxfp4, norms, router  # noqa: E402

CHAINS = 12      # independent FMA chains: more than latency x issue width on current cores


def _burn_intrinsic(elem, lanes):
    vec = ir.VectorType(elem, lanes)

    @intrinsic
    def burn(typingctx, n):
        """CHAINS vectors of ``lanes`` lanes, each a = a * b + c, n times; returns lane 0
        of their sum (so nothing is dead code)."""
        if not isinstance(n, types.Integer):
            return None
        ret = types.float64

        def codegen(context, builder, signature, args):
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                f"llvm.fma.v{lanes}{'f64' if elem == ir.DoubleType() else 'f32'}")
            slots = [cgutils.alloca_once(builder, vec) for _ in range(CHAINS)]
            for k, s in enumerate(slots):
                builder.store(ir.Constant(vec, [1.0 + k * 1e-3] * lanes), s)
            b = ir.Constant(vec, [0.999999] * lanes)
            c = ir.Constant(vec, [1e-7] * lanes)
            with cgutils.for_range(builder, args[0]):
                for s in slots:
                    builder.store(builder.call(fma, [builder.load(s), b, c]), s)
            tot = builder.load(slots[0])
            for s in slots[1:]:
                tot = builder.fadd(tot, builder.load(s))
            v = builder.extract_element(tot, ir.Constant(ir.IntType(32), 0))
            return v if elem == ir.DoubleType() else builder.fpext(v, ir.DoubleType())

        return ret(n), codegen

    return burn


_burn64 = _burn_intrinsic(ir.DoubleType(), 8)
_burn32 = _burn_intrinsic(ir.FloatType(), 16)


@njit
def _peak64(n):
    return _burn64(n)


@njit
def _peak32(n):
    return _burn32(n)


def fma_peaks(repeat):
    """(float64, float32) GFLOP/s of one core: 2 flops x lanes x chains per iteration."""
    n = 20_000_000
    out = []
    for fn, lanes in ((_peak64, 8), (_peak32, 16)):
        best, _ = timeit(lambda: fn(n), repeat)
        out.append(2 * lanes * CHAINS * n / best / 1e9)
    return out


def blas(repeat):
    rng = np.random.default_rng(0)
    res = []
    for dt in (np.float64, np.float32):
        A = rng.standard_normal((64, 7168)).astype(dt)
        B = rng.standard_normal((7168, 4096)).astype(dt)
        best, _ = timeit(lambda: A @ B, repeat)
        res.append(2 * 64 * 7168 * 4096 / best / 1e9)
    return res


def bf16_bits(a):
    return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def cases(rng):
    """(name, flops, bytes read, call)."""
    out = []
    O, I = 12288, 7168
    W = bf16_bits(rng.standard_normal((O, I), dtype=np.float32))
    for T in (1, 2, 8, 64):
        X = rng.standard_normal((T, I), dtype=np.float32)
        Y = np.empty((T, O), np.float32)
        out.append((f"BF16 matmul {O}x{I}, {T} token(s)", 2 * O * I * T, W.nbytes + X.nbytes,
                    lambda W=W, X=X, Y=Y: bf16.matmul(W, X, Y)))
    R, C = 3072, 3584
    P, S = io_mxfp4.encode(rng.standard_normal((R, C)).astype(np.float32) * 0.02)
    for T in (1, 2, 8, 32):
        X = rng.standard_normal((T, C), dtype=np.float32)
        Y = np.empty((T, R), np.float32)
        out.append((f"MXFP4 matmul {R}x{C}, {T} token(s)", 2 * R * C * T,
                    P.nbytes + S.nbytes + X.nbytes, lambda X=X, Y=Y: mxfp4.matmul(P, S, X, Y)))
    for name, flops, nbytes, call, _ in kernels_cases(rng):       # bench/kernels.py's
        if name.startswith(("KDA", "MLA")):
            out.append((name, flops, nbytes, call))
    N, E, K = 896, 7168, 16
    Wr = bf16_bits(rng.standard_normal((N, E), dtype=np.float32))
    xr = rng.standard_normal((1, E), dtype=np.float32)
    lg = np.empty((1, N), np.float32)
    bias = rng.standard_normal(N).astype(np.float32) * 0.01
    idx = np.empty((1, K), np.int64)
    wts = np.empty((1, K), np.float32)

    def route():
        bf16.matmul(Wr, xr, lg)
        router.router_topk(lg, bias, K, True, 1.0, idx, wts)
    out.append(("router 896x7168 + top-16, 1 token", 2 * N * E, Wr.nbytes, route))
    Xn = rng.standard_normal((64, E), dtype=np.float32)
    wn = rng.standard_normal(E).astype(np.float32)
    On = np.empty_like(Xn)
    out.append(("RMSNorm 64x7168", 3 * Xn.size, Xn.nbytes,
                lambda: norms.rmsnorm(Xn, wn, 1e-5, On)))
    G = rng.standard_normal(64 * 3072).astype(np.float32)
    U = rng.standard_normal(64 * 3072).astype(np.float32)
    Os = np.empty_like(G)
    out.append(("SiTU 64x3072", 12 * G.size, G.nbytes + U.nbytes,
                lambda: activations.situ(G, U, 4.0, 25.0, Os)))
    return out


def kernels_section(peak64, bw, repeat):
    rng = np.random.default_rng(0)
    rows = []
    for name, flops, nbytes, call in cases(rng):
        best, _ = timeit(call, repeat)
        bound = max(flops / (peak64 * 1e9), nbytes / (bw * 1e9))
        which = "FMA" if flops / (peak64 * 1e9) >= nbytes / (bw * 1e9) else "bandwidth"
        rows.append([name, f"{best * 1e3:.3f}", f"{flops / best / 1e9:.1f}",
                     f"{100 * flops / best / 1e9 / peak64:.0f} %", f"{nbytes / best / 1e9:.1f}",
                     which, f"{bound / best:.2f}"])
    print(table(rows, ["kernel (1 thread)", "ms", "GFLOP/s", "of f64 peak", "GB/s read",
                       "bound", "of bound"]))


_STAGES = r"""
import collections, json, sys, time
import numba
numba.set_num_threads(int(sys.argv[2]))
from libk3.engine.session import open_session
from libk3.model import ops
from libk3.model.state import State
from libk3.model.forward import Segment
spent = collections.Counter()
wall = collections.Counter()
for name in [n for n in dir(ops) if callable(getattr(ops, n)) and not n.startswith("_")
             and getattr(getattr(ops, n), "__module__", "") == ops.__name__]:
    fn = getattr(ops, name)
    def timed(*a, _fn=fn, _name=name, **kw):
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            return _fn(*a, **kw)
        finally:
            spent[_name] += time.process_time() - c0
            wall[_name] += time.perf_counter() - w0
    setattr(ops, name, timed)
s = open_session(sys.argv[1])
out = {}
prompt = [(37 * i) % 150000 + 11 for i in range(64)]
for rep in range(2):                        # the first pass fills caches and compiles
    st = s.new_state()
    spent.clear()
    wall.clear()
    c0, w0 = time.process_time(), time.perf_counter()
    s.forward.run([Segment(prompt, st, all_logits=False)])
    total, wtotal = time.process_time() - c0, time.perf_counter() - w0
out["prefill"] = {"cpu": dict(spent, total=total), "wall": dict(wall, total=wtotal)}
states = []
for i in range(8):
    st = s.new_state()
    s.forward.run([Segment([(97 * i + 13 * j) % 150000 + 5 for j in range(16)], st,
                           all_logits=False)])
    states.append(st)
spent.clear()
wall.clear()
c0, w0 = time.process_time(), time.perf_counter()
s.forward.run([Segment([7 + i], states[i], all_logits=False, phase="decode") for i in range(8)])
out["lockstep8"] = {"cpu": dict(spent, total=time.process_time() - c0),
                    "wall": dict(wall, total=time.perf_counter() - w0)}
print(json.dumps(out))
"""


def stages_section(threads):
    import json
    import subprocess
    ckpt = checkpoint("real-dims")
    res = {}
    for n in sorted({1, threads}):
        p = subprocess.run([sys.executable, "-c", _STAGES, str(ckpt), str(n)],
                           capture_output=True, text=True)
        if p.returncode != 0:
            sys.stderr.write(p.stderr)
            raise SystemExit("the stage run failed")
        res[n] = json.loads(p.stdout.splitlines()[-1])
    for what in ("prefill", "lockstep8"):
        one = res[1][what]["cpu"]
        names = sorted((k for k in one if k != "total"), key=lambda k: -one[k])

        def wall_of(n, k):
            w = res[n][what]["wall"]
            return w["total"] - sum(w.get(x, 0.0) for x in names) if k is None else w.get(k, 0.0)
        rows = []
        for k in names + [None]:
            v = one["total"] - sum(one[x] for x in names) if k is None else one[k]
            row = [k or "(outside kernels)", f"{v:.3f}", f"{100 * v / one['total']:.1f} %"]
            if threads != 1:
                w1, wn = wall_of(1, k), wall_of(threads, k)
                row.append(f"{w1 / wn:.2f}x" if wn > 0 else "-")
            rows.append(row)
        label = ("real-dims prefill pass, 64 tokens" if what == "prefill"
                 else "real-dims lockstep pass, width 8 (decode)")
        heads = [label, "CPU s (1 thread)", "share"]
        if threads != 1:
            heads.append(f"wall speed-up at {threads} threads")
        print(table(rows, heads))
        tail = ""
        if threads != 1:
            tail = (f"; wall {res[1][what]['wall']['total']:.3f} s at 1 thread, "
                    f"{res[threads][what]['wall']['total']:.3f} s at {threads}")
        print(f"pass total: {one['total']:.3f} CPU s at 1 thread{tail}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--stages", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    numba.set_num_threads(1)
    p64, p32 = fma_peaks(a.repeat)
    bw_np, bw_nb = bandwidth(a.repeat)
    bw = max(bw_np, bw_nb)
    b64, b32 = blas(a.repeat)
    print(f"one core: FMA peak float64 {p64:.1f} GFLOP/s, float32 {p32:.1f} GFLOP/s; "
          f"read bandwidth {bw:.1f} GB/s (numpy {bw_np:.1f}, numba {bw_nb:.1f}); "
          f"numpy BLAS at 64x7168x4096: dgemm {b64:.1f}, sgemm {b32:.1f} GFLOP/s\n")
    kernels_section(p64, bw, a.repeat)
    print()
    if a.stages:
        stages_section(a.threads)


if __name__ == "__main__":
    main()
