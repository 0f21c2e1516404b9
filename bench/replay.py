"""Replay benchmark (issue 7): every cache policy at every ladder capacity on synthetic
cyclic layer-ordered traces, timed.

Owns: choosing the synthetic traces, timing, and printing the tables and the chosen online
policy's gain over LRU where LRU is flat. Does not own: the policies
(``libk3.cache_policy``), the traces (``libk3.trace_synth``) or the tables
(``libk3.trace_report``).

Two traces at the real model's shape (93 layers x 896 experts, top-16, 17,547,264 B per
expert), both cyclic in layer order:

* decode: incremental decoding, 10 million requests by default (what k3-run does);
* recompute: the same kind of routing replayed in the C engine's full-recompute order, the
  regime of its published table where LRU is flat from 8 to 64 GB (PRIOR-ART.md 9).

The synthetic popularity skew, locality and drift are assumptions (libk3/trace_synth.py),
not measurements of the real router. Target (issue 7): the decode trace's full grid in
under a minute on 2 cores.

    python bench/replay.py [--requests 10000000] [--recompute-requests 3000000] [--jobs 2]
"""

from __future__ import annotations

import argparse
import math
import os
import time

from libk3 import cache_policy
from libk3.trace_report import format_replay, replay_keys_report
from libk3.trace_synth import synth_keys, synth_recompute_keys

N_LAYERS, N_EXPERTS, TOP_K, EXPERT_BYTES = 93, 896, 16, 17547264
CHOSEN = "layer-lfu"            # the online policy this project recommends over LRU
FLAT_POINTS = 0.5               # LRU counts as flat while within this many points of its first row


def _run(name, keys, tokens, jobs):
    t0 = time.perf_counter()
    rep = replay_keys_report(keys, n_layers=N_LAYERS, n_experts=N_EXPERTS, top_k=TOP_K,
                             expert_bytes=EXPERT_BYTES, tokens=tokens, tokens_estimated=False,
                             policies=list(cache_policy.POLICIES), workers=jobs)
    wall = time.perf_counter() - t0
    print(f"\n=== {name}: {keys.size:,} requests, {tokens:,} token steps ===")
    print(f"replay wall time {wall:.1f} s on {jobs} thread(s); time per policy summed "
          "over capacities (thread CPU, then wall, which includes waiting for a core):")
    for p in rep["policies"]:
        print(f"  {p:<10} {rep['replay_cpu_seconds'][p]:6.2f} s CPU  "
              f"{rep['replay_seconds'][p]:6.2f} s wall")
    print()
    print(format_replay(rep))
    _gain(rep)


def _gain(rep):
    rows = rep["capacities"]
    lru = [r["policies"]["lru"]["hit_rate_pct"] for r in rows]
    flat = [r for r, h in zip(rows, lru) if abs(h - lru[0]) <= FLAT_POINTS]
    print(f"\n{CHOSEN} vs lru where lru is flat (within {FLAT_POINTS} points of its "
          f"{rows[0]['capacity_gb']:g} GB value):")
    for r in flat:
        c = r["policies"]
        gain = c[CHOSEN]["hit_rate_pct"] - c["lru"]["hit_rate_pct"]
        gap = c["belady"]["hit_rate_pct"] - c["lru"]["hit_rate_pct"]
        share = f", {100 * gain / gap:.0f} % of the lru-belady gap closed" if gap > 0 else ""
        print(f"  {r['capacity_gb']:g} GB: lru {c['lru']['hit_rate_pct']:.2f} %, "
              f"{CHOSEN} {c[CHOSEN]['hit_rate_pct']:.2f} % (+{gain:.2f} points{share}), "
              f"belady {c['belady']['hit_rate_pct']:.2f} %")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=10_000_000)
    ap.add_argument("--recompute-requests", type=int, default=3_000_000,
                    help="size of the full-recompute trace (0 skips it)")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    per_token = N_LAYERS * TOP_K
    t_start = time.perf_counter()

    t0 = time.perf_counter()
    n_tokens = max(1, args.requests // per_token)
    keys = synth_keys(n_tokens, n_layers=N_LAYERS, n_experts=N_EXPERTS, top_k=TOP_K,
                      seed=args.seed)
    print(f"decode trace generated in {time.perf_counter() - t0:.1f} s "
          f"(zipf_s 0.9, locality 0.3, drift 0.02)")
    _run("decode", keys, n_tokens, args.jobs)
    print(f"\ndecode trace: generation + replay of every policy at every capacity "
          f"{time.perf_counter() - t_start:.1f} s (target < 60 s on 2 cores)")

    if args.recompute_requests > 0:
        # steps s = prompt .. T each request s * per_token keys; solve for T
        prompt = 8
        total_steps_tokens = args.recompute_requests / per_token + prompt * (prompt - 1) / 2
        T = max(prompt, int((math.sqrt(1 + 8 * total_steps_tokens) - 1) / 2))
        t0 = time.perf_counter()
        rkeys = synth_recompute_keys(prompt, T, n_layers=N_LAYERS, n_experts=N_EXPERTS,
                                     top_k=TOP_K, zipf_s=0.9, locality=0.2, drift=0.0,
                                     seed=args.seed)
        print(f"\nrecompute trace (prompt {prompt}, {T} tokens; zipf_s 0.9, locality 0.2, "
              f"drift 0) generated in {time.perf_counter() - t0:.1f} s")
        _run("recompute", rkeys, T - prompt + 1, args.jobs)
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
