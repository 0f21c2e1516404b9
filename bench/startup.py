"""Start-up, side by side (issue 20): the same commands from a BASE commit (default
``main``) and from this working tree, alternated in one run.

* real-dims ``k3-run MODEL --pack P --preset laptop --ids 1 --gen 0``: whole-process wall
  time, and this tree's ``startup_seconds`` (process start to the first layer) and its
  share of the wall time;
* the tokenizer of the real vocabulary: derived in memory vs read from its cache;
* ``k3-run --help``;
* ``k3-trace stats`` on a 100k-request trace;
* with ``--c-engine BIN --c-trunk DIR``: whole-process wall time of this tree's k3-run
  against the public C engine on real-dims, the same prompt, 6 generated tokens and the
  same budgets (trunk ``--c-trunk-gb``, experts streamed from a 0.4 GB cache), the two
  alternated, the page cache of both engines' files dropped before every run. BIN is the
  C engine's ``k3`` binary (built outside this repository), DIR the trunk its packer
  wrote from real-dims (``pack_trunk.py MODEL DIR 3``).

BASE is extracted with ``git archive`` into ``scratch/startup-base/`` (its numba cache
is compiled on its first run, once) and packs real-dims with its own k3-pack there. Both
trees run under this venv's Python with PYTHONPATH pointing at the tree, so launching
costs the same. ``--threads 1`` keeps the
shared machine's other processes from stretching the compute (start-up has no threads).

    python bench/startup.py [--base main] [--runs 3] [--c-engine BIN --c-trunk DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (DATA, ROOT, base_tree, checkpoint, drop_page_cache, packed,  # noqa: E402
                    table, tool, tree_shim)

def side_by_side(trees: dict, prog: str, args, runs: int, tmp: Path, with_report=False):
    """{tree: [(wall, report)]}, the trees alternated run by run (``args``: a list, or
    {tree: list})."""
    out = {name: [] for name in trees}
    for i in range(runs):
        for name, shim in trees.items():
            rep = tmp / f"{name}-{i}.json" if with_report else None
            out[name].append(tool(shim, prog, args[name] if isinstance(args, dict) else args,
                                  rep))
    return out


def tree_pack(shim: Path, model: Path) -> Path:
    """real-dims packed by the tree at ``shim``'s own k3-pack (pack formats change between
    commits), once per tree."""
    out = shim.parent / "real-dims.pack"
    if not (out / "trunk.json").exists():
        print(f"[setup] packing real-dims with {shim.parent.name}'s k3-pack ...", flush=True)
        tool(shim, "k3-pack", [model, out, "--quiet"])
    return out


def med(xs) -> float:
    return statistics.median(xs)


def tokenizer_rows(model: Path, runs: int) -> list:
    """The real vocabulary's tokenizer ready to encode: derived in memory vs cache hit."""
    code = ("import sys, time; from libk3.text.tokenizer import K3Tokenizer; "
            "c = None if sys.argv[2] == 'none' else sys.argv[2]; t = time.perf_counter(); "
            "tok = K3Tokenizer.from_dir(sys.argv[1], 163840, cache=c); tok.encode('Hi'); "
            "print(time.perf_counter() - t, tok.cache_status)")
    cache = Path(tempfile.mkdtemp()) / "tok.k3tok"
    times = {"in memory (no cache)": [], "cache hit": []}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", code, model, cache], env=env, check=True,
                   capture_output=True)                       # writes the cache
    for _ in range(runs):
        for label, c in (("in memory (no cache)", "none"), ("cache hit", cache)):
            out = subprocess.run([sys.executable, "-c", code, model, c], env=env, check=True,
                                 capture_output=True, text=True).stdout.split()
            times[label].append(float(out[0]))
    return [[label, f"{med(v):.2f} s"] for label, v in times.items()]


C_PROMPT, C_GEN, C_CACHE_GB = "1,2,3", 6, 0.4


def c_engine_section(model: Path, pack: Path, engine: Path, c_trunk: Path, trunk_gb: float,
                     runs: int, tmp: Path) -> None:
    """Whole-process wall time, k3-run (this tree, installed) vs the C engine."""
    budget = ["--trunk-gb", trunk_gb, "--cache-gb", C_CACHE_GB]
    cmds = {"k3": ["k3-run", model, "--pack", pack, *budget, "--ids", C_PROMPT, "--gen", C_GEN,
                   "--report-json", tmp / "k3.json"],
            "C": [engine, model, "--trunk", c_trunk, *budget, "--ids", C_PROMPT, "--gen", C_GEN,
                  "--incremental", "--out", tmp / "c.json"]}
    out = {"k3": tmp / "k3.json", "C": tmp / "c.json"}
    walls, ids = {n: [] for n in cmds}, {n: set() for n in cmds}
    for _ in range(runs):
        for name, cmd in cmds.items():
            for p in (model, pack, c_trunk):
                drop_page_cache(p)
            t0 = time.perf_counter()
            p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                sys.stderr.write(p.stdout[-2000:] + p.stderr[-2000:])
                raise SystemExit(f"{name} failed ({p.returncode})")
            walls[name].append(wall)
            ids[name].add(tuple(json.loads(out[name].read_text())["generated_ids"]))
    k3, c = med(walls["k3"]), med(walls["C"])
    print(f"\nreal-dims, --ids {C_PROMPT} --gen {C_GEN}, trunk {trunk_gb} GB, cache "
          f"{C_CACHE_GB} GB, page cache dropped before each run ({runs} runs each, "
          "alternated; whole-process wall seconds)")
    print(table([[n, " ".join(f"{w:.2f}" for w in walls[n]), f"{med(walls[n]):.2f}"]
                 for n in cmds], ["engine", "runs", "median"]))
    print(f"k3 / C engine: {k3 / c:.2f}x (target <= 0.95x); same generated ids: "
          f"{len(ids['k3']) == 1 and ids['k3'] == ids['C']}")


def light_section(trees: dict, runs: int, tmp: Path) -> None:
    """``--help``, ``k3-trace stats`` on 100k requests, and start-up on the tiny fixture
    (its reads are 3 MB: what start-up costs besides reading)."""
    res = side_by_side(trees, "k3-run", ["--help"], max(5, runs), tmp)
    helps = {n: med(w for w, _ in v) for n, v in res.items()}

    trace = DATA / "startup-100k.k3trace"
    if not trace.exists():
        from libk3.synth.traces import write_synth_trace
        write_synth_trace(trace, 68)                # 68 tokens x 93 layers x 16 = 101,184
    res = side_by_side(trees, "k3-trace", ["stats", trace], max(5, runs), tmp)
    stats = {n: med(w for w, _ in v) for n, v in res.items()}
    print("\nlight commands (medians of 5, seconds)")
    print(table([["k3-run --help", f"{helps['base']:.2f}", f"{helps['head']:.2f}",
                  f"{helps['head'] / helps['base']:.2f}x"],
                 ["k3-trace stats (101,184 requests)", f"{stats['base']:.2f}",
                  f"{stats['head']:.2f}", f"{stats['head'] / stats['base']:.2f}x"]],
                ["command", "base", "head", "head / base"]))
    tiny = ROOT / "fixtures" / "tiny"
    args = [tiny, "--ids", 1, "--gen", 0, "--threads", 1]
    side_by_side(trees, "k3-run", args, 1, tmp, with_report=True)      # warm
    res = side_by_side(trees, "k3-run", args, max(5, runs), tmp, with_report=True)
    print("\nfixtures/tiny, k3-run --ids 1 --gen 0 --threads 1 (medians of 5, seconds)")
    print(table([[n, f"{med(w for w, _ in v):.2f}",
                  "-" if v[0][1].get("startup_seconds") is None else
                  f"{med(r['startup_seconds'] for _, r in v):.2f}"] for n, v in res.items()],
                ["tree", "wall", "start-up"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="main")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--c-engine", type=Path, help="the C engine's k3 binary")
    ap.add_argument("--c-trunk", type=Path, help="real-dims trunk packed by the C engine")
    ap.add_argument("--c-trunk-gb", type=float, default=3.7, help="both engines' trunk budget")
    ap.add_argument("--only", choices=("c", "light"),
                    help="run only the C-engine section or only the light commands")
    a = ap.parse_args()
    model, pack = checkpoint("real-dims"), packed("real-dims")
    if a.c_engine and a.only in (None, "c"):
        c_engine_section(model, pack, a.c_engine, a.c_trunk, a.c_trunk_gb, a.runs,
                         Path(tempfile.mkdtemp()))
    if a.only == "c":
        return
    trees = {"base": base_tree(a.base), "head": tree_shim(ROOT, DATA / "startup-head")}
    tmp = Path(tempfile.mkdtemp())
    if a.only == "light":
        return light_section(trees, a.runs, tmp)
    packs = {"base": tree_pack(trees["base"], model), "head": pack}
    run_args = {name: [model, "--pack", packs[name], "--preset", "laptop", "--ids", 1,
                       "--gen", 0, "--threads", 1] for name in trees}
    print(f"[setup] warm-up run of each tree (compiles {a.base}'s kernels once) ...", flush=True)
    side_by_side(trees, "k3-run", run_args, 1, tmp, with_report=True)

    res = side_by_side(trees, "k3-run", run_args, a.runs, tmp, with_report=True)
    rows = []
    for name in trees:
        walls = [w for w, _ in res[name]]
        outside = [w - r["prefill_seconds"] for w, r in res[name]]
        start = [r.get("startup_seconds") for _, r in res[name]]
        rows.append([name, f"{med(walls):.2f}", f"{med(outside):.2f}",
                     f"{med([r['prefill_seconds'] for _, r in res[name]]):.2f}",
                     "-" if None in start else f"{med(start):.2f}",
                     "-" if None in start else f"{med(s / w for s, (w, _) in zip(start, res[name])):.0%}"])
    ratio = med(w for w, _ in res["head"]) / med(w for w, _ in res["base"])
    print(f"\nreal-dims, k3-run --pack --preset laptop --ids 1 --gen 0 --threads 1 "
          f"({a.runs} runs each, alternated; medians, seconds)")
    print(table(rows, ["tree", "wall", "wall - prefill", "prefill", "start-up", "share"]))
    print(f"head / base wall time: {ratio:.2f}x")

    print("\nreal vocabulary (163,584 ranks): tokenizer ready to encode, in a fresh process")
    print(table(tokenizer_rows(model, a.runs), ["tokenizer", "median"]))

    light_section(trees, a.runs, tmp)


if __name__ == "__main__":
    main()
