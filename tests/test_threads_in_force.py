"""The kernels' wait policy is in force in every tool, checked in the process itself:
each console script runs on the tiny model with the OpenMP runtime asked to print its
settings when it loads (``OMP_DISPLAY_ENV=VERBOSE``) and with no thread setting of the
user's: an idle team thread must spin k3's short count before it sleeps
(``GOMP_SPINCOUNT``, libgomp's default being 300,000 rounds after every parallel
region). The control below runs the same parallel region without k3's set-up and must
not pass the check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from libk3.io.checkpoint import Checkpoint
from libk3.machine import cpus, threads

PROMPT = "5,17,300,42,7,99,128,3,250,11,64,200,9,31"   # prefill long enough to go parallel
SLEEPS = (f"  GOMP_SPINCOUNT = '{threads.SPIN_COUNT}'\n",)
DISPLAY = "OPENMP DISPLAY ENVIRONMENT BEGIN"


def _env(**extra) -> dict:
    """This environment without any thread setting of the user's (tests/conftest.py puts
    OMP_WAIT_POLICY=PASSIVE in it for the suite), the OpenMP runtime told to print."""
    env = dict(os.environ)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_DISPLAY_ENV", "NUMBA_NUM_THREADS",
                 "NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY"):
        env.pop(name, None)
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    env.update(extra)
    return env


def _run(*args, env=None):
    return subprocess.run([*map(str, args)], capture_output=True, text=True, timeout=600,
                          env=_env() if env is None else env)


@pytest.fixture(scope="module", autouse=True)
def _openmp_layer():
    """These checks read libgomp's own report: skip where numba does not load OpenMP."""
    p = _run(sys.executable, "-c", "from libk3.machine import threads; threads.prepare(); "
             "from libk3.machine import parallel; print(parallel.layer_check()['layer'])")
    assert p.returncode == 0, p.stderr
    if p.stdout.strip() != "omp":
        pytest.skip(f"numba's threading layer here is {p.stdout.strip()}, not OpenMP")


@pytest.fixture(scope="module")
def tiny_pack(tiny_dir, tmp_path_factory):
    from libk3.pack.writer import pack
    out = tmp_path_factory.mktemp("pack") / "tiny.pack"
    with Checkpoint.open(tiny_dir) as ckpt:
        pack(ckpt, out, progress=False)
    return out


def _assert_sleeps(p):
    assert p.returncode == 0, p.stderr
    assert DISPLAY in p.stderr, "the OpenMP runtime never loaded: no parallel kernel ran"
    for line in SLEEPS:
        assert line in p.stderr, (line, p.stderr[p.stderr.index(DISPLAY):][:1500])


def test_control_a_parallel_region_without_k3s_setup_spins():
    """The check below can fail: numba's OpenMP layer loaded without threads.prepare
    spins libgomp's default count."""
    p = _run(sys.executable, "-c",
             "from libk3.machine import parallel; print(parallel.layer_check()['layer'])")
    assert p.returncode == 0 and DISPLAY in p.stderr, p.stderr
    assert SLEEPS[0] not in p.stderr and "  GOMP_SPINCOUNT = '300000'\n" in p.stderr


def test_k3_run_idle_threads_sleep(tiny_dir):
    """Catches k3-run's kernels running with libgomp's spinning default."""
    _assert_sleeps(_run("k3-run", tiny_dir, "--ids", PROMPT, "--gen", 2, "--quiet"))


def test_k3_doctor_idle_threads_sleep():
    """Catches k3-doctor timing (or checking) kernels with spinning threads; --quick on
    the machine alone still runs a parallel region (the threading-layer check)."""
    _assert_sleeps(_run("k3-doctor", "--quick", "--quiet", "--assume-memory-gb", 16))


def test_k3_pack_idle_threads_sleep(tiny_pack):
    """Catches k3-pack's parallel codec (compress) running with spinning threads."""
    p = _run("k3-pack", "compress", tiny_pack, "--quiet")
    _assert_sleeps(p)


def test_k3_trace_record_idle_threads_sleep(tiny_dir, tmp_path):
    """Catches the run k3-trace records having spinning threads."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("The capital of France is")
    p = _run("k3-trace", "record", tiny_dir, tmp_path / "t.k3trace", "--prompt-file", prompt,
             "--gen", 1, "--quiet")
    _assert_sleeps(p)
    assert (tmp_path / "t.k3trace").stat().st_size > 0


def test_users_wait_policy_is_kept(tiny_dir):
    """Catches k3 overriding a wait policy the user set."""
    p = _run("k3-run", tiny_dir, "--ids", "1,2,3", "--gen", 1, "--quiet",
             env=_env(OMP_WAIT_POLICY="ACTIVE"))
    assert p.returncode == 0, p.stderr
    assert "  OMP_WAIT_POLICY = 'ACTIVE'\n" in p.stderr


def test_k3_run_one_thread_and_the_default_team_give_the_same_bytes(tiny_dir, tmp_path):
    """Catches a result that depends on the team size (a reduction split across threads,
    a row computed twice): --threads 1 and the default team give identical ids and
    logits, bit for bit."""
    if cpus.allowance().count < 2:
        pytest.skip("the default team is one thread here")
    out = {}
    for name, extra in (("one", ("--threads", 1)), ("default", ())):
        logits, rep = tmp_path / f"{name}.npy", tmp_path / f"{name}.json"
        p = _run("k3-run", tiny_dir, "--ids", PROMPT, "--gen", 4, "--quiet", *extra,
                 "--logits-out", logits, "--report-json", rep, env=_env(OMP_DISPLAY_ENV="FALSE"))
        assert p.returncode == 0, p.stderr
        out[name] = (np.load(logits), json.loads(rep.read_text())["generated_ids"])
    assert out["one"][1] == out["default"][1] and len(out["one"][1]) == 4
    assert out["one"][0].shape == out["default"][0].shape
    assert out["one"][0].tobytes() == out["default"][0].tobytes()


def test_bad_user_thread_count_is_a_one_line_usage_error_in_a_tool(tiny_dir):
    """Catches a bad NUMBA_NUM_THREADS reaching the user as a traceback: it must be
    'k3-run: error: ...' on one line, exit 2 (README "Exit codes")."""
    p = _run("k3-run", tiny_dir, "--ids", "1,2", "--gen", 1, "--quiet",
             env=_env(NUMBA_NUM_THREADS="abc", OMP_DISPLAY_ENV="FALSE"))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "NUMBA_NUM_THREADS" in p.stderr
    fixed = _run("k3-run", tiny_dir, "--ids", "1,2", "--gen", 1, "--quiet", "--threads", 1,
                 env=_env(NUMBA_NUM_THREADS="abc", OMP_DISPLAY_ENV="FALSE"))
    assert fixed.returncode == 0, fixed.stderr              # --threads replaces the bad value
