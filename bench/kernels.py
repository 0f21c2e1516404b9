"""Benchmark: the numba kernels at K3's real dimensions, against plain numpy and memory.

What it does, in one run:
1. Measures the machine's single-pass read bandwidth: one pass over a 512 MB float32
   array, by numpy's ``sum`` (one thread) and by a numba loop over the numba threads;
   the larger of the two is the reference.
2. Times each kernel at real dims (best and median of --repeat runs) and the same op in
   plain numpy measured in the same run:
   * BF16 matvec 12288 x 7168 (``bf16.matvec``; numpy: widen to f32, then ``W @ x``);
   * MXFP4 matvec 3072 x 3584 and 3584 x 3072 (``mxfp4.matvec``; numpy: decode, ``@``);
   * one KDA decode step, 96 heads x 128 x 128 (``kda.kda_recurrence``; numpy: einsum);
   * MLA decode attention over 4096 cached positions, 96 heads, r_kv 512, rope 64,
     nope 128, v 128, BF16 kv_b_proj (``mla.mla_attention``; numpy: absorbed form).
3. Prints ms, GFLOP/s, GB/s of bytes read (weights; for KDA the state read and written;
   for MLA kv_b_proj plus the cache) and that GB/s as a fraction of the bandwidth.

Targets (issue 8): match or beat the public C engine's AVX2 kernels on a 2-core machine,
BF16 12288 x 7168 12.8 ms and MXFP4 3072 x 3584 1.41 ms (printed in the last column as
k3 time / C engine time: at most 1.00). The dev machine
is shared, so single runs are noisy: compare best-of-N, and rerun before concluding.

    python bench/kernels.py [--repeat 7] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numba
import numpy as np
from numba import njit, prange

from libk3.io import mxfp4 as io_mxfp4
from libk3.io.dtypes import bf16_to_f32
from libk3.kernels import bf16, kda, mla, mxfp4
from libk3.kernels._simd import vfma, vlane, vzero


@njit(parallel=True)
def _read_once(a, ones, partial):
    """Touch every element of a once (4 independent 8-lane sums per chunk)."""
    chunk = a.shape[0] // partial.shape[0]
    for c in prange(partial.shape[0]):
        seg = a[c * chunk:(c + 1) * chunk]
        s0 = vzero()
        s1 = vzero()
        s2 = vzero()
        s3 = vzero()
        for i in range(0, chunk - 31, 32):
            s0 = vfma(s0, seg, i, ones, 0)
            s1 = vfma(s1, seg, i + 8, ones, 0)
            s2 = vfma(s2, seg, i + 16, ones, 0)
            s3 = vfma(s3, seg, i + 24, ones, 0)
        tot = 0.0
        for lane in range(8):                          # use every lane: nothing is dead code
            tot += vlane(s0, lane) + vlane(s1, lane) + vlane(s2, lane) + vlane(s3, lane)
        partial[c] = tot


def timeit(fn, repeat):
    fn()                                               # compile / warm caches
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def bandwidth(repeat):
    a = np.ones(128 * 1024 * 1024, dtype=np.float32)    # 512 MB
    ones = np.ones(8, dtype=np.float32)
    partial = np.empty(256)
    np_best, _ = timeit(lambda: a.sum(), repeat)
    nb_best, _ = timeit(lambda: _read_once(a, ones, partial), repeat)
    return a.nbytes / np_best / 1e9, a.nbytes / nb_best / 1e9


def cases(rng):
    out = []

    O, I = 12288, 7168
    W = (rng.standard_normal((O, I), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    x = rng.standard_normal(I, dtype=np.float32)
    y = np.empty(O, np.float32)
    out.append(("BF16 matvec 12288x7168", 2 * O * I, W.nbytes,
                lambda: bf16.matvec(W, x, y), lambda: bf16_to_f32(W) @ x))

    for R, C in ((3072, 3584), (3584, 3072)):
        P, S = io_mxfp4.encode(rng.standard_normal((R, C)).astype(np.float32) * 0.02)
        xm = rng.standard_normal(C, dtype=np.float32)
        ym = np.empty(R, np.float32)
        out.append((f"MXFP4 matvec {R}x{C}", 2 * R * C, P.nbytes + S.nbytes,
                    lambda P=P, S=S, xm=xm, ym=ym: mxfp4.matvec(P, S, xm, ym),
                    lambda P=P, S=S, xm=xm: io_mxfp4.decode(P, S) @ xm))

    H, D = 96, 128
    q, k, v = (rng.standard_normal((1, H, D), dtype=np.float32) for _ in range(3))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    alpha = rng.uniform(0.9, 1.0, (1, H, D)).astype(np.float32)
    beta = rng.uniform(0, 1, (1, H)).astype(np.float32)
    Sk = np.zeros((H, D, D), np.float32)
    ok = np.empty((1, H, D), np.float32)
    Sn = np.zeros((H, D, D), np.float32)

    def kda_numpy():
        Sn[:] *= alpha[0, :, :, None]
        u = np.einsum("hi,hij->hj", k[0], Sn)
        Sn[:] += (k[0] * beta[0][:, None])[:, :, None] * (v[0] - u)[:, None, :]
        return np.einsum("hi,hij->hj", q[0] * np.float32(D ** -0.5), Sn)

    out.append(("KDA decode step 96x128x128", 8 * H * D * D, 2 * Sk.nbytes,
                lambda: kda.kda_recurrence(q, k, v, alpha, beta, D ** -0.5, Sk, ok), kda_numpy))

    nope, rope, vd, r, Tc = 128, 64, 128, 512, 4096
    latent = rng.standard_normal((Tc, r), dtype=np.float32)
    k_rope = rng.standard_normal((Tc, rope), dtype=np.float32)
    kv_b = ((rng.standard_normal((H * (nope + vd), r), dtype=np.float32) * 0.05)
            .view(np.uint32) >> 16).astype(np.uint16)
    qn = rng.standard_normal((1, H, nope), dtype=np.float32)
    qr = rng.standard_normal((1, H, rope), dtype=np.float32)
    pos = np.array([Tc - 1], np.int64)
    oa = np.empty((1, H, vd), np.float32)
    scale = (nope + rope) ** -0.5

    def mla_numpy():
        Wkv = bf16_to_f32(kv_b).reshape(H, nope + vd, r)
        qbar = np.einsum("hd,hdc->hc", qn[0], Wkv[:, :nope])
        sc = (qbar @ latent.T + qr[0] @ k_rope.T) * np.float32(scale)
        p = np.exp(sc - sc.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        return np.einsum("hjc,hc->hj", Wkv[:, nope:], p @ latent)

    flops = 2 * H * (nope * r + Tc * (r + rope) + Tc * r + vd * r)
    out.append(("MLA decode, 4096 positions", flops, kv_b.nbytes + latent.nbytes + k_rope.nbytes,
                lambda: mla.mla_attention(qn, qr, pos, latent, k_rope, kv_b, scale, oa), mla_numpy))
    return out


# The public C engine's measured times on a 2-core machine (as it publishes them; issue 8).
C_ENGINE_MS = {"BF16 matvec 12288x7168": 12.8, "MXFP4 matvec 3072x3584": 1.41}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"numba {numba.__version__}, numpy {np.__version__}, "
          f"numba threads {numba.get_num_threads()}")
    print("load average at start: %.2f %.2f %.2f (other processes make every number noisy)"
          % os.getloadavg())
    bw_np, bw_nb = bandwidth(args.repeat)
    bw = max(bw_np, bw_nb)
    print(f"single-pass read bandwidth: numpy sum (1 thread) {bw_np:.1f} GB/s, numba read "
          f"({numba.get_num_threads()} threads) {bw_nb:.1f} GB/s -> reference {bw:.1f} GB/s")
    print()
    head = (f"{'op':30s} {'k3 best':>8s} {'median':>8s} {'GFLOP/s':>8s} {'GB/s':>6s} "
            f"{'of BW':>6s} | {'numpy':>8s} {'GFLOP/s':>8s} {'k3 speedup':>10s} | "
            f"{'C engine':>8s} {'k3/C':>5s}")
    print(head)
    print("-" * len(head))
    for name, flops, nbytes, k3_fn, np_fn in cases(np.random.default_rng(0)):
        kb, km = timeit(k3_fn, args.repeat)
        nb, _ = timeit(np_fn, max(3, args.repeat // 2))
        gbs = nbytes / kb / 1e9
        print(f"{name:30s} {kb * 1e3:7.2f}ms {km * 1e3:7.2f}ms {flops / kb / 1e9:8.1f} "
              f"{gbs:6.1f} {gbs / bw:6.2f} | {nb * 1e3:7.2f}ms {flops / nb / 1e9:8.1f} "
              f"{nb / kb:9.1f}x | " + (f"{C_ENGINE_MS[name]:6.2f}ms {kb * 1e3 / C_ENGINE_MS[name]:5.2f}"
                                      if name in C_ENGINE_MS else f"{'-':>8s} {'-':>5s}"))
    print("load average at end: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
