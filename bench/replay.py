"""Replay benchmark (issues 7 and 17): a fixed set of traces, every cache policy at every
ladder capacity, and the default policy's bytes per token against the best online one.

Owns: building the benchmark's traces, timing the replays, printing per trace the replay
tables and the default's ratio to the best of ``REFERENCES``, a summary over all traces,
and the per-request cost of the policy object k3-run drives. Does not own: the policies
(``libk3.policies``, ``libk3.trace.replay``), the synthetic traces
(``libk3.synth.traces``), the tables (``libk3.trace.report``).

Traces at the real model's shape (93 layers x 896 experts, top-16, 17,547,264 B per
expert; every layer routed), cyclic in layer order:

* decode: incremental decoding, zipf_s 0.9, locality 0.3, drift 0.02 (libk3.synth.traces'
  defaults), 10 million requests: the timed one (every policy at every capacity in
  under 60 s on 2 cores);
* zipf-1.3, zipf-0.8: independent requests with Zipf popularity (no locality, no drift);
* shifting: zipf_s 1.1, every layer's ranking drawn afresh every 100 tokens;
* recompute: the C engine's full-recompute order (every step re-runs the prefix; zipf_s
  0.9, locality 0.2), where LRU is flat up to a whole prefix of experts.

Traces recorded with ``k3-run --trace`` (resident, sampled prompts, fixed seeds) on the
``tiny`` fixture and a ``small`` synthetic checkpoint, into scratch/ on first use. Their
capacities keep the real model's share of the expert pool: a GB of the ladder caches
GB / 1,446.5 of the experts (92 MoE layers x 896 x 17,547,264 B), so the trace's expert
size is replaced by 1,446.5 GB / its pool. Random weights route differently from a
trained router; these traces show k3-run's request pattern, not K3's popularity.

The synthetic popularity, locality, drift and shifts are assumptions, not measurements
of the real router.

    python bench/replay.py [--requests 10000000] [--other-requests 3000000] [--jobs 2]
                           [--only decode,zipf-1.3,...]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, ROOT, checkpoint, run  # noqa: E402

from libk3.policies import registry  # noqa: E402
from libk3.trace import replay as cache_policy  # noqa: E402
from libk3.policies.registry import DEFAULT_POLICY  # noqa: E402
from libk3.stream.policy import make_policy  # noqa: E402
from libk3.trace.format import TraceReader  # noqa: E402
from libk3.trace.report import format_replay, replay_keys_report  # noqa: E402
from libk3.synth.traces import synth_keys, synth_recompute_keys  # noqa: E402
from libk3.k3_dims import EXPERT_BYTES, N_EXPERTS, N_LAYERS, TOP_K  # noqa: E402

REAL_POOL_BYTES = (N_LAYERS - 1) * N_EXPERTS * EXPERT_BYTES   # the MoE layers' experts, 1,446.5 GB
REFERENCES = ("lru", "s3fifo", "lfu", "layer-lfu")  # the default is held to their best
LADDER_GB = (8, 16, 32, 64, 128, 192, 256)         # capacities at the real model's scale
TARGET = 1.02
COST_REQUESTS = 200_000                             # requests fed to the live object
COST_GB = 64


def _synthetic(name, n_requests, seed):
    """-> (keys, tokens, description) of a synthetic trace at the real shape."""
    per_token = N_LAYERS * TOP_K
    n = max(1, n_requests // per_token)
    shape = dict(n_layers=N_LAYERS, n_experts=N_EXPERTS, top_k=TOP_K, seed=seed)
    if name == "decode":
        return synth_keys(n, **shape), n, "zipf_s 0.9, locality 0.3, drift 0.02"
    if name in ("zipf-1.3", "zipf-0.8"):
        s = float(name.split("-")[1])
        return (synth_keys(n, zipf_s=s, locality=0.0, drift=0.0, **shape), n,
                f"zipf_s {s:g}, independent requests")
    if name == "shifting":
        return (synth_keys(n, zipf_s=1.1, locality=0.0, drift=0.0, shift_every=100, **shape),
                n, "zipf_s 1.1, every ranking redrawn every 100 tokens")
    if name == "recompute":
        prompt = 8      # steps s = prompt .. T each request s * per_token keys; solve for T
        total = n_requests / per_token + prompt * (prompt - 1) / 2
        T = max(prompt, int((math.sqrt(1 + 8 * total) - 1) / 2))
        keys = synth_recompute_keys(prompt, T, zipf_s=0.9, locality=0.2, drift=0.0, **shape)
        return keys, T - prompt + 1, f"prompt {prompt}, {T} tokens, zipf_s 0.9, locality 0.2"
    raise KeyError(name)


SYNTHETIC = ("decode", "zipf-1.3", "zipf-0.8", "shifting", "recompute")
RECORDED = {                  # name -> (model, prompts, tokens generated per prompt)
    "recorded-tiny": ("tiny", 6, 200),
    "recorded-small": ("small", 2, 150),
}


def _recorded(name):
    """-> (TraceReader, description): k3-run's trace on a synthetic model, recorded on
    first use (sampled continuations of fixed id prompts, fixed seeds)."""
    model, prompts, gen = RECORDED[name]
    path = DATA / f"{name}.k3trace"
    if not path.exists():
        ckpt = ROOT / "fixtures" / "tiny" if model == "tiny" else checkpoint(model)
        DATA.mkdir(parents=True, exist_ok=True)
        batch = DATA / f"{name}.jsonl"
        batch.write_text("".join(
            f'{{"id": "p{i}", "ids": [{", ".join(str(5 + (37 * i + 11 * j) % 400) for j in range(8 + i))}], '
            f'"gen": {gen}, "temperature": 0.8, "seed": {i}}}\n' for i in range(prompts)))
        out = DATA / f"{name}.results.jsonl"
        out.unlink(missing_ok=True)
        print(f"[setup] recording {path} (k3-run on {model}) ...", flush=True)
        run(["k3-run", ckpt, "--resident", "--batch", batch, "--out", out, "--trace", path])
    return TraceReader(path), f"k3-run on {model}: {prompts} prompts x {gen} tokens, temperature 0.8"


def _report(keys, tokens, jobs, *, n_layers, n_experts, top_k, expert_bytes):
    policies = list(registry.POLICIES)
    return replay_keys_report(keys, n_layers=n_layers, n_experts=n_experts, top_k=top_k,
                              expert_bytes=expert_bytes, tokens=tokens,
                              tokens_estimated=False, policies=policies,
                              capacities_gb=LADDER_GB, workers=jobs)


def _ratios(rep):
    """[(capacity GB, best reference, its GB/token, default's GB/token, ratio)]."""
    out = []
    for r in rep["capacities"]:
        c = r["policies"]
        best = min(REFERENCES, key=lambda p: c[p]["misses"])
        b, d = c[best]["misses"], c[DEFAULT_POLICY]["misses"]
        out.append((r["capacity_gb"], best, c[best]["gb_read_per_token"],
                    c[DEFAULT_POLICY]["gb_read_per_token"], d / b if b else 1.0))
    return out


def _print_trace(name, desc, rep, wall):
    print(f"\n=== {name}: {desc}; {rep['requests']:,} requests, {rep['tokens']:,} tokens ===")
    print(f"replay wall time {wall:.1f} s; per policy, summed over capacities (thread CPU, "
          "then wall; lru, s3fifo, lfu and layer-lfu are adaptive's shadows, replayed "
          "inside it):")
    for p in rep["policies"]:
        if rep["replay_cpu_seconds"][p] > 0:
            print(f"  {p:<10} {rep['replay_cpu_seconds'][p]:6.2f} s CPU  "
                  f"{rep['replay_seconds'][p]:6.2f} s wall")
    print()
    print(format_replay(rep))
    print(f"\n{DEFAULT_POLICY} vs the best of {', '.join(REFERENCES)} (GB read per token):")
    print(f"{'CACHE GB':>9} {'BEST':>10} {'ITS GB':>8} {DEFAULT_POLICY.upper() + ' GB':>12} "
          f"{'RATIO':>7}  FOLLOWED")
    for (gb, best, bgb, dgb, ratio), r in zip(_ratios(rep), rep["capacities"]):
        followed = r["policies"][DEFAULT_POLICY].get("followed", "")
        print(f"{gb:>9g} {best:>10} {bgb:>8.3f} {dgb:>12.3f} {ratio:>7.4f}  {followed}")


def _online_cost(keys, jobs):
    """us per request of the object k3-run's expert cache calls, one layer visit a call."""
    slots = COST_GB * 10**9 // EXPERT_BYTES
    visits = keys[:COST_REQUESTS].reshape(-1, TOP_K)
    rows = []
    for name in registry.ONLINE_OBJECT_POLICIES:
        pol = make_policy(name, slots, N_LAYERS, N_EXPERTS)
        pol.access(visits[0])                    # compile / load outside the timing
        t0, c0 = time.perf_counter(), time.thread_time()
        for v in visits[1:]:
            pol.access(v)
        n = (visits.shape[0] - 1) * TOP_K
        rows.append((name, 1e6 * (time.perf_counter() - t0) / n,
                     1e6 * (time.thread_time() - c0) / n))
    print(f"\nonline object (libk3.stream.policy, one call per layer visit of {TOP_K} experts, "
          f"{COST_GB} GB = {slots:,} slots, {visits.shape[0] - 1:,} visits of the decode trace):")
    for name, wall, cpu in rows:
        print(f"  {name:<10} {wall:6.2f} us/request wall, {cpu:6.2f} us CPU (target < 2 us)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=10_000_000, help="size of the decode trace")
    ap.add_argument("--other-requests", type=int, default=3_000_000,
                    help="size of the other synthetic traces")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help="comma-separated trace names")
    args = ap.parse_args()
    names = [*SYNTHETIC, *RECORDED]
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    t_start = time.perf_counter()
    summary = []
    for name in names:
        t0 = time.perf_counter()
        if name in RECORDED:
            reader, desc = _recorded(name)
            h, recs = reader.header, reader.read_all()
            keys = recs["layer"].astype(np.int64) * h.n_experts + recs["expert"]
            pool = len(np.unique(recs["layer"])) * h.n_experts
            tokens = len(np.unique((recs["seq"].astype(np.int64) << 32) | recs["pos"]))
            shape = dict(n_layers=h.n_layers, n_experts=h.n_experts, top_k=h.top_k,
                         expert_bytes=REAL_POOL_BYTES // pool)
            desc += f"; {pool} experts in the pool, {REAL_POOL_BYTES // pool:,} B each"
        else:
            keys, tokens, desc = _synthetic(
                name, args.requests if name == "decode" else args.other_requests, args.seed)
            shape = dict(n_layers=N_LAYERS, n_experts=N_EXPERTS, top_k=TOP_K,
                         expert_bytes=EXPERT_BYTES)
        gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        rep = _report(keys, tokens, args.jobs, **shape)
        wall = time.perf_counter() - t0
        _print_trace(name, desc, rep, wall)
        if name == "decode":
            print(f"\ndecode trace: generation {gen:.1f} s + replay of every policy at every "
                  f"capacity {wall:.1f} s = {gen + wall:.1f} s on {args.jobs} thread(s) "
                  "(target < 60 s on 2 cores)")
            _online_cost(keys, args.jobs)
        summary += [(name, *row) for row in _ratios(rep)]
    print(f"\n=== {DEFAULT_POLICY} / best of {', '.join(REFERENCES)}, GB read per token "
          f"(target <= {TARGET}) ===")
    caps = sorted({s[1] for s in summary})
    print(f"{'trace':<15}" + "".join(f"{c:>8g}" for c in caps))
    for name in dict.fromkeys(s[0] for s in summary):
        cells = {s[1]: s[5] for s in summary if s[0] == name}
        print(f"{name:<15}" + "".join(f"{cells[c]:>8.4f}" if c in cells else f"{'-':>8}"
                                      for c in caps))
    worst = max(summary, key=lambda s: s[5])
    over = [s for s in summary if s[5] > TARGET]
    print(f"worst {worst[5]:.4f} ({worst[0]}, {worst[1]:g} GB, best {worst[2]}); "
          + (f"{len(over)} cell(s) over {TARGET}" if over else f"every cell <= {TARGET}"))
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
