"""Shared helpers of the benchmark scripts: where big synthetic models live, running the
console scripts (of this tree, or of a BASE commit extracted beside it), waiting for a
server to answer, printing aligned tables. Models are generated into ``scratch/`` (ignored
by git) or ``$K3_BENCH_DIR``, once, and reused."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("K3_BENCH_DIR", ROOT / "scratch"))


# Embedded in the scripts that run prompts in lockstep: ``Job`` and ``run_lockstep`` over
# the engine core (``libk3.engine.generate.run_requests``), or the lockstep module of a
# tree from before it (a base tree).
LOCKSTEP_DRIVER = r"""
try:
    from libk3.engine.core import Request as Job
    try:
        from libk3.engine.generate import run_requests
    except ImportError:         # a tree with the core whose driver was still a test's
        import os as _os, libk3 as _l
        sys.path.insert(0, _os.path.join(_os.path.dirname(_os.path.dirname(_l.__file__)),
                                         "tests"))
        from core_drive import run_core as run_requests

    def run_lockstep(forward, new_state, jobs, width, on_done, **kw):
        return run_requests(forward, new_state, jobs, width, on_done, **kw)[1]
except ImportError:
    from libk3.engine.lockstep import Job, run_lockstep
"""


def checkpoint(preset: str) -> Path:
    """The synthetic checkpoint of ``preset``, generated on first use."""
    path = DATA / preset
    if not (path / "config.json").exists():
        DATA.mkdir(parents=True, exist_ok=True)
        print(f"[setup] generating the {preset} checkpoint into {path} ...", flush=True)
        run(["k3-pack", "synth", "--preset", preset, "--quiet", str(path)])
    return path


def packed(preset: str) -> Path:
    """The pack of ``preset``'s checkpoint, made on first use."""
    ckpt = checkpoint(preset)
    out = DATA / f"{preset}.pack"
    if not (out / "trunk.json").exists():
        print(f"[setup] packing {ckpt} into {out} ...", flush=True)
        run(["k3-pack", str(ckpt), str(out), "--quiet"])
    return out


TOOLS = {"libk3": "libk3", "k3_run": "tools/k3-run", "k3_trace": "tools/k3-trace",
         "k3_pack": "tools/k3-pack",
         "k3cli": "tools/k3cli"}            # k3cli: trees after issue 15's regroup
LAUNCH = "import sys; from {mod}.cli import main; sys.argv[0] = '{prog}'; main()"


def tree_shim(src: Path, shim: Path) -> Path:
    """A directory whose entries make ``src``'s packages importable by name (and the
    working directory of its runs)."""
    shim.mkdir(parents=True, exist_ok=True)
    for name, rel in TOOLS.items():
        link = shim / name
        if not link.exists() and (src / rel).exists():
            link.symlink_to(src / rel)
    return shim


def base_tree(base: str, name: str = "startup-base") -> Path:
    """``base`` extracted once into scratch/NAME (re-extracted when it moves)."""
    commit = subprocess.run(["git", "rev-parse", base], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    out = DATA / name
    stamp = out / "COMMIT"
    if not stamp.exists() or stamp.read_text() != commit:
        subprocess.run(["rm", "-rf", str(out)], check=True)
        (out / "src").mkdir(parents=True)
        archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(out / "src")], input=archive, check=True)
        stamp.write_text(commit)
    return tree_shim(out / "src", out / "shim")


def tool(shim: Path, prog: str, args, report: Path | None = None, env=None):
    """(wall seconds, report dict or None) of one tool run from the tree at ``shim``
    (``env``: the environment to start from, else this process's)."""
    mod = prog.replace("-", "_")
    cmd = [sys.executable, "-c", LAUNCH.format(mod=mod, prog=prog), *map(str, args)]
    if report is not None:
        cmd += ["--report-json", str(report)]
    env = dict(os.environ if env is None else env, PYTHONPATH=str(shim))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=shim)  # not ROOT:
    # ``python -c`` puts the working directory first on sys.path
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"failed ({p.returncode}): {prog} {' '.join(map(str, args))}")
    return wall, (json.loads(report.read_text()) if report is not None else None)


def run(cmd, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"failed ({p.returncode}): {' '.join(map(str, cmd))}")
    return p


def k3_run_report(args, tmp: Path, name: str) -> dict:
    rep = tmp / f"{name}.json"
    t0 = time.perf_counter()
    run(["k3-run", *args, "--report-json", rep])
    out = json.loads(rep.read_text())
    out["wall_seconds"] = time.perf_counter() - t0
    return out


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget cached pages of every file under ``path`` (best effort)."""
    for p in ([path] if path.is_file() else path.rglob("*")):
        if p.is_file():
            try:
                fd = os.open(p, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            except OSError:
                pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(proc, url: str, log: Path | None = None, headers=None,
                    timeout: float = 600.0) -> float:
    """Seconds until the server ``proc`` started answers ``url``/health with 200;
    SystemExit (with its log) when it exits first or ``timeout`` passes."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            said = log.read_text() if log is not None and log.exists() else ""
            raise SystemExit(f"the server exited ({proc.returncode}):\n{said}")
        try:
            req = urllib.request.Request(url + "/health", headers=headers or {})
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:                 # not listening yet (URLError is an OSError)
            pass
        time.sleep(0.1)
    raise SystemExit(f"the server at {url} did not answer /health in {timeout:.0f} s")


def table(rows, headers) -> str:
    cols = list(zip(*([headers] + [[str(c) for c in r] for r in rows])))
    width = [max(len(c) for c in col) for col in cols]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, width))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in width])] + [line(r) for r in rows])
