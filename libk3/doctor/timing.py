"""Timing k3's own kernels on this machine, for k3-doctor's per-token estimate.

Owns: how many weight bytes per second the BF16 and MXFP4 matmuls (``libk3.model.ops``)
get through for one decode step's mix of shapes, and how fast the compressed trunk's
decoder (``libk3.pack.codec``) runs. Does not own: the machine facts (memory,
CPU, disks: ``libk3.machine``, which imports no kernels) or the estimate itself
(``report``).
"""

from __future__ import annotations

import time

import numpy as np

# ---- kernels -----------------------------------------------------------------------------

KERNEL_WORKING_SET = 96 << 20      # bytes of distinct weights cycled through per shape
KERNEL_MAX_MATRIX = 256 << 20      # a larger shape is timed on a row slice of this size


def _time_shape(fn, make, rows: int, cols: int, bytes_per_elem: float, seconds: float,
                working_set: int) -> float:
    """Seconds per call of ``fn`` on a [rows, cols] matrix read from RAM (cycling through
    distinct copies totalling ``working_set``), scaled up from a row slice when the
    matrix is larger than KERNEL_MAX_MATRIX (the kernels stream rows: time ~ bytes)."""
    full = rows * cols * bytes_per_elem
    r = max(1, min(rows, int(KERNEL_MAX_MATRIX // (cols * bytes_per_elem))))
    part = r * cols * bytes_per_elem
    argsets = [make(r, cols) for _ in range(max(1, min(64, -(-working_set // int(part)))))]
    fn(*argsets[0])                                 # compile / warm up, not timed
    n, t0 = 0, time.perf_counter()
    while True:
        fn(*argsets[n % len(argsets)])
        n += 1
        el = time.perf_counter() - t0
        if el >= seconds and n >= 3:
            break
    return el / n * full / part


def measure_kernels(seconds: float = 0.3, rows: int = 2048, cols: int = 2048, *,
                    bf16_shapes: dict | None = None, mxfp4_shapes: dict | None = None,
                    working_set: int = KERNEL_WORKING_SET) -> dict:
    """Bytes of weights per second k3's own BF16 and MXFP4 kernels get through for one
    token (decode). ``bf16_shapes`` / ``mxfp4_shapes``: {(rows, cols): calls per token}
    of the model (default {(rows, cols): 1}); each figure is that mix's bytes over its
    time, so narrow matrices that run below the kernel's peak count as often as the
    model calls them. Every shape cycles through distinct matrices totalling
    ``working_set`` bytes: a decode step reads each weight from RAM once, and one matrix
    timed over and over sits in the CPU caches (~2x too fast). ``seconds`` per kernel is
    split over its shapes."""
    from ..model.ops import bf16_matmul, mxfp4_matmul

    out = {"source": "libk3 kernels", "note": None, "working_set_bytes": working_set}
    for key, fn, shapes, bpe, make in (
            ("bf16", bf16_matmul, bf16_shapes, 2.0,
             lambda r, c: (np.full((r, c), 0x3C00, np.uint16), np.ones((1, c), np.float32))),
            ("mxfp4", mxfp4_matmul, mxfp4_shapes, 17 / 32,
             lambda r, c: (np.full((r, c // 2), 0x5A, np.uint8), np.full((r, c // 32), 127, np.uint8),
                           np.ones((1, c), np.float32)))):
        shapes = shapes or {(rows, cols): 1}
        tot_bytes = tot_sec = 0.0
        for (r, c), calls in shapes.items():
            tot_sec += calls * _time_shape(fn, make, r, c, bpe, seconds / len(shapes), working_set)
            tot_bytes += calls * r * c * bpe
        out[f"{key}_bytes_per_s"] = tot_bytes / tot_sec
        out[f"{key}_shapes"] = len(shapes)
    return out


SPREAD = 0.25                      # two timings further apart than this are not trusted


def measure_kernels_twice(**kw) -> dict:
    """``measure_kernels`` twice, sampling the machine's load before each: the faster
    run's figures (what the kernels do with the CPUs to themselves), both runs as a range
    (``*_range_bytes_per_s``), the loads, and ``unreliable``: why the figures should not
    be trusted (other processes or the hypervisor took CPU time, or the two runs are more
    than SPREAD apart), else None."""
    from ..machine import cpus

    runs, loads = [], []
    for _ in range(2):
        loads.append(cpus.sample_load(0.25))
        runs.append(measure_kernels(**kw))
    out = dict(max(runs, key=lambda r: r["bf16_bytes_per_s"]))
    reasons = []
    for key in ("bf16", "mxfp4"):
        lo, hi = sorted(r[f"{key}_bytes_per_s"] for r in runs)
        out[f"{key}_range_bytes_per_s"] = [lo, hi]
        if hi > lo * (1 + SPREAD):
            reasons.append(f"two {key} timings {lo / 1e9:.2f} and {hi / 1e9:.2f} GB/s")
    busy = list(dict.fromkeys(b for load in loads for b in load.busy))
    out["load"] = [load.to_json() for load in loads]
    out["unreliable"] = "; ".join(busy + reasons) or None
    return out


def kernel_shapes(cfg) -> tuple:
    """({(rows, cols): calls per token} for the BF16 kernels, the same for MXFP4) of one
    decode step of ``cfg``: every layer's trunk matrices and lm_head; top_k routed
    experts' three matrices per MoE layer."""
    from ..io import inventory

    bf16: dict = {}
    for L in range(cfg.num_hidden_layers):
        for spec in inventory.layer_trunk(cfg, L):
            if spec.kind == inventory.MATRIX and spec.shape and len(spec.shape) == 2:
                bf16[tuple(spec.shape)] = bf16.get(tuple(spec.shape), 0) + 1
    head = (cfg.vocab_size, cfg.hidden_size)
    bf16[head] = bf16.get(head, 0) + 1
    lat, inter = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    k = len(cfg.moe_layers) * cfg.num_experts_per_token
    mxfp4 = {(inter, lat): 2 * k}
    mxfp4[(lat, inter)] = mxfp4.get((lat, inter), 0) + k
    return bf16, mxfp4


DECODE_SAMPLE_BYTES = 32 << 20     # BF16 bytes the trunk decode rate is timed on


def measure_trunk_decode(threads: int, seconds: float = 0.5, sample=None) -> dict:
    """Output bytes per second the compressed trunk's decoder (``libk3.pack.codec``)
    reaches on ``threads`` threads, and the stored fraction, on ``sample`` (uint8 BF16
    bytes; default DECODE_SAMPLE_BYTES of near-Gaussian BF16 like trained weights, std
    0.02, seed 0). Best of the passes that fit in ``seconds`` (at least 2). Without the
    blocks' CRC, as in the steady state the doctor estimates (a layer's CRC is checked on
    its first read only, by default)."""
    from ..pack.codec import Codec, plan_blocks

    if sample is None:
        f = (np.random.default_rng(0).standard_normal(DECODE_SAMPLE_BYTES // 2) * 0.02)
        sample = (f.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    plan = plan_blocks([("w", 0, sample.size, "BF16")])
    codec = Codec(threads)
    try:
        blob, rec = codec.encode(sample, plan)
        plan = plan.with_index(rec)
        src, out = np.frombuffer(blob, np.uint8), np.empty(sample.size, np.uint8)
        best, t_end, passes = None, time.perf_counter() + seconds, 0
        while passes < 2 or time.perf_counter() < t_end:
            t0 = time.perf_counter()
            codec.decode(plan, 0, len(plan), src, 0, out, False, "<sample>", 0)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
            passes += 1
    finally:
        codec.close()
    return {"decode_bytes_per_s": sample.size / best, "fraction": len(blob) / sample.size,
            "threads": threads, "sample_bytes": int(sample.size),
            "sample": "near-Gaussian BF16 (std 0.02)"}
