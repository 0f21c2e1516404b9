"""The first run on a fresh install (issue 19), end to end: the compile notice appears on
the run that compiles and on no later run, for an empty NUMBA_CACHE_DIR and for a wheel
installed into a read-only site-packages (numba then caches under the user's
``~/.cache/numba``). Each test compiles every k3-run kernel from nothing, minutes on 2
cores, so both are marked slow: ``python -m pytest tests/test_first_run.py --run-slow``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NOTICE = "compiling k3 kernels for this CPU, first run only"
RUN = ["--prompt", "The capital of France is", "--gen", "4"]


def _run(cmd, env, report: Path, prefix=()):
    p = subprocess.run([*prefix, *map(str, cmd), "--report-json", str(report)], env=env,
                       capture_output=True, text=True, timeout=3600)
    assert p.returncode == 0, p.stderr
    return p, json.loads(report.read_text())


def _twice(cmd, env, tmp: Path, prefix=()):
    first, rep1 = _run(cmd, env, tmp / "r1.json", prefix)
    second, rep2 = _run(cmd, env, tmp / "r2.json", prefix)
    assert NOTICE in first.stderr and rep1["compile_seconds"] > 0
    assert "compiling" not in second.stderr and rep2["compile_seconds"] == 0.0
    assert rep1["generated_ids"] == rep2["generated_ids"]
    return rep1, rep2


def test_first_run_notice_with_an_empty_numba_cache_dir(tiny_dir, tmp_path):
    """Catches a notice that is missing while compiling, or shown again (and compiling
    again) once numba's cache holds the kernels."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    _twice(["k3-run", tiny_dir, *RUN], env, tmp_path)
    assert list((tmp_path / "numba").rglob("*.nbi"))


def _as_unprivileged():
    """Root ignores permission bits, so a read-only directory needs another user."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot make site-packages read-only")
    return (setpriv, "--reuid=65534", "--regid=65534", "--clear-groups")


def test_first_run_wheel_in_read_only_site_packages(tiny_dir):
    """Catches kernels that recompile on every run when the package directory cannot be
    written (numba must fall back to the user-wide cache), and a wheel missing a module."""
    base = Path(tempfile.mkdtemp(prefix="k3-wheel-"))
    try:
        base.chmod(0o755)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                        str(base / "dist"), str(ROOT)], check=True, timeout=1800)
        wheel = next((base / "dist").glob("k3-*.whl"))
        site, home, model = base / "site", base / "home", base / "tiny"
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                        "--target", str(site), str(wheel)], check=True, timeout=1800)
        shutil.copytree(tiny_dir, model)
        home.mkdir()
        home.chmod(0o777)
        subprocess.run(["chmod", "-R", "a-w", str(site)], check=True)
        subprocess.run(["chmod", "-R", "a+rX", str(site), str(model)], check=True)
        env = {k: v for k, v in os.environ.items()
               if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME", "PYTHONPATH")}
        env.update(HOME=str(home), PYTHONPATH=str(site))
        prefix = _as_unprivileged()
        where = subprocess.run([*prefix, sys.executable, "-c",
                                "import libk3; print(libk3.__file__)"], env=env, cwd=base,
                               capture_output=True, text=True, check=True).stdout
        assert where.startswith(str(site)), where                # the wheel, not the tree
        out = base / "out"
        out.mkdir()
        out.chmod(0o777)
        _twice([sys.executable, site / "bin" / "k3-run", model, *RUN], env, out, prefix)
        assert list((home / ".cache" / "numba").rglob("*.nbi"))
        assert not list(site.rglob("*.nbi"))
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(base)], check=False)
        shutil.rmtree(base, ignore_errors=True)
