"""Batch throughput in lockstep (issue 12) on `medium` at the floor budgets.

Prints, side by side in one run:
1. ``k3-run --batch`` of PROMPTS prompts x GEN tokens at each --batch-width: wall time,
   aggregate tokens/s and its ratio to width 1, trunk and expert bytes read per generated
   token, the mean expert union per MoE layer per pass, and whether every line's ids equal
   width 1's (target: width 8 >= 3x width 1's tokens/s, identical results).
2. Continuous batching: a newcomer's prefill joining the decode step's pass vs running
   as a pass of its own (library, width 8, same prompts), wall time and passes.
3. With --base REV: one prompt (``--ids``, 32 tokens) decode s/token of this tree and of
   REV, alternating, median of --rounds (target: within 5 %); at the floor budgets, or
   with --single-resident every weight read into RAM at open (``k3-run --resident``: the
   decode s/token is compute only, no disk). REV before lockstep decode: 1e7f284 (main's
   first parent of the h6-lockstep merge 708a881). REV's tree is extracted into a
   temporary directory and run with this venv's packages. Also prints the decode steps'
   process CPU time per token (all threads), steadier than wall time on a shared machine.

    python bench/batch_throughput.py [--widths 1,4,8,16] [--base REV] [--threads N]

The Kimi K3 figures of the issue are modelled by ``bench/batch_model.py``.

Generates scratch/medium (~5 GB) and its pack on first use.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LOCKSTEP_DRIVER, ROOT, checkpoint, packed, run, table  # noqa: E402

from libk3.io.checkpoint import Checkpoint  # noqa: E402
from libk3.budget import ModelSizes, minimum_budget  # noqa: E402

PROMPT_IDS = [7 * i % 30000 + 5 for i in range(32)]


def batch_lines(n: int, gen: int) -> list:
    """n prompts of 8..23 ids, greedy, ``gen`` tokens each (deterministic)."""
    return [json.dumps({"id": i, "ids": [(97 * i + 13 * j) % 30000 + 5
                                         for j in range(8 + (5 * i) % 16)], "gen": gen})
            for i in range(n)]


def floor_flags(ckpt_dir) -> list:
    with Checkpoint.open(ckpt_dir) as ckpt:
        f = minimum_budget(ModelSizes.from_checkpoint(ckpt))
    return ["--trunk-gb", f"{(f.trunk_bytes + 1) / 1e9:.9f}",
            "--cache-gb", f"{(f.cache_bytes + 1) / 1e9:.9f}"]


def widths_section(ckpt_dir, pack_dir, budget, widths, n, gen, threads, tmp: Path) -> None:
    batch = tmp / "batch.jsonl"
    batch.write_text("\n".join(batch_lines(n, gen)) + "\n")
    rows, base, ids1 = [], None, None
    for w in widths:
        out = tmp / f"r{w}.jsonl"
        p = run(["k3-run", ckpt_dir, "--pack", pack_dir, *budget, "--batch", batch, "--out", out,
                 "--batch-width", w, "--json", *threads])
        s = json.loads(p.stdout)
        ids = {json.loads(x)["id"]: json.loads(x)["generated_ids"]
               for x in out.read_text().splitlines()}
        if ids1 is None:
            ids1, base = ids, s["tokens_per_second"]
        union = s["expert_union_per_layer"]
        rows.append([w, s["max_in_flight"], f"{s['seconds']:.1f}", s["generated_tokens"],
                     f"{s['tokens_per_second']:.3f}", f"{s['tokens_per_second'] / base:.2f}x",
                     f"{s['trunk_bytes_per_token'] / 1e6:.1f}",
                     f"{s['expert_bytes_per_token'] / 1e6:.1f}",
                     f"{sum(union.values()) / len(union):.1f}", s["passes"],
                     "yes" if ids == ids1 else "NO"])
        print(f"[width {w} done]", flush=True)
    print(table(rows, ["width", "in flight", "wall s", "tokens", "tokens/s", "vs w1",
                       "trunk MB/tok", "expert MB/tok", "union/layer", "passes", "same ids"]))


_JOIN = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numba
if int(sys.argv[6]): numba.set_num_threads(int(sys.argv[6]))
from libk3.engine.session import open_session
""" + LOCKSTEP_DRIVER + r"""
from libk3.engine.generate import GenSettings
from libk3.model.state import State
s = open_session(sys.argv[2], pack=sys.argv[3], trunk_bytes=int(sys.argv[4]),
                 cache_bytes=int(sys.argv[5]))
lines = [json.loads(x) for x in sys.stdin.read().splitlines()]
out = {}
for join in (True, False):
    jobs = [Job(j["id"], j["ids"], GenSettings(gen=j["gen"])) for j in lines]
    t0 = time.perf_counter()
    st = run_lockstep(s.forward, lambda n: State(s.cfg, capacity=n), jobs, 8,
                      lambda job, r: out.setdefault(join, {}).__setitem__(job.tag, r.generated_ids),
                      join_prefill=join)
    print(json.dumps({"join": join, "seconds": time.perf_counter() - t0, "passes": st.passes,
                      "tokens": st.generated_tokens}), flush=True)
print(json.dumps({"same": out[True] == out[False]}))
"""


def join_section(ckpt_dir, pack_dir, n, gen, threads) -> None:
    with Checkpoint.open(ckpt_dir) as ckpt:
        f = minimum_budget(ModelSizes.from_checkpoint(ckpt))
    p = subprocess.run([sys.executable, "-c", _JOIN, str(ROOT), str(ckpt_dir), str(pack_dir),
                        str(f.trunk_bytes + 1), str(f.cache_bytes + 1), str(threads or 0)],
                       input="\n".join(batch_lines(n, gen)), capture_output=True, text=True,
                       check=True)
    res = [json.loads(x) for x in p.stdout.splitlines()]
    rows = [["joins the decode pass" if r["join"] else "own pass", f"{r['seconds']:.1f}",
             r["passes"], f"{r['tokens'] / r['seconds']:.3f}"] for r in res[:2]]
    print(table(rows, ["newcomer prefill", "wall s", "passes", "tokens/s"]))
    print(f"same ids: {'yes' if res[2]['same'] else 'NO'}")


_SINGLE = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import numba
if int(sys.argv[5]): numba.set_num_threads(int(sys.argv[5]))
from libk3.engine.session import open_session
from libk3.engine.generate import GenSettings, generate
if sys.argv[4] == "resident":                     # every weight read at open, no pack
    s = open_session(sys.argv[2])
else:
    s = open_session(sys.argv[2], pack=sys.argv[3], trunk_bytes=int(sys.argv[4].split(",")[0]),
                     cache_bytes=int(sys.argv[4].split(",")[1]))
ids = [int(x) for x in sys.stdin.read().split(",")]
cpu = [0.0]
class Cpu:
    # process CPU time of the decode steps: called (a tree from before the engine core)
    # or run over segments (the core)
    def __call__(self, *a, **kw):
        c0 = time.process_time()
        out = s.forward(*a, **kw)
        if kw.get("phase") == "decode":
            cpu[0] += time.process_time() - c0
        return out
    def run(self, segs):
        c0 = time.process_time()
        out = s.forward.run(segs)
        if segs[0].phase == "decode":
            cpu[0] += time.process_time() - c0
        return out
    def __getattr__(self, name):
        return getattr(s.forward, name)
forward = Cpu()
r = generate(forward, s.new_state(), ids, GenSettings(gen=32))
print(r.seconds_per_token, cpu[0] / len(r.generated_ids), r.generated_ids)
"""


def single_section(ckpt_dir, pack_dir, base_rev, rounds, threads, resident, tmp: Path) -> None:
    """Decode s/token of one prompt: REV's tree (git archive, in ``tmp``) vs this one,
    alternating; at the floor budgets from the pack, or with ``resident`` every weight
    read into RAM when the session opens (no pack, no cache: decode is compute only)."""
    tree = tmp / "base"
    tree.mkdir()
    arch = subprocess.run(["git", "-C", str(ROOT), "archive", base_rev], capture_output=True,
                          check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=arch, check=True)
    with Checkpoint.open(ckpt_dir) as ckpt:
        sizes = ModelSizes.from_checkpoint(ckpt)
    f = minimum_budget(sizes)
    budget = "resident" if resident else f"{f.trunk_bytes + 1},{f.cache_bytes + 1}"
    print(f"budgets (trunk,cache bytes): {budget}", flush=True)
    got = {"base": [], "head": []}
    cpu = {"base": [], "head": []}
    toks = {}
    for r in range(rounds + 1):                  # round 0 compiles the base tree's cache
        for name, root in (("base", tree), ("head", ROOT)):
            p = subprocess.run([sys.executable, "-c", _SINGLE, str(root), str(ckpt_dir),
                                str(pack_dir), budget, str(threads or 0)],
                               input=",".join(map(str, PROMPT_IDS)), capture_output=True,
                               text=True, check=True)
            spt, cps, ids = p.stdout.split(" ", 2)
            toks.setdefault(name, set()).add(ids)
            if r:
                got[name].append(float(spt))
                cpu[name].append(float(cps))
            print(f"[single round {r} {name}: {float(spt):.3f} s/token, "
                  f"{float(cps):.3f} CPU s/token]", flush=True)
    same = len(toks["base"] | toks["head"]) == 1
    for what, d in (("s/token", got), ("CPU s/token", cpu)):
        b, h = statistics.median(d["base"]), statistics.median(d["head"])
        print(f"one prompt, 32 tokens, {what} (median of {rounds}): {base_rev} {b:.3f} "
              f"{['%.3f' % x for x in d['base']]}, this tree {h:.3f} "
              f"{['%.3f' % x for x in d['head']]}: {h / b:.3f}x")
    print(f"same ids in every run: {'yes' if same else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="1,4,8,16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--join-gen", type=int, default=8, help="tokens per prompt in section 2")
    ap.add_argument("--base", help="commit for the single-prompt before/after (section 3)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, help="numba threads (default: all cores)")
    ap.add_argument("--single-resident", action="store_true",
                    help="section 3 with every weight in RAM (k3-run --resident), not the "
                         "floor budgets")
    ap.add_argument("--sections", default="1,2,3")
    args = ap.parse_args()
    ckpt_dir, pack_dir = checkpoint("medium"), packed("medium")
    budget = floor_flags(ckpt_dir)
    threads = ["--threads", args.threads] if args.threads else []
    print(f"medium at the floor budget ({' '.join(budget)}), threads "
          f"{args.threads or 'all'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "1" in args.sections:
            print(f"== 1. {args.prompts} prompts x {args.gen} tokens", flush=True)
            widths_section(ckpt_dir, pack_dir, budget, [int(w) for w in args.widths.split(",")],
                           args.prompts, args.gen, threads, tmp)
        if "2" in args.sections:
            print(f"== 2. newcomers' prefill, width 8, {args.prompts} prompts x "
                  f"{args.join_gen} tokens", flush=True)
            join_section(ckpt_dir, pack_dir, args.prompts, args.join_gen, args.threads)
        if "3" in args.sections and args.base:
            print(f"== 3. one prompt before ({args.base}) and after", flush=True)
            single_section(ckpt_dir, pack_dir, args.base, args.rounds, args.threads,
                           args.single_resident, tmp)


if __name__ == "__main__":
    main()
