"""Compiling the numba kernels up front (libk3.engine.precompile): the notice appears exactly
when numba would compile, and the signature table covers every tool path.

The slow end-to-end checks (every kernel from an empty cache, a read-only wheel
install) are in tests/test_first_run.py, behind ``--run-slow``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
from click.testing import CliRunner
from numba import njit
from numba.core.event import install_recorder

from libk3.engine import precompile

NOTICE = "compiling k3 kernels for this CPU, first run only"

TOY = '''
from numba import njit


@njit(cache=True)
def twice(x):
    return 2 * x
'''

PREPARE_TOY = '''
import sys
from numba import types
from libk3.engine import precompile
kern = precompile.Kernel("toykern", "twice", (types.int64,))
before = precompile.is_cached(kern)
seconds = precompile.prepare_kernels([kern])
print(before, seconds > 0, kern.dispatcher()(21))
'''


def _prepare_toy(tmp_path: Path):
    env = dict(os.environ, PYTHONPATH=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path / "nc"))
    p = subprocess.run([sys.executable, "-c", PREPARE_TOY], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    return p.stdout.split(), p.stderr


def test_precompile_notice_exactly_when_numba_compiles(tmp_path):
    """Catches a notice printed on every run (a warm cache looked up under another key),
    never printed (compiling left to the first call), or not printed again when the
    kernel's source changed (numba's cache is then stale and it compiles)."""
    (tmp_path / "toykern.py").write_text(TOY)
    out, err = _prepare_toy(tmp_path)
    assert out == ["False", "True", "42"] and NOTICE in err
    assert list((tmp_path / "nc").rglob("*.nbi"))              # saved in NUMBA_CACHE_DIR
    out, err = _prepare_toy(tmp_path)                           # a second process
    assert out == ["True", "False", "42"] and "compiling" not in err
    (tmp_path / "toykern.py").write_text(TOY.replace("2 * x", "x + x"))
    out, err = _prepare_toy(tmp_path)
    assert out == ["False", "True", "42"] and NOTICE in err


STATE_TOY = '''
import numpy as np
from numba import njit


@njit(cache=True)
def new(n):
    a = np.zeros((n, 4), np.int32)
    return a[:, 1:3], np.zeros(n, np.int64)      # a strided view, as the policies' states


@njit(cache=True)
def use(st):
    return st[0].shape[0] + st[1].size
'''

PREPARE_STATE_TOY = '''
from numba import types
from numba.core.event import install_recorder
from libk3.engine import precompile
new = precompile.Kernel("statekern", "new", (types.int64,))
use = precompile.Kernel("statekern", "use", (precompile.ReturnOf(new),))
seconds = precompile.prepare_kernels([new, use])
with install_recorder("numba:compile") as rec:
    n = use.dispatcher()(new.dispatcher()(3))
print(seconds > 0, n, len([ev for _, ev in rec.buffer if ev.is_start]))
'''


def test_precompile_state_type_taken_from_its_constructor(tmp_path):
    """Catches a state type written by hand or guessed (a strided view typed as
    C-contiguous): the real call would compile again, unannounced; and a notice on a
    warm cache because the dependent entry was looked up before its constructor."""
    (tmp_path / "statekern.py").write_text(STATE_TOY)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path / "nc"))
    outs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", PREPARE_STATE_TOY], env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        outs.append((p.stdout.split(), NOTICE in p.stderr))
    assert outs == [(["True", "6", "0"], True), (["False", "6", "0"], False)]


def test_precompile_state_types_come_from_earlier_entries():
    """Catches a group that lists drive.access or drive.hits without the constructor of
    its state before it (preparing that group alone would fail or compile unannounced)."""
    for g in precompile.GROUPS:
        ks = precompile.kernels([g])
        for i, kern in enumerate(ks):
            for arg in kern.args:
                if isinstance(arg, precompile.ReturnOf):
                    assert arg.kernel in ks[:i], (g, kern.label)
    assert any(isinstance(arg, precompile.ReturnOf)
               for kern in precompile.kernels() for arg in kern.args)     # control


def test_precompile_lookup_matches_numba_own_key():
    """Catches a table type that differs from what a call passes (readonly, layout,
    int32 scalars): numba would file it under another key and compile at the call."""
    precompile.prepare(precompile.GROUPS)          # a policy state's type is resolved
    for kern in precompile.kernels():
        disp = kern.dispatcher()
        key = disp._cache._index_key(kern.signature(), disp.targetctx.codegen())
        assert key[0] == kern.signature()
    from libk3.kernels import norms
    x = np.ones((2, 4), np.float32)
    out = np.empty_like(x)
    call = (x, np.ones(4, np.float32), 1e-5, out)
    norms.rmsnorm(*call)                                      # a real call's types
    assert tuple(numba.typeof(a) for a in call) in {k.args for k in precompile.kernels()}
    from libk3.policies.online import OnlinePolicy
    from libk3.policies import drive
    pol = OnlinePolicy("adaptive", 8, n_layers=2, n_experts=4)
    pol.access([1, 2])                                       # a real call's state type
    table = {(k.label, k.signature()) for k in precompile.kernels()}
    # only this call's signatures: earlier tests may have called drive with other types
    state_t = numba.typeof(pol._state)
    sigs = [tuple(sig) for sig in drive.access.signatures if sig[0] == state_t]
    assert sigs and {("drive.access", sig) for sig in sigs} <= table


def test_precompile_table_holds_the_image_towers_calls(tiny_dir, tmp_path, monkeypatch):
    """Catches a tower kernel left out of the table, or listed with other types than its
    call passes (the rotate flag as an int, a scale as float32): a first image would
    compile inside the tower, unannounced, on an install whose cache ``k3-doctor
    --compile`` had filled. Every kernel call of one image's encoding, its argument
    types as numba types them, must be a table entry."""
    from libk3.engine.session import open_session
    from libk3.kernels import activations, bf16, norms, vit
    from libk3.run.images import Images
    from .test_image_prompt import _png

    calls = set()

    def recorded(mod, name):
        kernel = getattr(mod, name)

        def call(*args):
            calls.add((f"{mod.__name__.rsplit('.', 1)[-1]}.{name}",
                       tuple(numba.typeof(a) for a in args)))
            return kernel(*args)
        monkeypatch.setattr(mod, name, call)
    for mod, name in ((vit, "split_heads"), (vit, "attention"), (activations, "gelu_tanh"),
                      (activations, "gelu_erf"), (bf16, "matmul"), (norms, "rmsnorm")):
        recorded(mod, name)
    sess = open_session(tiny_dir)
    try:
        Images(sess).load(_png(tmp_path / "a.png", 1))
    finally:
        sess.weights.close()
    assert {label for label, _ in calls} == {"vit.split_heads", "vit.attention",
                                             "activations.gelu_tanh", "activations.gelu_erf",
                                             "bf16.matmul", "norms.rmsnorm"}     # control
    table = {(k.label, k.args) for k in precompile.kernels(["forward", "vision"])}
    assert calls <= table, sorted(calls - table)


@njit
def _fresh(x):
    return x + 1


def test_precompile_table_covers_every_tool_path(tiny_dir, tmp_path):
    """Catches a kernel call with argument types the table does not list: on a fresh
    install it would compile inside the first layer (or an image's tower), unannounced
    and timed as prefill."""
    import k3_run.cli as run_cli
    import k3_trace.cli as trace_cli
    from libk3.machine import parallel
    from libk3.doctor import timing
    from libk3.synth.traces import write_synth_trace
    from .test_image_prompt import _png

    trace = tmp_path / "t.k3trace"
    write_synth_trace(trace, 40, n_layers=4, n_experts=16, top_k=2, expert_bytes=1000)
    subprocess.run(["k3-pack", str(tiny_dir), str(tmp_path / "pack"), "--quiet"], check=True)
    precompile.prepare(precompile.GROUPS)
    cli = CliRunner()
    streamed = ["--trunk-gb", "0.002", "--cache-gb", "0.001"]
    with install_recorder("numba:compile") as rec:
        for args in (["--prompt", "The capital of France is", "--resident"],
                     ["--prompt", "what is this?", "--image", str(_png(tmp_path / "a.png", 1)),
                      "--resident"],
                     ["--ids", "1,2,3,1,2,3", "--spec", "3", "--resident"],
                     ["--ids", "1,2,3,1,2,3", "--spec", "3", *streamed],
                     ["--ids", "5", "--pack", str(tmp_path / "pack"), "--preset", "laptop",
                      "--cache-policy", "lru"]):
            res = cli.invoke(run_cli.main, [str(tiny_dir), "--gen", "5", *args])
            assert res.exit_code == 0, res.output
        res = cli.invoke(trace_cli.main, ["replay", str(trace), "--slots", "4,8", "--jobs", "1"])
        assert res.exit_code == 0, res.output
        parallel.layer_check()
        timing.measure_kernels(seconds=0.001, rows=64, cols=64, working_set=1 << 16)
    compiled = [(str(ev.data["dispatcher"]), ev.data["args"]) for _, ev in rec.buffer
                if ev.is_start]
    assert compiled == []
    with install_recorder("numba:compile") as rec:                     # control
        _fresh(1)
    assert [ev for _, ev in rec.buffer if ev.is_start]


def test_doctor_compile_reports_every_kernel_and_where_cached():
    """Catches a --compile that skips a group (a tool would still compile on first use)
    or does not say where numba keeps the kernels."""
    import json

    precompile.prepare(precompile.GROUPS)
    p = subprocess.run(["k3-doctor", "--compile", "--json"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert (s["kernels"], s["compiled"], s["compile_seconds"]) == \
        (len(precompile.kernels()), 0, 0.0)
    assert s["cached"] and s["cache_dirs"] and "compiling" not in p.stderr
    assert {k.module for k in precompile.kernels()} == {
        "libk3.kernels." + m for m in ("bf16", "mxfp4", "norms", "activations", "attnres",
                                       "kda", "mla", "router", "moe", "vit", "bf16_planes",
                                       "rope", "logistic", "finite")} | {
        "libk3.policies." + m for m in ("lru", "lfu", "layer_lfu", "adaptive", "drive",
                                        "belady", "s3fifo")} | {
        "libk3.policies.online", "libk3.machine.parallel"}


_COMPILE_ONE = """
import sys
from libk3.engine import precompile as pc
todo = [k for k in pc.kernels(pc.GROUPS) if k.label == sys.argv[1]][:1]
pc.prepare_kernels(todo, stream=sys.stderr, show=False)
"""


def test_a_kernel_compiled_beside_cached_team_calls_links(tmp_path):
    """Catches a compile that aborts the process (LLVM: symbol get_num_threads not found)
    when the team calls every kernel shares come from numba's cache, whose typing would
    have loaded the threading layer: one process caches them with one kernel, the next
    compiles another kernel that calls them."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "nc"))
    for label in ("activations.sigmoid", "activations.silu_mul"):
        p = subprocess.run([sys.executable, "-c", _COMPILE_ONE, label], env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, (label, p.stderr[-500:])
    assert list((tmp_path / "nc").rglob("*.nbi"))


class _FakeKernel:
    """A table entry whose compile does nothing (``_prepare`` only asks for these)."""

    def __init__(self, label):
        self.label = label

    def signature(self):
        return ()

    def dispatcher(self):
        return self

    def compile(self, sig):
        pass


def test_precompile_count_is_one_counter_over_several_calls(monkeypatch):
    """Catches a run whose two prepare calls each draw their own counter ('8 of 14',
    then '5 of 15'): with one Count the lines count every kernel of both calls once, up
    to one total; control: without a Count each call counts only its own kernels."""
    import io
    from libk3 import progress
    from libk3.kernels import team
    monkeypatch.setattr(progress, "LOG_EVERY", 0.0)
    monkeypatch.setattr(team, "launch", lambda: None)
    monkeypatch.setattr(precompile, "_announced", True)
    a, b, c, d = (_FakeKernel(x) for x in "abcd")
    monkeypatch.setattr(precompile, "is_cached", lambda k: k.label != "a" and k.label != "c")
    out = io.StringIO()
    count = precompile.Count(todo=[a, b, c, d])
    precompile._prepare([a, b], out, count=count)
    precompile._prepare([b, c, d], out, count=count)       # b again: counted once
    count.close()
    counts = [line.split(": ")[1].split(" kernel of ") for line in out.getvalue().splitlines()]
    done = [int(n) for n, _ in counts]
    assert {total.split(" ")[0] for _, total in counts} == {"4"}
    assert done == sorted(done) and done[-1] == 4
    alone = io.StringIO()
    precompile._prepare([b, c, d], alone)
    assert alone.getvalue().splitlines()[-1].startswith("compiling: 3 kernel of 3 kernel")
