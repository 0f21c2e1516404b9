"""Multi-token arithmetic on `real-dims`, everything resident, side by side with a BASE tree.

Prints, from one run that alternates BASE and this tree (round 0 of each fills its numba
cache and is not counted), one thread, every weight read into RAM when the session opens
(no disk in the timed part):

1. a 64-token prompt's prefill: process CPU seconds per prompt token (``time.process_time``
   around the prefill passes), and its ratio to BASE (target <= 0.5x);
2. decode after it, 8 tokens: process CPU seconds per token (target <= 0.7x);
3. lockstep, 8 prompts x 8 generated tokens at width 8: tokens/s of the passes in which
   every lane decodes (target >= 1.6x);
4. whether every run of both trees produced the same ids (prefill+decode and lockstep).

Medians of --rounds, with each round's ratio. The kernels alone at the real dimensions,
against this CPU's peak: ``bench/roofline.py``.

    python bench/arithmetic.py [--base 49d9015] [--head REV] [--rounds 3]

Generates scratch/real-dims (~8 GB) on first use.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, ROOT, checkpoint  # noqa: E402

_RUN = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numba
numba.set_num_threads(1)
from libk3.engine.session import open_session
from libk3.engine.generate import GenSettings, generate
from libk3.engine.lockstep import Job, run_lockstep
from libk3.model.state import State
s = open_session(sys.argv[2])
cpu = {}
def fwd(*a, **kw):
    c0 = time.process_time()
    out = s.forward(*a, **kw)
    ph = kw.get("phase", "prefill")
    cpu[ph] = cpu.get(ph, 0.0) + time.process_time() - c0
    return out
prompt = [(37 * i) % 150000 + 11 for i in range(64)]
r = generate(fwd, s.new_state(), prompt, GenSettings(gen=8))
out = {"prefill_cpu_per_token": cpu["prefill"] / len(prompt),
       "decode_cpu_per_token": cpu["decode"] / len(r.generated_ids),
       "ids": r.generated_ids}


class Timed:
    # s.forward with the passes whose lanes all decode timed apart
    def __init__(self, f):
        self.f, self.decode_s, self.decode_tokens = f, 0.0, 0
    def run(self, segs):
        c0 = time.process_time()
        res = self.f.run(segs)
        if all(g.phase == "decode" for g in segs):
            self.decode_s += time.process_time() - c0
            self.decode_tokens += sum(len(g.ids) for g in segs)
        return res
    def __getattr__(self, name):
        return getattr(self.f, name)


timed = Timed(s.forward)
jobs = [Job(i, [(97 * i + 13 * j) % 150000 + 5 for j in range(8)], GenSettings(gen=8))
        for i in range(8)]
got = {}
run_lockstep(timed, lambda n: State(s.cfg, capacity=n), jobs, 8,
             lambda job, res: got.__setitem__(job.tag, res.generated_ids))
out["lockstep_decode_tokens_per_cpu_s"] = timed.decode_tokens / timed.decode_s
out["lockstep_ids"] = [got[i] for i in range(8)]
print(json.dumps(out))
"""


def extract(rev: str, name: str) -> Path:
    """``rev`` extracted once into scratch/NAME (its numba cache kept beside it)."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    out = DATA / name
    stamp = out / "COMMIT"
    if not stamp.exists() or stamp.read_text() != commit:
        subprocess.run(["rm", "-rf", str(out)], check=True)
        out.mkdir(parents=True)
        arch = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True,
                              capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(out)], input=arch, check=True)
        stamp.write_text(commit)
    return out


def one(tree: Path, ckpt: Path) -> dict:
    p = subprocess.run([sys.executable, "-c", _RUN, str(tree), str(ckpt)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"the run of {tree} failed ({p.returncode})")
    return json.loads(p.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="49d9015")
    ap.add_argument("--head", default=None,
                    help="a commit to measure instead of the working tree (extracted like BASE)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    ckpt = checkpoint("real-dims")
    trees = {"base": extract(a.base, "arith-base"),
             "head": extract(a.head, "arith-head") if a.head else ROOT}
    res = {"base": [], "head": []}
    for r in range(a.rounds + 1):
        order = ("base", "head") if r % 2 else ("head", "base")
        for name in order:
            got = one(trees[name], ckpt)
            print(f"[round {r} {name}] prefill {got['prefill_cpu_per_token']:.4f} CPU s/token, "
                  f"decode {got['decode_cpu_per_token']:.4f} CPU s/token, lockstep "
                  f"{got['lockstep_decode_tokens_per_cpu_s']:.3f} tokens/CPU s", flush=True)
            if r:
                res[name].append(got)
    rows = (("prefill CPU s per prompt token", "prefill_cpu_per_token", "<= 0.5x"),
            ("decode CPU s per token", "decode_cpu_per_token", "<= 0.7x"),
            ("lockstep width 8, decode tokens per CPU s", "lockstep_decode_tokens_per_cpu_s",
             ">= 1.6x"))
    print(f"\nreal-dims, resident, 1 thread; {a.base} vs this tree, median of {a.rounds} rounds")
    for label, key, target in rows:
        b = statistics.median(x[key] for x in res["base"])
        h = statistics.median(x[key] for x in res["head"])
        per = [f"{y[key] / x[key]:.3f}" for x, y in zip(res["base"], res["head"])]
        print(f"{label}: base {b:.4f}, this tree {h:.4f}: {h / b:.3f}x "
              f"(rounds {', '.join(per)}; target {target})")
    runs = res["base"] + res["head"]
    same = all(x["ids"] == runs[0]["ids"] and x["lockstep_ids"] == runs[0]["lockstep_ids"]
               for x in runs)
    print(f"same ids in every run of both trees: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
