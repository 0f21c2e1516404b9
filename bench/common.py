"""Shared helpers of the benchmark scripts: where big synthetic models live, running the
console scripts, printing aligned tables. Models are generated into ``scratch/`` (ignored
by git) or ``$K3_BENCH_DIR``, once, and reused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("K3_BENCH_DIR", ROOT / "scratch"))


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


def table(rows, headers) -> str:
    cols = list(zip(*([headers] + [[str(c) for c in r] for r in rows])))
    width = [max(len(c) for c in col) for col in cols]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, width))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in width])] + [line(r) for r in rows])
