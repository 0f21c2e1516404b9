"""Recording traces from k3-run, replaying them, sizing, and cache policies in k3-run."""

from __future__ import annotations

import json
import subprocess

import numpy as np

from libk3.trace.replay import replay
from libk3.policies.registry import DEFAULT_POLICY, ONLINE_OBJECT_POLICIES
from libk3.budget import ModelSizes, minimum_budget
from libk3.io.checkpoint import Checkpoint
from libk3.trace.format import PHASE_DECODE, PHASE_PREFILL, TraceReader


def run(*args):
    return subprocess.run([*map(str, args)], capture_output=True, text=True, timeout=600)


def _small_cache_flags(small_dir, slots_extra=3):
    with Checkpoint.open(small_dir) as ckpt:
        sizes = ModelSizes.from_checkpoint(ckpt)
    floor = minimum_budget(sizes)
    cache = sizes.expert_slot_bytes * (sizes.top_k + 1 + slots_extra)
    return ["--trunk-gb", f"{(floor.trunk_bytes + 1) / 1e9:.9f}",
            "--cache-gb", f"{cache / 1e9:.9f}"]


def test_cache_policy_never_changes_tokens_or_logits(small_dir, tmp_path):
    """Catches a policy whose eviction hands one expert's bytes to another."""
    flags = _small_cache_flags(small_dir)
    out = {}
    for pol in ONLINE_OBJECT_POLICIES:
        p = run("k3-run", small_dir, "--ids", "4,8,15,16,23,42", "--gen", 8, *flags,
                "--cache-policy", pol, "--logits-out", tmp_path / f"{pol}.npy",
                "--report-json", tmp_path / f"{pol}.json")
        assert p.returncode == 0, p.stderr
        out[pol] = (np.load(tmp_path / f"{pol}.npy"), json.loads((tmp_path / f"{pol}.json").read_text()))
    for pol in ONLINE_OBJECT_POLICIES:
        assert out[pol][1]["generated_ids"] == out["lru"][1]["generated_ids"]
        assert np.array_equal(out[pol][0].view(np.uint32), out["lru"][0].view(np.uint32))
        assert out[pol][1]["cache_policy"] == pol


def test_trace_records_every_request_and_replay_matches_the_live_cache(small_dir, tmp_path):
    """Catches a recorder that drops or reorders requests: a decode-only run's trace,
    replayed with the same policy and slot count, gives exactly the live cache's hits."""
    flags = _small_cache_flags(small_dir)
    trace, rep = tmp_path / "t.k3trace", tmp_path / "r.json"
    p = run("k3-run", small_dir, "--ids", "77", "--gen", 12, *flags, "--trace", trace,
            "--report-json", rep, "--prefill-chunk", 1)
    assert p.returncode == 0, p.stderr
    r = json.loads(rep.read_text())
    reader = TraceReader(trace)
    recs = reader.read_all()
    with Checkpoint.open(small_dir) as ckpt:
        cfg = ckpt.config
    assert reader.header.checkpoint == cfg.fingerprint()
    tokens_fed = 1 + 12 - 1          # the last generated token is not fed (nothing uses it)
    assert recs.size == tokens_fed * len(cfg.moe_layers) * cfg.num_experts_per_token
    assert set(np.unique(recs["phase"])) == {PHASE_PREFILL, PHASE_DECODE}
    assert np.array_equal(np.unique(recs["pos"]), np.arange(tokens_fed))
    assert r["cache_policy"] == DEFAULT_POLICY               # not given: the default
    live = replay(reader.layer_expert_keys(), r["cache_slots"], r["cache_policy"],
                  n_layers=cfg.num_hidden_layers, n_experts=cfg.num_experts)
    assert live["hits"] == round(r["cache_hit_rate"] * r["expert_requests"])
    assert live["requests"] == r["expert_requests"]


def test_trace_record_wrapper_and_size(tiny_dir, tmp_path):
    """Catches a record command with its own recording path, and a sizing that proposes
    an infeasible split."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("The capital of France is Paris. The capital of Italy is")
    trace = tmp_path / "t.k3trace"
    p = run("k3-trace", "record", tiny_dir, trace, "--prompt-file", prompt, "--gen", 6)
    assert p.returncode == 0, p.stderr
    direct = tmp_path / "d.k3trace"
    p = run("k3-run", tiny_dir, "--prompt-file", prompt, "--gen", 6, "--trace", direct)
    assert p.returncode == 0, p.stderr
    assert np.array_equal(TraceReader(trace).read_all(), TraceReader(direct).read_all())
    pack = tmp_path / "pk"
    assert run("k3-pack", tiny_dir, pack, "--quiet").returncode == 0
    p = run("k3-trace", "size", trace, "--budget-gb", "0.006", "--pack", pack,
            "--seq-mbps", 1500, "--rand-mbps", 900, "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    best = rep["best"]
    assert best["feasible"] and best["trunk_bytes"] + best["cache_bytes"] <= 6_000_000
    assert any(not s["feasible"] for s in rep["splits"])
    p = run("k3-trace", "size", trace, "--budget-gb", "0.006", "--pack", pack)
    assert p.returncode == 2 and "--seq-mbps" in p.stderr


def test_trace_record_never_runs_a_k3_run_found_on_path(tiny_dir, tmp_path):
    """Catches a record command that starts whatever `k3-run` comes first on PATH (another
    install, or none at all outside a venv) instead of the k3 beside this k3-trace."""
    import os
    import shutil
    import sys

    decoy = tmp_path / "bin"
    decoy.mkdir()
    (decoy / "k3-run").write_text("#!/bin/sh\nexit 97\n")
    (decoy / "k3-run").chmod(0o755)
    env = dict(os.environ, PATH=f"{decoy}{os.pathsep}{os.environ.get('PATH', '')}")
    k3_trace = shutil.which("k3-trace") or os.path.join(os.path.dirname(sys.executable), "k3-trace")
    control = subprocess.run(["k3-run", "--version"], env=env, capture_output=True)
    assert control.returncode == 97                   # the decoy is what PATH finds
    prompt = tmp_path / "p.txt"
    prompt.write_text("The capital of France is")
    trace = tmp_path / "t.k3trace"
    p = subprocess.run([k3_trace, "record", str(tiny_dir), str(trace), "--prompt-file",
                        str(prompt), "--gen", "2"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    assert TraceReader(trace).read_all().size > 0
