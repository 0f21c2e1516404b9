"""What a run pays before its first layer (issue 20): the report's start-up and compile
times, the tokenizer read only when text is encoded or decoded, imports that stay out of
tools that need no kernels, model-level tensors read in the background, and a trunk
read-ahead abandoned at exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from libk3.engine import precompile
from libk3.errors import CheckpointError
from libk3.text.tokenizer import K3Tokenizer
from libk3.io.direct import ALIGN, DirectFile, ReadCancelled, ReadGate, aligned_empty
from .scripts import k3


@pytest.fixture(scope="module")
def warm():
    """Every kernel in numba's cache (compiled here once if the checkout is fresh)."""
    precompile.prepare(precompile.GROUPS)


def test_report_startup_and_compile_fields(tiny_dir, tmp_path, warm):
    """Catches a report without start-up or compile time, a start-up clock that does not
    start at the process start (e.g. at the first forward: ~0 s), compile time counted on
    a warm cache, or a notice printed although nothing compiles."""
    t0 = time.time()
    p = k3(tiny_dir, "--ids", "1,2,3", "--gen", 2, "--report-json", tmp_path / "r.json")
    wall = time.time() - t0
    assert p.returncode == 0, p.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["compile_seconds"] == 0.0 and "compiling" not in p.stderr
    assert 0.05 < rep["startup_seconds"] < wall
    assert f"start-up {rep['startup_seconds']:.2f} s" in p.stderr


def test_run_reads_the_tokenizer_only_for_text(tiny_dir, tmp_path, warm):
    """Catches a run that reads (and derives) the tokenizer when it decodes nothing, and
    text or ids that change when they come from the cache instead of the files."""
    ref = K3Tokenizer.from_dir(tiny_dir, 512)
    prompt = "The capital of France is"
    rj = tmp_path / "r.json"
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"))       # a cold cache
    p = k3(tiny_dir, "--ids", "1", "--gen", 0, "--report-json", rj, env=env)
    assert p.returncode == 0, p.stderr
    assert json.loads(rj.read_text())["tokenizer_cache"] == "not read"
    seen = []
    for _ in range(2):
        p = k3(tiny_dir, "--prompt", prompt, "--gen", 6, "--report-json", rj, env=env)
        assert p.returncode == 0, p.stderr
        rep = json.loads(rj.read_text())
        seen.append(rep["tokenizer_cache"])
        assert rep["prompt_ids"] == ref.encode(prompt)
        assert rep["generated_text"] == ref.decode(rep["generated_ids"])
        assert p.stdout == ref.decode(rep["generated_ids"]) + "\n"
    assert seen == ["written", "hit"]
    assert len(list((tmp_path / "xdg" / "k3" / "tokenizer").iterdir())) == 1


CHECK_IMPORTS = '''
import sys
WATCHED = ("numba", "numpy", "libk3.kernels", "libk3.model", "tokenizers")
sys.argv = {argv!r}
from {module} import main
try:
    main()
except SystemExit:
    pass
sys.stderr.write("\\nLOADED " + " ".join(sorted(m for m in WATCHED if m in sys.modules)))
'''


@pytest.mark.parametrize("module, argv, loaded", [
    ("k3_run.cli", ["k3-run", "--help"], ""),
    ("k3_run.cli", ["k3-run", "--version"], ""),
    ("k3_pack.cli", ["k3-pack", "--help"], ""),
    ("k3_trace.cli", ["k3-trace", "stats", "TRACE"], "numpy"),
    ("k3_trace.cli", ["k3-trace", "replay", "TRACE", "--slots", "4", "--policy", "lru"],
     "numba numpy"),
    ("k3_doctor.cli", ["k3-doctor", "--quick"], "numba numpy"),
])
def test_tools_import_no_kernels_they_do_not_run(module, argv, loaded, tmp_path):
    """Catches a front end (or a module it needs) importing the numba kernels, the model
    or the tokenizer at import time: seconds of start-up for --help or trace stats; and
    numpy for --help and --version (a third of --help's time: the option rules once
    pulled it in through the sampler)."""
    from libk3.synth.traces import write_synth_trace

    trace = tmp_path / "t.k3trace"
    write_synth_trace(trace, 20, n_layers=4, n_experts=16, top_k=2, expert_bytes=1000)
    argv = [str(trace) if a == "TRACE" else a for a in argv]
    p = subprocess.run([sys.executable, "-c", CHECK_IMPORTS.format(argv=argv, module=module)],
                       capture_output=True, text=True, timeout=600)
    assert p.stderr.rsplit("LOADED", 1)[1].strip() == loaded, p.stderr
    if argv[1] == "replay":                     # control: the check sees what is imported
        assert "numba" in p.stderr.rsplit("LOADED", 1)[1]


class _FailingCheckpoint:
    """Just enough of a Checkpoint for StreamedWeights, whose lm_head read fails."""

    def __init__(self, tiny_dir):
        from libk3.io.checkpoint import Checkpoint
        self._real = Checkpoint.open(tiny_dir)
        self.config = self._real.config

    def entry(self, name):
        return self._real.entry(name)

    def read_matrix(self, name):
        time.sleep(0.05)
        raise CheckpointError("file ends early (truncated shard?)", path="shard", tensor=name)

    def read(self, name):
        return self._real.read(name)


def test_background_model_read_error_reaches_the_forward(tiny_dir):
    """Catches a background read whose failure is swallowed (the run would continue with
    no lm_head, or hang) instead of raised where the forward asks for it."""
    from libk3.model.weights import StreamedWeights

    class Nothing:
        def close(self):
            pass

    ckpt = _FailingCheckpoint(tiny_dir)
    w = StreamedWeights(ckpt, Nothing(), Nothing())
    with pytest.raises(CheckpointError, match="truncated") as err:
        w.model()
    assert err.value.tensor == "language_model.lm_head.weight"
    w.close()
    ckpt._real.close()


def test_readahead_cancel_stops_between_pieces(tmp_path):
    """Catches a close() that waits for a whole layer's read-ahead (seconds of exit per
    run on real dimensions) because the cancel flag is never looked at."""
    from concurrent.futures import ThreadPoolExecutor

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * (64 * ALIGN))                   # 64 MiB
    f = DirectFile(path, use_direct=False)
    buf = aligned_empty(f.size)
    gate, cancel = ReadGate(), threading.Event()
    with ThreadPoolExecutor(2) as pool:
        assert f.read_window(0, f.size, buf, yield_to=gate, pool=pool, depth=2,
                             cancel=cancel) == 0                         # control
        assert np.array_equal(buf[:256], np.arange(256, dtype=np.uint8))
        cancel.set()
        with pytest.raises(ReadCancelled):
            f.read_window(0, f.size, buf, yield_to=gate, pool=pool, depth=2, cancel=cancel)
        with pytest.raises(ReadCancelled):
            f.read_window(0, f.size, buf, yield_to=gate, cancel=cancel)
    f.close()
