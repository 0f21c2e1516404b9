"""Hostile inputs through whole tool runs: batch files with bad lines, a results file that
is not k3's, every output on a full disk, and the bounded-memory cases as real processes
whose peak RSS is read from wait4 (README "Exit codes", "Batch files"; tests/hostile.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal

import numpy as np
import pytest

from k3_pack.cli import main as pack_main
from k3_run.cli import main as run_main
from k3_trace.cli import main as trace_main
from libk3.trace import format as tr

from .hostile import (check_clean, check_process_refused, check_refused, fail, invoke,
                      run_script, script)
from .hostile_inputs import NESTED, craft_state, model_with_config, small_trace



@contextlib.contextmanager
def disk_full_after(nbytes: int):
    """Every file this process writes fails past ``nbytes`` (EFBIG), as on a full disk."""
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


def _no_strays(d, keep):
    """Catches a temporary or partial file left behind."""
    left = sorted(p.name for p in d.iterdir() if p.name not in keep)
    if left:
        fail("data-lost", f"left behind in {d}: {left}")


# ---- batch files ---------------------------------------------------------------------------

BAD_LINES = [
    '{"id": "neg-seed", "ids": [1, 2], "seed": -1}',
    '{"id": "nan-temp", "ids": [1, 2], "temperature": NaN}',
    '{"id": "huge-gen", "ids": [1, 2], "gen": 1000000000000000000}',
    '{"id": "tiny-temp", "ids": [1, 2], "temperature": 1e-320}',
    '{"id": "stop-int", "ids": [1, 2], "stop_ids": 5}',
    '{"id": "seed-str", "ids": [1, 2], "seed": "7"}',
    '{"id": ' + "9" * 5000 + ', "ids": [1]}',
    NESTED,
]


def test_batch_bad_lines_are_skipped_and_recorded_never_abort(tiny_dir, tmp_path):
    """Catches a bad field that aborts (negative seed reaching numpy), wedges (a huge gen)
    or silently runs (NaN temperature) instead of being that line's recorded error."""
    batch = tmp_path / "b.jsonl"
    good = ['{"id": "first", "ids": [1, 2]}', '{"id": "last", "ids": [3, 4], "seed": 3, '
            '"temperature": 0.5}']
    batch.write_text("\n".join([good[0], *BAD_LINES, good[1]]) + "\n")
    out = tmp_path / "r.jsonl"
    res = invoke(run_main, [tiny_dir, "--batch", batch, "--out", out, "--gen", "2",
                            "--json"], seconds=120)
    check_clean(res, codes=(0,))
    summary = json.loads(res.stdout)
    assert summary["done"] == 2 and summary["malformed"] == len(BAD_LINES), summary
    assert [e["line"] for e in summary["errors"]] == list(range(2, 2 + len(BAD_LINES)))
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["first", "last"]


def test_batch_out_refuses_a_file_that_is_not_k3_results(tiny_dir, tmp_path):
    """Catches --out 'repairing' the tail of someone else's file: its last line, without a
    newline, was truncated away before any check."""
    batch = tmp_path / "b.jsonl"
    batch.write_text('{"id": 1, "ids": [1, 2]}\n')
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"my notes\nthe last line has no newline")
    before = notes.read_bytes()
    res = invoke(run_main, [tiny_dir, "--batch", batch, "--out", notes, "--gen", "1"],
                 seconds=120)
    if notes.read_bytes() != before:
        fail("data-lost", f"{notes} changed to {notes.read_bytes()[:80]!r}")
    check_refused(res, 3, str(notes))
    for text in (b'{"a": 1}\n', b"[1, 2]\n", b'{"id": 1}\n'):            # JSON, but not k3's
        notes.write_bytes(text)
        check_refused(invoke(run_main, [tiny_dir, "--batch", batch, "--out", notes, "--gen",
                                        "1"], seconds=120), 3, str(notes))
        assert notes.read_bytes() == text


def test_batch_out_drops_only_a_torn_last_line_of_k3_results(tiny_dir, tmp_path):
    """Control: a genuine results file whose last line a crash tore is resumed: the torn
    line is dropped (README), the complete ones are kept and their ids skipped."""
    batch = tmp_path / "b.jsonl"
    batch.write_text('{"id": 1, "ids": [1, 2]}\n{"id": 2, "ids": [3]}\n')
    out = tmp_path / "r.jsonl"
    assert invoke(run_main, [tiny_dir, "--batch", batch, "--out", out, "--gen", "1"],
                  seconds=120).code == 0
    first, second = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(first + second[:25])
    res = invoke(run_main, [tiny_dir, "--batch", batch, "--out", out, "--gen", "1", "--json"],
                 seconds=120)
    check_clean(res)
    assert json.loads(res.stdout)["skipped"] == 1
    lines = out.read_bytes().splitlines(keepends=True)
    assert lines[0] == first and len(lines) == 2
    assert [json.loads(lines[1])[k] for k in ("id", "generated_ids")] == \
        [json.loads(second)[k] for k in ("id", "generated_ids")]


# ---- outputs on a full disk ------------------------------------------------------------------

@pytest.fixture(scope="module")
def warm(tiny_dir):
    """One plain run first (control): the kernels are loaded before a run under a file
    size limit, and the run itself succeeds."""
    res = invoke(run_main, [tiny_dir, "--ids", "1,2,3", "--gen", "1"], seconds=300)
    assert res.code == 0, res.stderr


@pytest.mark.parametrize("flag,name,room", [
    ("--save-state", "s.k3state", 1024), ("--logits-out", "l.npy", 1024),
    ("--report-json", "r.json", 1024), ("--trace", "t.k3trace", 512)])    # header fits
def test_output_on_a_full_disk_keeps_the_old_file_and_names_it(tiny_dir, tmp_path, warm, flag,
                                                                name, room):
    """Catches an output written in place (the old file is gone and the new one is half
    written) or a disk-full error that does not say which file (exit 5)."""
    target = tmp_path / name
    target.write_bytes(b"OLD CONTENT")
    with disk_full_after(room):
        res = invoke(run_main, [tiny_dir, "--ids", "1,2,3", "--gen", "1", flag, target,
                                "--json"], seconds=120)
    if target.read_bytes() != b"OLD CONTENT":
        fail("data-lost", f"{target} now holds {target.read_bytes()[:40]!r}")
    _no_strays(tmp_path, {name, name + tr.PARTIAL_SUFFIX})    # a failed run's trace
    check_refused(res, 5, str(target))


def test_synth_on_a_full_disk_leaves_nothing(tmp_path):
    """Catches k3-pack synth leaving its hidden build directory after a failure."""
    out = tmp_path / "m"
    with disk_full_after(64 * 1024):
        res = invoke(pack_main, ["synth", "--preset", "tiny", "--quiet", out], seconds=120)
    _no_strays(tmp_path, set())
    check_refused(res, 5, str(out))


def test_trace_import_on_a_full_disk_names_the_output(tmp_path):
    """Catches an import whose disk-full error names no file."""
    raw = tmp_path / "raw.bin"
    rng = np.random.default_rng(0)
    np.stack([rng.integers(0, 93, 200_000), rng.integers(0, 896, 200_000)], 1).astype(
        "<i4").tofile(raw)
    out = tmp_path / "t.k3trace"
    with disk_full_after(4096):
        res = invoke(trace_main, ["import", raw, out], seconds=60)
    _no_strays(tmp_path, {"raw.bin"})
    check_refused(res, 5, str(out))


# ---- real processes: bounded memory ---------------------------------------------------------

@pytest.mark.parametrize("name", ["layers 1e9", "nested"])
def test_process_implausible_config_is_refused_in_small_memory(tiny_dir, tmp_path, name):
    """Catches work sized by the config's numbers before the shards are compared (more
    sizes in-process: tests/test_hostile_files.py)."""
    doc = json.loads((tiny_dir / "config.json").read_text())
    doc["text_config"]["num_hidden_layers"] = 10**9
    text = NESTED if name == "nested" else json.dumps(doc)
    d = model_with_config(tiny_dir, tmp_path / "m", text)
    p = run_script([script("k3-run"), d, "--ids", "1", "--gen", "1"], timeout=60)
    check_process_refused(p, 3, str(d))


@pytest.mark.parametrize("cmd", ["stats", "replay"])
def test_process_trace_header_of_65535_by_65535_stays_small(tmp_path, cmd):
    """Catches per-key arrays sized by the header's n_layers x n_experts (4.3e9 keys), and
    a header checked only after compiling the replay kernels (an empty numba cache)."""
    p = small_trace(tmp_path / "big.k3trace", n_layers=65535, n_experts=65535)
    args = [script("k3-trace"), cmd, p] + (["--slots", "20"] if cmd == "replay" else [])
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cold"))
    proc = run_script(args, timeout=60, env=env)
    check_process_refused(proc, 3, str(p))


def test_process_replay_of_1e12_slots_stays_small(tmp_path):
    """Catches per-slot arrays in replay: 10^12 slots hold every key, the answer is the
    ceiling, computed in the memory of the keys."""
    p = small_trace(tmp_path / "t.k3trace")
    proc = run_script([script("k3-trace"), "replay", p, "--slots", "1000000000000", "--json"],
                      timeout=60)
    if proc.code != 0:
        check_process_refused(proc, 2, "--slots")
    assert proc.peak_rss < 500 * 10**6, proc.peak_rss / 1e9
    rep = json.loads(proc.stdout)
    assert all(c["misses"] == rep["compulsory_misses"]
               for row in rep["capacities"] for c in row["policies"].values())


def _crafted_state(tiny_dir, tmp_path, pos):
    """A state file for tiny whose header claims ``pos`` positions (framing and checksum
    right, so only the claim is wrong)."""
    from libk3.io.checkpoint import Checkpoint
    from libk3.io.identity import weights_identity
    from libk3.model.state import State

    with Checkpoint.open(tiny_dir) as ckpt:
        st = State(ckpt.config)
        wid = weights_identity(ckpt)
    st.pos, st.ids = 1, [1]
    st.logits = np.zeros(ckpt.config.vocab_size, np.float32)
    good = tmp_path / "good.k3state"
    st.save(good, wid)

    def claim(head):
        head["pos"], head["ids"] = pos, [1] * min(pos, 10)
        for a in head["arrays"]:
            if a[0].startswith("mla"):
                a[-1][0] = pos

    bad = tmp_path / "bad.k3state"
    bad.write_bytes(craft_state(good.read_bytes(), edit=claim))
    return bad


def test_process_state_of_other_weights_is_refused_in_run_and_chat(tiny_dir, tmp_path):
    """Catches a state computed with other weights of the same configuration loading
    silently (the one-prompt run and the chat generated garbage from it): exit 3, one line
    naming the state file; and a run that compiled the kernels before refusing it (on a
    cold numba cache: a minute and 0.6 GB). Control: the state, saved streaming through a
    pack, loads into a resident run of its own checkpoint (the identity is the weights',
    not the pack's)."""
    from .hostile_inputs import model_with_other_weights
    from .test_run_cli import _pack

    run = [script("k3-run")]
    state = tmp_path / "s.k3state"
    saved = run_script(run + [tiny_dir, "--pack", _pack(tiny_dir, tmp_path / "tiny.pack"),
                              "--preset", "max", "--ids", "1,2,3", "--gen", "2",
                              "--save-state", state])
    assert saved.code == 0, saved.stderr
    mine = run_script(run + [tiny_dir, "--ids", "4", "--gen", "1", "--load-state", state])
    assert mine.code == 0, mine.stderr
    other = model_with_other_weights(tiny_dir, tmp_path / "other")
    cold = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    check_process_refused(run_script(run + [other, "--ids", "4", "--gen", "1", "--load-state",
                                            state], env=cold), 3, str(state), "other weights")
    (tmp_path / "turns.txt").write_text("Hi there\n\n")
    chat = run_script(run + [other, "--chat", "--gen", "1", "--load-state", state],
                      stdin=tmp_path / "turns.txt", env=cold)
    check_process_refused(chat, 3, str(state), "other weights")


def test_process_state_claiming_1e8_positions_is_refused_small(tiny_dir, tmp_path):
    """Catches a loader that sizes the MLA cache from the header's pos before checking the
    file holds that many rows; and a failed run whose trace still reads as complete."""
    bad = _crafted_state(tiny_dir, tmp_path, 10**8)
    trace = tmp_path / "t.k3trace"
    p = run_script([script("k3-run"), tiny_dir, "--ids", "1", "--gen", "1", "--load-state",
                    bad, "--trace", trace], timeout=120)
    check_process_refused(p, 3, str(bad))
    if trace.exists():
        try:
            tr.TraceReader(trace).read_all()
        except tr.FormatError:
            return
        fail("exit0", f"{trace} of a failed run reads as complete")
