"""Shared fixtures: the bundled tiny checkpoint and a `small` one made once per session."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"

# Idle OpenMP threads sleep instead of spinning (numba's omp threading layer, libgomp).
# Why: the tests run on two workers, each calling numba's parallel kernels and spawning
# k3 tools that do too, on as many cores as there are workers; libgomp's default
# spin-wait after every parallel region then burns the cores the other processes need
# (a warm run of the batch/run/lockstep files took 2.5x longer, 4x the CPU). Set here, at
# import, so the xdist workers and every process they spawn inherit it before libgomp
# loads. Changes no arithmetic (results do not depend on threading: test_model,
# test_lockstep); an OMP_WAIT_POLICY already set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


@pytest.fixture(scope="session")
def tok(tiny_dir):
    """The tiny checkpoint's tokenizer."""
    from libk3.text.tokenizer import K3Tokenizer
    return K3Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="session")
def template(tiny_dir):
    """The tiny checkpoint's chat template (the synthetic one, libk3.synth.bpe)."""
    from libk3.text.chat_template import load_chat_template
    return load_chat_template(tiny_dir)


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory) -> Path:
    from libk3.synth.checkpoint import synth_checkpoint
    return synth_checkpoint(tmp_path_factory.mktemp("small") / "small", "small", seed=0,
                            progress=False)


@pytest.fixture(scope="session")
def real_sparse_dir(tmp_path_factory) -> Path:
    """real-sparse (Kimi K3's real inventory: 497,220 tensors in 96 sparse shards, the
    slowest fixture to write) made once per run: test_synth checks it, test_doctor diagnoses it,
    test_tokenizer reads its real-size vocabulary, test_draft_checkpoint drafts for it. Under
    xdist the workers share one copy in the run's base temp directory, written under a
    lock by the first that asks. Read only: no test writes into it."""
    import fcntl
    import shutil

    from libk3.synth.checkpoint import synth_checkpoint
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return synth_checkpoint(tmp_path_factory.mktemp("rs") / "real-sparse", "real-sparse",
                                progress=False)
    shared = tmp_path_factory.getbasetemp().parent          # this run's, every worker's
    d = shared / "real-sparse"
    with open(shared / "real-sparse.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "real-sparse.done").exists():
            shutil.rmtree(d, ignore_errors=True)            # a worker died writing it
            synth_checkpoint(d, "real-sparse", progress=False)
            (shared / "real-sparse.done").touch()
    return d


@pytest.fixture(scope="session", autouse=True)
def _private_user_cache(tmp_path_factory):
    """Per-user caches (the tokenizer's derived form) go to a session temp directory,
    never to the home directory of whoever runs the tests; subprocesses inherit it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    yield
    mp.undo()


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="also run tests marked slow (they compile every numba kernel "
                          "from an empty cache: minutes each)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: compiles every kernel from an empty cache "
                                       "(minutes); skipped unless --run-slow")


# Two halves of libk3.engine.precompile's table, about 50 s of compiling each on a cold
# cache: the forward's kernels, and every other group's that the forward lacks (the
# policies dominate). Different functions, so the two never write one cache index.
_WARM_UP = """
import sys
from libk3.engine import precompile as pc
forward = pc.kernels(["forward"])
todo = forward if sys.argv[1] == "forward" else [
    k for k in pc.kernels([g for g in pc.GROUPS if g != "forward"]) if k not in forward]
pc.prepare_kernels(todo, stream=sys.stderr)
"""


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Fill numba's on-disk cache with every kernel of the precompile table, in two
    processes at once, before the xdist workers start (this hook runs in the controller
    before xdist's own, which starts them). Why: on a fresh checkout each worker, and
    each k3 tool a test spawns before the cache is filled, compiled the same kernels
    again, concurrently (a clean-clone run took twice as long as a warm one). Nothing a
    test checks depends on a cold cache: the tests of first-run compiling use their own
    NUMBA_CACHE_DIR (test_precompile, test_first_run, test_hostile_e2e). On a warm cache
    this only loads the kernels (a second or two). A failure here is reported and the
    tests run anyway: they compile what they call, and fail on their own."""
    config = session.config
    if hasattr(config, "workerinput") or config.option.collectonly:
        return
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", _WARM_UP, half], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for half in ("forward", "rest")]
    for p in procs:
        out = p.communicate()[0]
        if p.returncode != 0:
            sys.stderr.write(f"conftest: compiling the kernels up front failed "
                             f"(exit {p.returncode}); the tests compile as they go\n{out}\n")
    if time.monotonic() - t0 > 5:
        sys.stderr.write(f"conftest: numba kernels compiled up front in "
                         f"{time.monotonic() - t0:.0f} s\n")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow (compiles every kernel): run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
