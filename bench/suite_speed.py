"""Does a change slow the test suite down? Per-test times of this checkout against a base
commit, measured side by side in one run (issue 8: nothing may slow down by > 20 %).

Both trees get their own worktree and virtual environment (the console scripts the
end-to-end tests call must come from the tree under test), and the suites run
alternately, ``--rounds`` times each (the first round of each also compiles its numba
cache). Tests present and not skipped in both are compared by their best time; a test
counts as slower when it lost more than 20 % and more than 0.5 s (shorter tests are
all noise on a shared machine).

    python bench/suite_speed.py BASE_COMMIT [--head COMMIT] [--rounds 2]

Takes about 3 minutes per suite run on the 2-core dev machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.conformance import ROOT as CONFORMANCE  # noqa: E402  (where the vectors live)


def sh(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, **kw)


def setup(tree: Path, ref: str) -> Path:
    sh(["git", "-C", ROOT, "worktree", "add", "--detach", tree, ref])
    sh([sys.executable, "-m", "venv", tree / ".venv"])
    py = tree / ".venv" / "bin" / "python"
    sh([py, "-m", "pip", "install", "-q", "-e", ".[test,serve]"], cwd=tree)
    return py


def tree_env(py: Path) -> dict:
    """The environment a tree's suite runs in: its own venv's console scripts first on
    PATH (the end-to-end tests call k3-run by name; an activated venv of the checkout
    would otherwise run this checkout's code for both trees)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = str(py.parent) + os.pathsep + env.get("PATH", "")
    return env


def times(xml: Path) -> dict:
    """test id -> seconds, for the tests that ran (not skipped)."""
    out = {}
    for tc in ET.parse(xml).iter("testcase"):
        if tc.find("skipped") is None:
            out[f"{tc.get('classname')}::{tc.get('name')}"] = float(tc.get("time"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", help="commit to compare against (e.g. the commit before a change)")
    ap.add_argument("--head", default="HEAD", help="the commit measured against BASE")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    head = sh(["git", "-C", ROOT, "rev-parse", args.head]).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="k3-suite-") as tmp:
        tmp = Path(tmp)
        if CONFORMANCE.is_dir():            # each tree finds the vectors beside it
            os.symlink(CONFORMANCE.parent, tmp / CONFORMANCE.parent.name)
        trees = {}
        try:
            for name, ref in (("base", args.base), ("head", head)):
                trees[name] = (tmp / name, setup(tmp / name, ref))
            runs: dict = {"base": [], "head": []}
            for r in range(args.rounds):
                for name, (tree, py) in trees.items():
                    xml = tmp / f"{name}-{r}.xml"
                    t0 = time.perf_counter()
                    p = subprocess.run([py, "-m", "pytest", "-p", "no:cacheprovider",
                                        f"--junitxml={xml}"], cwd=tree, capture_output=True,
                                       text=True, env=tree_env(py))
                    last = (p.stdout.strip().splitlines() or ["?"])[-1]
                    print(f"{name} round {r + 1}: {time.perf_counter() - t0:.0f} s; {last}",
                          flush=True)
                    runs[name].append(times(xml))
        finally:
            for tree, _ in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(tree)], capture_output=True)
    common = set.intersection(*(set(t) for ts in runs.values() for t in ts))
    best = {name: {k: min(t[k] for t in ts) for k in common} for name, ts in runs.items()}
    tb, th = sum(best["base"].values()), sum(best["head"].values())
    print(f"\ntests in both suites (not skipped): {len(common)}; best-of-{args.rounds} total "
          f"base {tb:.1f} s, head {th:.1f} s: {th / tb:.2f}x")
    slower = sorted((k for k in common if best["head"][k] > 1.2 * best["base"][k]
                     and best["head"][k] - best["base"][k] > 0.5),
                    key=lambda k: best["head"][k] - best["base"][k], reverse=True)
    print(f"tests slower by > 20 % and > 0.5 s (target: none): {len(slower)}")
    for k in slower:
        print(f"  {best['base'][k]:7.2f} s -> {best['head'][k]:7.2f} s  {k}")


if __name__ == "__main__":
    main()
