"""Prefill chunk (issue 33 item 6): chunk-union prefill at the floor budget, side by side.

Prefill feeds the prompt in chunks of ``--prefill-chunk`` tokens; each chunk is one
forward pass that streams the whole trunk (at the floor nothing is pinned) and loads the
union of the experts its tokens route to. A larger chunk K means fewer trunk passes per
prompt token, a larger expert union per pass and more activation memory. For each preset
at the floor budget (``libk3.budget.minimum_budget``, one byte over each floor) this
prints, side by side in one run:

1. ``k3-run MODEL --pack PACK --trunk-gb T --cache-gb C --ids <prompt> --gen 1
   --prefill-chunk K --json`` for every K, the Ks interleaved (each round starts at a
   different K), medians over ``--rounds``: prefill tokens/s and its ratio to K=64's
   (median of the per-round ratios, and their range), the whole process's CPU seconds
   and the forward's waits for the trunk per prompt token, trunk and expert bytes read
   per prompt token, the passes a prompt needs (ceil(prompt / K)) and the
   trunk passes measured per chunk (trunk bytes read / one pass's trunk bytes / passes),
   the experts fetched per MoE layer per pass (the chunk's union), peak RSS and its growth
   over the smallest K's.
2. Activation memory per chunk: the numpy bytes live at the peak of one forward pass of
   K tokens, measured in-process with tracemalloc (same floor budget; the weights' slots
   are allocated before tracing starts, so what is traced is the pass's own arrays),
   next to ``libk3.budget.activation_peak`` (the same peak from the model's dims), and
   the peak-RSS growth of section 1.
3. The formula at Kimi K3's dims (``libk3.k3_dims``), per K, against the runtime reserve
   (``libk3/presets.yaml``, ``accounting.runtime_reserve_gb``) less the runtime the
   measured runs used besides budgets, resident tensors, state and activations; and what
   a chunk saves, modelled at the floor: trunk bytes per prompt token (one pass per
   chunk) and expert bytes per prompt token (the chunk's union per MoE layer, from a
   synthetic trace at K3's shape and under uniform routing); then the chunk the rule
   (``libk3.budget.prefill_chunk``, formats/presets.md 6) gives each K3 preset.

    python bench/prefill.py [--presets medium,real-dims] [--chunks 16,64,128,256,512]
                            [--prompt medium=1024,real-dims=256] [--rounds 3] [--quick]
                            [--save FILE] [--from FILE]

``--prompt`` is one length for every preset or ``preset=N`` pairs; ``--from FILE`` prints
the tables of an earlier ``--save FILE`` again without running anything; chunks longer than
a preset's prompt are left out of section 1 (the run would be K = prompt's) but still
measured in section 2. ``--quick``: one round, a 128-token prompt, chunks up to 128.

Generates scratch/medium (~5 GB) and scratch/real-dims (~10 GB) and their packs on first
use (``$K3_BENCH_DIR`` instead of scratch/).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, checkpoint, packed, run, table  # noqa: E402

from libk3.budget import (ModelSizes, activation_peak, load_rules, minimum_budget,  # noqa: E402
                          peak_bytes, prefill_chunk, resolve_budget)
from libk3.budget.sizes import sequence_bytes  # noqa: E402
from libk3.io.checkpoint import Checkpoint  # noqa: E402
from libk3.k3_dims import real_config  # noqa: E402

DEFAULT_PROMPT = {"medium": 1024, "real-dims": 256}   # real-dims: compute-bound, ~0.7 s/token


def prompt_ids(n: int) -> list:
    """A deterministic n-token prompt (ids inside every preset's vocabulary)."""
    return [(37 * i + 11) % 30000 + 5 for i in range(n)]


# ---- section 1: k3-run at each chunk ---------------------------------------------------
def floor_of(ckpt_dir):
    with Checkpoint.open(ckpt_dir) as ckpt:
        sizes, cfg = ModelSizes.from_checkpoint(ckpt), ckpt.config
    return sizes, cfg, minimum_budget(sizes)


def one_run(ckpt_dir, pack_dir, budget, ids, chunk) -> dict:
    """One k3-run; its report plus the process's CPU seconds (user + system)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = run(["k3-run", ckpt_dir, "--pack", pack_dir,
             "--trunk-gb", f"{(budget.trunk_bytes + 1) / 1e9:.9f}",
             "--cache-gb", f"{(budget.cache_bytes + 1) / 1e9:.9f}",
             "--ids", ",".join(map(str, ids)), "--gen", 1, "--prefill-chunk", chunk,
             "--json", "-q"])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rep = json.loads(p.stdout)
    rep["wall_seconds"] = time.perf_counter() - t0
    rep["cpu_seconds"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return rep


def speed_section(preset, ckpt_dir, pack_dir, sizes, cfg, budget, n_prompt, chunks,
                  rounds) -> dict:
    ids = prompt_ids(n_prompt)
    one_run(ckpt_dir, pack_dir, budget, ids[:8], 64)          # compile cache, first reads
    got = {K: [] for K in chunks}
    for r in range(rounds):
        order = chunks[r % len(chunks):] + chunks[:r % len(chunks)]
        for K in order:
            rep = one_run(ckpt_dir, pack_dir, budget, ids, K)
            got[K].append(rep)
            print(f"[{preset} round {r + 1}/{rounds} K={K}: prefill "
                  f"{rep['prefill_seconds']:.1f} s, {rep['prefill_tokens_per_second']:.3f} "
                  f"tokens/s, CPU {rep['cpu_seconds']:.1f} s, peak RSS "
                  f"{rep['peak_rss_bytes'] / 1e9:.3f} GB]", flush=True)
    return {"rss": speed_table(preset, sizes, cfg, budget, n_prompt, got), "reps": got}


def speed_table(preset, sizes, cfg, budget, n_prompt, got) -> dict:
    """Section 1's table from the runs ``got`` ({K: [report, ...]}, one per round);
    returns the median peak RSS per K."""
    chunks = sorted(got)
    rounds = len(got[chunks[0]])
    ref = 64 if 64 in chunks else chunks[0]
    moe = len(cfg.moe_layers)
    rows, rss = [], {}
    for K in chunks:
        reps = got[K]
        med = lambda key: statistics.median(x[key] for x in reps)  # noqa: E731
        ratios = [a["prefill_tokens_per_second"] / b["prefill_tokens_per_second"]
                  for a, b in zip(reps, got[ref])]
        waits = med("trunk_wait_seconds")
        busy = statistics.median(x["cpu_seconds"] / x["wall_seconds"] for x in reps)
        passes = math.ceil(n_prompt / K)
        trunk = med("trunk_bytes_read")
        rss[K] = med("peak_rss_bytes")
        rows.append([K, f"{med('prefill_seconds'):.1f}", f"{med('prefill_tokens_per_second'):.3f}",
                     f"{statistics.median(ratios):.2f}x",
                     f"{min(ratios):.2f}-{max(ratios):.2f}",
                     f"{med('cpu_seconds') / n_prompt:.3f}",
                     f"{busy:.2f}",
                     f"{waits / n_prompt:.3f}",
                     f"{trunk / n_prompt / 1e6:.1f}",
                     f"{med('expert_bytes_read') / n_prompt / 1e6:.1f}",
                     passes, f"{trunk / sizes.trunk_bytes / passes:.3f}",
                     f"{med('expert_requests') / passes / moe:.1f}",
                     f"{rss[K] / 1e9:.3f}", f"{round((rss[K] - rss[chunks[0]]) / 1e6):+d}"])
    print(f"\n{preset}: {n_prompt}-token prompt at the floor (trunk {budget.trunk_bytes + 1} B, "
          f"cache {budget.cache_bytes + 1} B = {budget.cache_bytes // sizes.expert_slot_bytes} "
          f"expert slots), one trunk pass {sizes.trunk_bytes / 1e6:.1f} MB, medians of {rounds}")
    print(table(rows, ["K", "prefill s", "tokens/s", f"vs K={ref}", "rounds", "CPU s/tok",
                       "CPU/wall", "trunk wait s/tok", "trunk MB/tok", "expert MB/tok", "passes",
                       "trunk passes/chunk", "experts/layer/pass", "peak RSS GB",
                       f"RSS vs K={chunks[0]} MB"]))
    print("(vs: median of the per-round ratios, rounds: their range; CPU: the whole "
          "k3-run process, user + system, and CPU/wall the threads it kept busy; trunk wait: "
          "the forward waiting for trunk layers. The report's expert read seconds are left "
          "out: they run from a batch's start to its finish, over the compute they overlap)")
    return rss


# ---- section 2: activation bytes of one pass, traced -----------------------------------
_TRACED = r"""
import gc, json, sys, tracemalloc
sys.path.insert(0, sys.argv[1])
from libk3.engine.session import open_session
s = open_session(sys.argv[2], pack=sys.argv[3], trunk_bytes=int(sys.argv[4]),
                 cache_bytes=int(sys.argv[5]))
ids_all = [int(x) for x in sys.argv[7].split(",")]
st = s.new_state()
s.forward(ids_all[:1], st, all_logits=False, phase="prefill")   # lm_head, first reads
for K in [int(x) for x in sys.argv[6].split(",")]:
    st = s.new_state()
    st.reserve(K)                                  # the sequence's MLA cache, not traced
    gc.collect()
    tracemalloc.start()
    s.forward(ids_all[:K], st, all_logits=False, phase="prefill")
    cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(json.dumps({"K": K, "peak": peak, "end": cur}), flush=True)
"""


def traced_section(preset, ckpt_dir, pack_dir, cfg, budget, chunks, rss) -> list:
    ids = prompt_ids(max(chunks))
    p = subprocess.run([sys.executable, "-c", _TRACED, str(ROOT), str(ckpt_dir), str(pack_dir),
                        str(budget.trunk_bytes + 1), str(budget.cache_bytes + 1),
                        ",".join(map(str, chunks)), ",".join(map(str, ids))],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"traced passes of {preset} failed ({p.returncode})")
    res = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    traced_table(preset, cfg, res, rss)
    return res


def traced_table(preset, cfg, res, rss) -> None:
    rows, k0 = [], min(rss)
    f0 = activation_peak(cfg, k0)[0]
    for x in res:
        K = x["K"]
        f, where = activation_peak(cfg, K)
        g = rss.get(K)
        rows.append([K, f"{x['peak'] / 1e6:.1f}", f"{x['peak'] / K / 1e3:.1f}",
                     f"{f / 1e6:.1f}", f"{x['peak'] / f:.3f}",
                     "-" if g is None else f"{round((g - rss[k0]) / 1e6):+d}",
                     "-" if g is None else f"{round((f - f0) / 1e6):+d}", where])
    Ks = [x["K"] for x in res]
    slope = (res[-1]["peak"] - res[0]["peak"]) / (Ks[-1] - Ks[0]) if len(Ks) > 1 else 0
    print(f"\n{preset}: activation memory of one pass of K tokens (numpy arrays live at "
          f"the pass's peak, tracemalloc), the formula, and section 1's peak-RSS growth")
    print(table(rows, ["K", "traced MB", "traced KB/token", "formula MB", "traced/formula",
                       "RSS growth MB", "formula growth MB", "formula's peak stage"]))
    print(f"traced slope {slope / 1e3:.1f} KB per chunk token; formula "
          f"{activation_peak(cfg, 1)[0] / 1e3:.1f} KB per token")


# ---- section 3: Kimi K3 -----------------------------------------------------------------
def k3_section(chunks, measured) -> None:
    """The formula at K3's dims per K, against the runtime reserve less the runtime base
    the measured runs used (peak RSS - budgets - resident - state - formula activations)."""
    cfg = real_config()
    rules = load_rules()
    reserve = rules.runtime_reserve_bytes
    per, where = activation_peak(cfg, 1)
    per_l = activation_peak(cfg, 1, all_logits=True)[0]
    bases = []
    for preset, (sizes, pcfg, budget, n_prompt, rss) in measured.items():
        fixed = (budget.trunk_bytes + 1 + budget.cache_bytes + 1 + sizes.resident_bytes
                 + sequence_bytes(sizes, n_prompt))
        for K, v in rss.items():
            base = v - fixed - activation_peak(pcfg, K)[0]
            bases.append(base)
            print(f"{preset} K={K}: peak RSS {v / 1e6:.0f} MB = budgets + resident + state "
                  f"{fixed / 1e6:.0f} MB + formula activations "
                  f"{activation_peak(pcfg, K)[0] / 1e6:.0f} MB + runtime {base / 1e6:.0f} MB")
    base = max(bases) if bases else 0
    room = reserve - base
    print(f"\nKimi K3: activations {per / 1e3:.1f} KB per chunk token (peak at {where}); "
          f"{per_l / 1e3:.1f} KB with all_logits (--logits-out)")
    print(f"runtime reserve {reserve / 1e6:.0f} MB; the largest runtime measured above "
          f"{base / 1e6:.0f} MB; left for activations {room / 1e6:.0f} MB "
          f"(K <= {int(room // per) if room > 0 else 0})")
    # what a chunk saves, modelled: one trunk pass per chunk; per MoE layer the union of
    # the chunk's picks, read whole (the floor's top_k + 1 slots hold almost nothing of
    # it), from a synthetic trace at K3's shape (libk3.synth.traces, default knobs: an
    # assumption, not the real router) and, as a bound, under uniform routing
    from libk3.synth.traces import synth_keys
    sizes = ModelSizes.from_config(cfg)
    moe, n_exp, k = len(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_token
    Ks = sorted(set(chunks) | {1024})
    n = max(Ks)
    keys = synth_keys(n, n_layers=moe, seed=3).reshape(n, -1)
    rows = []
    for K in Ks:
        a = activation_peak(cfg, K)[0]
        union = statistics.mean(len(np.unique(keys[i:i + K])) for i in range(0, n, K)) / moe
        uniform = n_exp * (1 - (1 - k / n_exp) ** K)
        rows.append([K, f"{a / 1e6:.1f}", f"{activation_peak(cfg, K, True)[0] / 1e6:.1f}",
                     f"{a / reserve:.2f}", "yes" if a <= room else "no",
                     f"{sizes.trunk_bytes / K / 1e9:.2f}", f"{union:.0f}",
                     f"{union * moe * cfg.expert_bytes / K / 1e9:.2f}",
                     f"{uniform * moe * cfg.expert_bytes / K / 1e9:.2f}"])
    print(table(rows, ["K", "activations MB", "with all_logits MB", "of reserve",
                       "fits reserve - runtime", "trunk GB/tok", "union/layer (trace)",
                       "expert GB/tok (trace)", "expert GB/tok (uniform)"]))
    print(f"(trunk pass {sizes.trunk_bytes / 1e9:.1f} GB, {moe} MoE layers x {n_exp} experts "
          f"of {cfg.expert_bytes} B, top {k}; per prompt token, at the floor)")
    rows = []
    for name in ("minimum", "laptop", "desktop", "workstation", "server"):
        b = minimum_budget(sizes) if name == "minimum" else resolve_budget(
            name, model_sizes=sizes, mem=1 << 50)
        chunk, cache, _ = prefill_chunk(b, sizes, 64)
        rows.append([name, f"{b.cache_bytes / 1e9:.2f}", chunk,
                     f"{(b.cache_bytes - cache) / 1e6:.0f}",
                     f"{(b.cache_bytes - cache) / sizes.expert_slot_bytes:.0f}"])
    print("\nthe rule's chunk at each K3 preset (its extra activations out of the cache)")
    print(table(rows, ["preset", "cache GB", "chunk", "taken MB", "expert slots taken"]))


def reprint(saved: dict, chunks) -> None:
    """The tables of a --save file (sections 1-3), from its reports and traced peaks."""
    measured = {}
    for preset, d in saved.items():
        sizes, cfg, budget = floor_of(checkpoint(preset))
        got = {int(K): reps for K, reps in d["runs"].items()}
        rss = speed_table(preset, sizes, cfg, budget, d["prompt"], got)
        measured[preset] = (sizes, cfg, budget, d["prompt"], rss)
        if d.get("traced"):
            traced_table(preset, cfg, d["traced"], rss)
        print()
    print("== Kimi K3 (formula)")
    k3_section(chunks, measured)


def parse_prompt(spec: str, presets) -> dict:
    if "=" not in spec:
        return {p: int(spec) for p in presets}
    out = dict(DEFAULT_PROMPT)
    for part in spec.split(","):
        k, v = part.split("=")
        out[k.strip()] = int(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="medium,real-dims")
    ap.add_argument("--chunks", default="16,64,128,256,512")
    ap.add_argument("--prompt", default=",".join(f"{k}={v}" for k, v in DEFAULT_PROMPT.items()),
                    help="prompt tokens: N, or preset=N pairs (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="one round, a 128-token prompt, chunks up to 128")
    ap.add_argument("--no-traced", action="store_true", help="skip section 2")
    ap.add_argument("--save", type=Path, help="write every run's report (prompt ids left "
                    "out) and the traced peaks to this JSON file")
    ap.add_argument("--from", dest="saved", type=Path,
                    help="print the tables of a --save file again, running nothing")
    args = ap.parse_args()
    presets = [p for p in args.presets.split(",") if p]
    chunks = sorted(int(c) for c in args.chunks.split(","))
    prompts = parse_prompt(args.prompt, presets)
    rounds = args.rounds
    if args.quick:
        rounds, prompts = 1, {p: 128 for p in presets}
        chunks = [c for c in chunks if c <= 128]
    if args.saved:
        reprint(json.loads(args.saved.read_text()), chunks)
        return
    rules = load_rules()
    measured, saved = {}, {}
    for preset in presets:
        ckpt_dir, pack_dir = checkpoint(preset), packed(preset)
        sizes, cfg, budget = floor_of(ckpt_dir)
        n = prompts.get(preset, 1024)
        ks = [K for K in chunks if K <= n]
        print(f"== {preset}: floor trunk {budget.trunk_bytes} B, cache {budget.cache_bytes} B; "
              f"planned peak {peak_bytes(budget, sizes, rules) / 1e9:.3f} GB "
              f"(runtime reserve {rules.runtime_reserve_bytes / 1e9:.2f} GB); prompt {n} "
              f"tokens; chunks {ks}" + (f" (left out, longer than the prompt: "
                                        f"{[K for K in chunks if K > n]})" if len(ks) < len(chunks)
                                        else ""), flush=True)
        res = speed_section(preset, ckpt_dir, pack_dir, sizes, cfg, budget, n, ks, rounds)
        measured[preset] = (sizes, cfg, budget, n, res["rss"])
        saved[preset] = {"prompt": n, "runs": {K: [{k: v for k, v in rep.items()
                                                    if k not in ("prompt_ids", "generated_ids")}
                                                   for rep in reps]
                                               for K, reps in res["reps"].items()}}
        if not args.no_traced:
            saved[preset]["traced"] = traced_section(preset, ckpt_dir, pack_dir, cfg, budget,
                                                     chunks, res["rss"])
        if args.save:
            args.save.write_text(json.dumps(saved, indent=1))
        print(flush=True)
    print("== Kimi K3 (formula)")
    k3_section(chunks, measured)


if __name__ == "__main__":
    main()
