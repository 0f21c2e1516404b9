"""k3-doctor, the memory presets and the machine probe: decisions, refusals, cleanup."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from libk3 import budget
from libk3.machine import cpus as hwcpus, memory as hwmem, storage as hwstore
from libk3.doctor import advice
from libk3.doctor import report as doctor
from libk3.doctor.render import render_text
from libk3.doctor import timing
from libk3.errors import BudgetError, FormatError, UsageError
from libk3.io.checkpoint import Checkpoint
from libk3.budget import GB, ModelSizes

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
REAL_TRUNK = 108_811_877_376          # model.md §3.5
REAL_MODEL_LEVEL = 4_697_663_488
FAST = dict(seq_seconds=0.3, rand_seconds=0.3)


def _run_cli(*args, timeout=120, tmpdir=None):
    """The console script, as a user runs it; ``tmpdir``: its TMPDIR (where a probe file
    goes first)."""
    exe = shutil.which("k3-doctor")
    cmd = [exe] if exe else [sys.executable, "-c", "from k3_doctor.cli import main; main()"]
    env = None if tmpdir is None else {**os.environ, "TMPDIR": str(tmpdir)}
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _probe_files(d: Path) -> list:
    return sorted(p.name for p in Path(d).iterdir() if p.name.startswith(hwstore.PROBE_PREFIX))


def _probe_files_under(d: Path) -> list:
    return sorted(str(p) for p in Path(d).rglob(hwstore.PROBE_PREFIX + "*"))


@pytest.fixture
def probe_tmp(tmp_path):
    """A temporary directory for probe files on the tests' filesystem (the rule puts a
    probe there first: storage.probe_dir), empty, so a leftover is seen."""
    d = tmp_path / "probe-tmp"
    d.mkdir()
    return d


@pytest.fixture(scope="module")
def tiny_copy(tmp_path_factory):
    """A private copy of fixtures/tiny (tests mutate or write next to it)."""
    d = tmp_path_factory.mktemp("tiny") / "tiny"
    shutil.copytree(FIXTURE, d)
    return d


@pytest.fixture(scope="module")
def real_sparse(real_sparse_dir):
    """real-sparse (synthesised once per run, conftest) diagnosed once on an 8 GB machine."""
    d = real_sparse_dir
    diag = doctor.diagnose(d, quick=True, memory=hwmem.assumed_memory(8 * 10**9))
    return d, diag


@pytest.fixture(scope="module")
def real_sizes():
    return ModelSizes.from_config(doctor.reference_config())


# ---- presets ----------------------------------------------------------------------------

def test_presets_file_missing_key_is_an_error_naming_the_file(tmp_path):
    """Catches a preset reader that defaults a missing budget (or ignores unknown keys)."""
    shipped = budget.load_presets()
    assert list(shipped) == list(budget.PRESET_NAMES)              # control
    assert shipped["laptop"].trunk_gb == 3.7 and shipped["auto"].trunk_gb is None
    doc = yaml.safe_load(budget.PRESETS_FILE.read_text())
    del doc["presets"]["desktop"]["cache_gb"]
    doc["accounting"]["surprise"] = 1
    bad = tmp_path / "presets.yaml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(FormatError) as e:
        budget.load_presets(bad)
    assert str(bad) in e.value.one_line()
    assert "presets.desktop.cache_gb missing" in e.value.one_line()
    assert "accounting.surprise unknown" in e.value.one_line()


def test_presets_later_flag_overrides_earlier_in_argv_order():
    """Catches flags applied in a fixed order instead of the order the user typed."""
    a = budget.resolve_budget("laptop", cache_gb=2.0, order=["preset", "cache_gb"])
    b = budget.resolve_budget("laptop", cache_gb=2.0, order=["cache_gb", "preset"])
    assert a.cache_bytes == 2 * 10**9 and a.trunk_bytes == int(3.7 * GB)
    assert b.cache_bytes == int(0.4 * GB)                            # the preset came last
    c = budget.resolve_budget("desktop", trunk_gb=5.0)              # default: flags win
    assert c.trunk_bytes == 5 * 10**9 and c.cache_bytes == 10 * 10**9
    with pytest.raises(UsageError):
        budget.resolve_budget("tiny-laptop")
    with pytest.raises(UsageError):
        budget.resolve_budget("laptop", trunk_gb=-1.0)


def test_presets_budget_clamped_to_model_and_refused_below_the_floor(real_sizes):
    """Catches a budget larger than the model (wasted RAM) and a ring too small to hold
    the largest layer being accepted."""
    with Checkpoint.open(FIXTURE) as ck:
        tiny = ModelSizes.from_checkpoint(ck)
    b = budget.resolve_budget("laptop", model_sizes=tiny)
    assert b.trunk_bytes == tiny.trunk_bytes and b.cache_bytes == tiny.cache_all_bytes
    floor = budget.minimum_budget(real_sizes)
    assert floor.trunk_bytes == max(real_sizes.layer_bytes) == 2_341_299_200
    assert floor.cache_bytes == 17 * real_sizes.expert_slot_bytes == 17 * 17_555_456
    ok = budget.resolve_budget("laptop", model_sizes=real_sizes)        # control
    assert ok.trunk_bytes == int(3.7 * GB)
    assert budget.resolve_budget(None, trunk_gb=2.35, cache_gb=1.0, model_sizes=real_sizes)
    with pytest.raises(BudgetError):
        budget.resolve_budget(None, trunk_gb=2.3, cache_gb=1.0, model_sizes=real_sizes)
    with pytest.raises(BudgetError):
        budget.resolve_budget(None, trunk_gb=16.0, cache_gb=0.1, model_sizes=real_sizes)


def test_presets_auto_gives_trunk_first_and_refuses_4gb_for_k3(real_sizes):
    """Catches auto splitting memory evenly, exceeding available memory, or accepting a
    machine below the smallest working budget."""
    a8 = budget.resolve_budget("auto", mem=8 * 10**9, model_sizes=real_sizes)
    a32 = budget.resolve_budget("auto", mem=32 * 10**9, model_sizes=real_sizes)
    assert a32.trunk_bytes > a8.trunk_bytes and a32.cache_bytes == a8.cache_bytes
    assert budget.peak_bytes(a32, real_sizes) <= 0.95 * 32 * 10**9
    assert not budget.admission_problems(a8, real_sizes, 8 * 10**9)
    a256 = budget.resolve_budget("auto", mem=256 * 10**9, model_sizes=real_sizes)
    assert a256.trunk_bytes == real_sizes.trunk_bytes                 # every layer pinned
    fixed = budget.resolve_budget("auto", cache_gb=2.0, mem=32 * 10**9,
                                   model_sizes=real_sizes)
    assert fixed.cache_bytes == 2 * 10**9 and fixed.trunk_bytes < a32.trunk_bytes
    with pytest.raises(BudgetError) as e:
        budget.resolve_budget(None, mem=4 * 10**9, model_sizes=real_sizes)
    assert "smallest working budget" in e.value.one_line()


def test_presets_auto_prefers_the_overlapping_ring_and_falls_back_to_one_slot(real_sizes):
    """Catches auto taking a one-slot ring where two slots fit beside the cache floor, or
    refusing a machine that only a one-slot ring (the feasibility floor) fits."""
    overlap = budget.overlap_floor(real_sizes.layer_bytes)
    a8 = budget.resolve_budget("auto", mem=8 * 10**9, model_sizes=real_sizes)
    assert a8.trunk_bytes >= overlap
    a7 = budget.resolve_budget("auto", mem=7 * 10**9, model_sizes=real_sizes)
    assert budget.trunk_floor(real_sizes.layer_bytes) <= a7.trunk_bytes < overlap
    assert a7.cache_bytes == budget.minimum_budget(real_sizes).cache_bytes
    assert not budget.admission_problems(a7, real_sizes, 7 * 10**9)
    assert len(budget.plan_trunk(real_sizes.layer_bytes, a7.trunk_bytes).slots) == 1


def test_presets_trunk_plan_pins_largest_first_and_keeps_a_ring(real_sizes):
    """Catches pinning that leaves no room for the ring, or pins in layer order."""
    lap = budget.plan_trunk(real_sizes.layer_bytes, int(3.7 * GB))
    assert not lap.pinned and lap.streamed_bytes == real_sizes.trunk_bytes
    desk = budget.plan_trunk(real_sizes.layer_bytes, 16 * 10**9)
    assert 0 in desk.pinned                                   # layer 0 is the largest
    pinned = sum(real_sizes.layer_bytes[L] for L in desk.pinned)
    assert pinned + desk.ring_bytes <= 16 * 10**9
    unpinned = sorted((real_sizes.layer_bytes[L] for L in range(93) if L not in desk.pinned),
                      reverse=True)
    assert desk.ring_bytes == sum(unpinned[:2])
    assert desk.streamed_bytes == sum(unpinned)
    full = budget.plan_trunk(real_sizes.layer_bytes, real_sizes.trunk_bytes)
    assert len(full.pinned) == 93 and full.ring_bytes == 0 and full.streamed_bytes == 0
    with pytest.raises(BudgetError):
        budget.plan_trunk(real_sizes.layer_bytes, 10**9)


# ---- the machine probe --------------------------------------------------------------------

def _fake_cgroup_tree(root: Path, v2_leaf: str, v2_parent: str, v1_limit: str) -> tuple:
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 16000000 kB\nMemAvailable: 12000000 kB\n"
                                  "SwapTotal: 0 kB\n")
    (proc / "self" / "cgroup").write_text("4:memory:/job\n0::/user/job\n")
    cg2, cg1 = root / "cg2", root / "cg1"
    (cg2 / "user" / "job").mkdir(parents=True)
    (cg2 / "user" / "memory.max").write_text(v2_parent + "\n")
    (cg2 / "user" / "job" / "memory.max").write_text(v2_leaf + "\n")
    (cg1 / "job").mkdir(parents=True)
    (cg1 / "job" / "memory.limit_in_bytes").write_text(v1_limit + "\n")
    (proc / "self" / "mounts").write_text(
        f"cgroup2 {cg2} cgroup2 rw 0 0\ncgroup {cg1} cgroup rw,memory 0 0\n")
    return proc


def test_hwprobe_cgroup_limit_is_the_smallest_on_the_path(tmp_path):
    """Catches reading only the leaf group, treating 'max' or v1's 2^63 as a limit, or
    ignoring the cgroup when MemAvailable is larger."""
    proc = _fake_cgroup_tree(tmp_path / "a", "max", "6000000000", "9223372036854771712")
    mem = hwmem.probe_memory(proc=str(proc))
    assert mem.cgroup_limit_bytes == 6_000_000_000 and "v2" in mem.cgroup_source
    assert mem.available_bytes == 12_000_000 * 1024
    assert mem.usable_bytes == 6_000_000_000
    proc = _fake_cgroup_tree(tmp_path / "b", "max", "max", "9223372036854771712")
    mem = hwmem.probe_memory(proc=str(proc))                         # control: no limit
    assert mem.cgroup_limit_bytes is None and mem.usable_bytes == 12_000_000 * 1024
    proc = _fake_cgroup_tree(tmp_path / "c", "max", "max", "3000000000")
    assert hwmem.probe_memory(proc=str(proc)).cgroup_limit_bytes == 3_000_000_000
    fake = hwmem.probe_memory(override_bytes=8 * 10**9)
    assert fake.assumed and fake.usable_bytes == 8 * 10**9


def test_hwprobe_never_times_holes_and_uses_real_shards_in_place(tmp_path, probe_tmp):
    """Catches timing a sparse file (zeros at memory speed) as disk speed, writing a
    probe file next to shards that could be read instead, or leaving the probe behind."""
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    with open(sparse / "model-00001-of-000001.safetensors", "wb") as f:
        f.truncate(200 << 20)
    assert not hwstore.holds_data(sparse / "model-00001-of-000001.safetensors")
    info = hwstore.probe_storage(sparse, model_files=list(sparse.iterdir()),
                                 probe_bytes=40 << 20, min_model_bytes=1, tmp=probe_tmp,
                                 **FAST)
    assert info["measured_on"] == "temporary file" and "sparse" in " ".join(info["notes"])
    assert info["probe_dir"] == str(probe_tmp) and _probe_files(probe_tmp) == []
    dense = tmp_path / "dense"
    dense.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        (dense / f"s{i}.safetensors").write_bytes(rng.bytes(40 << 20))
    assert hwstore.holds_data(dense / "s0.safetensors")                  # control
    before = sorted(p.name for p in dense.iterdir())
    info = hwstore.probe_storage(dense, model_files=sorted(dense.iterdir()),
                                 min_model_bytes=1, tmp=probe_tmp, **FAST)
    assert info["measured_on"] == "model shards" and info["probe_dir"] is None
    r = info["reads"]
    assert r["seq_best_bps"] > 0 and set(r["rand_bps"]) == {"1", "4", "16"}
    assert r["cached"] == (not info["o_direct"])
    assert sorted(p.name for p in dense.iterdir()) == before
    assert _probe_files(sparse) == []


def test_hwprobe_kernel_figures_come_from_the_numba_kernels(monkeypatch):
    """Catches a stand-in (numpy, a fixed figure, another function) passed off as the
    speed of the kernels k3-run calls, or bytes per second miscounted. The engine's two
    matmuls are wrapped so that each call advances the probe's clock by exactly ``tick``
    (the only time that passes): each figure must then be the bytes of one call over
    ``tick``, and every call must get the engine's operands (BF16 bits [rows, cols]; MXFP4
    nibbles [rows, cols/2] and scales [rows, cols/32])."""
    import types
    from libk3.model import ops
    tick, rows, cols = 0.01, 256, 256
    clock = {"now": 0.0, "reads": 0}
    seen = {"bf16": [], "mxfp4": []}

    def ticking(key, real):
        def call(*args):
            seen[key].append(tuple((a.dtype.str, a.shape) for a in args[:-1]))
            clock["now"], clock["reads"] = clock["now"] + tick, 0
            return real(*args)
        return call

    def perf_counter():
        clock["reads"] += 1       # a probe timing something else would wait here forever
        assert clock["reads"] < 1000, "the probe's clock ran without a kernel call"
        return clock["now"]
    monkeypatch.setattr(ops, "bf16_matmul", ticking("bf16", ops.bf16_matmul))
    monkeypatch.setattr(ops, "mxfp4_matmul", ticking("mxfp4", ops.mxfp4_matmul))
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=perf_counter))
    k = timing.measure_kernels(seconds=0.1, rows=rows, cols=cols, working_set=1 << 20)
    for key, nbytes, operands in (
            ("bf16", rows * cols * 2, (("<u2", (rows, cols)),)),
            ("mxfp4", rows * cols * 17 / 32, (("|u1", (rows, cols // 2)),
                                              ("|u1", (rows, cols // 32))))):
        assert len(seen[key]) >= 3 and set(seen[key]) == {operands}, (key, seen[key][:3])
        assert k[f"{key}_bytes_per_s"] == pytest.approx(nbytes / tick, rel=1e-9), (key, k)


def test_hwprobe_kernel_shapes_are_one_decode_step_of_the_model():
    """Catches a kernel mix that leaves out lm_head or a layer, or miscounts the experts'
    three matrices (w1 and w3 [inter, lat], w2 [lat, inter]) per MoE layer and top_k."""
    from libk3.config import load_config
    from libk3.io import inventory
    cfg = load_config(FIXTURE)
    bf16, mx = timing.kernel_shapes(cfg)
    mats = [sp for L in range(cfg.num_hidden_layers) for sp in inventory.layer_trunk(cfg, L)
            if sp.kind == inventory.MATRIX]
    assert sum(bf16.values()) == len(mats) + 1
    assert bf16[(cfg.vocab_size, cfg.hidden_size)] >= 1
    assert sum(mx.values()) == 3 * len(cfg.moe_layers) * cfg.num_experts_per_token
    k = timing.measure_kernels(seconds=0.05, bf16_shapes={(64, 256): 3, (256, 64): 1},
                                mxfp4_shapes=mx, working_set=1 << 20)
    assert k["bf16_shapes"] == 2 and k["mxfp4_shapes"] == len(mx)
    assert k["bf16_bytes_per_s"] > 0 and k["mxfp4_bytes_per_s"] > 0


# ---- the doctor ---------------------------------------------------------------------------

def test_doctor_cli_tiny_json_and_text_report_can_run(tmp_path, probe_tmp):
    """Catches a report that fails on a healthy checkpoint, a JSON mode that prints text,
    a next command that is not the pack-then-run pair, or a probe file left behind (with
    --quick the pack's O_DIRECT check writes one, in TMPDIR: same filesystem)."""
    pack = tmp_path / "pack"
    res = _run_cli(FIXTURE, "--pack", pack, "--quick", "--json", "--assume-memory-gb", 8,
                   tmpdir=probe_tmp)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["can_run"] and rep["problems"] == []
    m = rep["model"]
    assert m["config"]["ok"] and m["shards"]["present"] == m["shards"]["expected"] == 14
    assert m["pack"]["state"] == "missing"
    assert rep["decision"]["pick"] == "laptop"
    assert rep["next_commands"][0].startswith("k3-pack ")
    assert "--preset laptop" in rep["next_commands"][1]
    assert _probe_files(FIXTURE) == [] and not pack.exists()
    assert [s["probe_dir"] for s in rep["storage"] if s["role"] == "pack"] == [str(probe_tmp)]
    assert _probe_files(probe_tmp) == []
    res = _run_cli(FIXTURE, "--quick", "--assume-memory-gb", 8, tmpdir=probe_tmp)
    assert res.returncode == 0 and "this machine can run the model" in res.stdout
    assert "pick: laptop" in res.stdout


def test_doctor_cli_usage_errors_exit_2(tmp_path):
    """Catches usage errors reported as 'cannot run' (1) or as a traceback."""
    res = _run_cli(tmp_path / "nope", "--quick")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    res = _run_cli("--quick", "--assume-memory-gb", "-3")
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_doctor_small_measures_disk_and_estimates_every_preset(small_dir, tmp_path,
                                                               probe_tmp):
    """Catches estimates without measurements, a probe file left behind, or a pick that
    does not hold the whole small model."""
    diag = doctor.diagnose(small_dir, tmp_path / "pack",
                           disk=doctor.DiskProbe(probe_bytes=48 << 20, tmp=probe_tmp, **FAST),
                           memory=hwmem.assumed_memory(8 * 10**9))
    rep = diag.report
    assert diag.exit_status == 0, rep["problems"]
    st = rep["storage"][0]
    assert st["measured"] and st["reads"]["rand_best_bps"] > 0
    assert st["measured_on"] == "temporary file" and st["probe_dir"] == str(probe_tmp)
    assert rep["kernels"]["bf16_bytes_per_s"] > 0
    rows = rep["decision"]["presets"]
    assert all(rows[n]["estimate"]["seconds_per_token"] > 0 for n in budget.NAMED)
    lap = rows["laptop"]["estimate"]
    assert lap["expert_hit_rate"] == 1.0 and lap["trunk_streamed_bytes"] == 0
    assert rep["decision"]["pick"] == "laptop" and "whole model" in rep["decision"]["why"]
    assert _probe_files(small_dir) == [] and not (tmp_path / "pack").exists()
    assert _probe_files(probe_tmp) == []
    json.dumps(rep)                                   # JSON-ready
    assert "== verdict: this machine can run" in render_text(rep)


def test_doctor_missing_shard_fails_naming_the_shard(tiny_copy, tmp_path):
    """Catches a partial download reported as healthy, or an error that does not say
    which file to fetch again."""
    d = tmp_path / "partial"
    shutil.copytree(tiny_copy, d)
    control = doctor.diagnose(d, quick=True, memory=hwmem.assumed_memory(8 * 10**9))
    assert control.exit_status == 0
    (d / "model-00007-of-000014.safetensors").unlink()
    diag = doctor.diagnose(d, quick=True, memory=hwmem.assumed_memory(8 * 10**9))
    assert diag.exit_status == 1
    probs = diag.report["problems"]
    assert any("model-00007-of-000014.safetensors" in p and "missing" in p for p in probs)
    assert diag.report["model"]["shards"]["present"] == 13
    assert diag.report["next_commands"] == []


def test_doctor_truncated_shard_fails_naming_the_shard(tiny_copy, tmp_path):
    """Catches a size check against the index's total instead of each shard's header."""
    d = tmp_path / "trunc"
    shutil.copytree(tiny_copy, d)
    victim = d / "model-00003-of-000014.safetensors"
    os.truncate(victim, victim.stat().st_size - 100)
    res = _run_cli(d, "--quick", "--json")
    assert res.returncode == 1
    rep = json.loads(res.stdout)
    assert [p for p in rep["problems"] if "model-00003-of-000014.safetensors" in p
            and "truncated" in p]
    assert not rep["can_run"]


def test_doctor_stale_pack_is_reported_and_a_new_directory_suggested(tiny_copy, small_dir,
                                                                     tmp_path):
    """Catches a pack of another checkpoint being taken as complete."""
    from libk3.pack.writer import pack

    out = tmp_path / "pack"
    with Checkpoint.open(tiny_copy) as ck:
        pack(ck, out, progress=False)
    mem = hwmem.assumed_memory(8 * 10**9)
    same = doctor.diagnose(tiny_copy, out, quick=True, memory=mem)      # control
    assert same.report["model"]["pack"]["state"] == "complete"
    assert len(same.report["next_commands"]) == 1
    assert same.report["next_commands"][0].startswith("k3-run ")
    other = doctor.diagnose(small_dir, out, quick=True, memory=mem)
    assert other.report["model"]["pack"]["state"] == "stale"
    assert other.report["next_commands"][0].startswith("k3-pack ")
    assert str(out) not in other.report["next_commands"][0].split()[-1:]


def test_doctor_too_little_disk_for_the_pack_fails(tiny_copy, tmp_path):
    """Catches a pack destination without room being accepted."""
    mem = hwmem.assumed_memory(8 * 10**9)
    ok = doctor.diagnose(tiny_copy, tmp_path / "p", quick=True, memory=mem)
    assert ok.exit_status == 0
    full = doctor.diagnose(tiny_copy, tmp_path / "p", quick=True, memory=mem,
                           pack_free_bytes=0)
    assert full.exit_status == 1
    assert [p for p in full.report["problems"] if p.startswith("disk:")]


def test_doctor_disk_problem_tells_the_pack_size_from_the_free_space(tiny_copy, tmp_path):
    """Catches the failing disk check printing both sizes as 0.00 GB for a small model, or
    naming the disk probe's directory: the bytes to write and the bytes free read
    differently, at the pack's destination."""
    import re
    mem = hwmem.assumed_memory(8 * 10**9)
    full = doctor.diagnose(tiny_copy, tmp_path / "p", quick=True, memory=mem,
                           pack_free_bytes=1000)
    (problem,) = [p for p in full.report["problems"] if p.startswith("disk:")]
    need, free = re.match(r"disk: the pack needs (.+?) more at .+?, only (.+?) free",
                          problem).groups()
    assert need != free and "GB" not in need + free, problem
    assert f"at {tmp_path / 'p'}," in problem          # the destination, not a probe dir


def test_doctor_real_sparse_reports_real_sizes_and_picks_laptop_at_8gb(real_sparse):
    """Catches sizes derived from apparent file sizes or the wrong inventory, a pack size
    that is not the trunk, and a pick that does not fit an 8 GB machine."""
    d, diag = real_sparse
    rep = diag.report
    sz = rep["model"]["sizes"]
    assert sz["exact"] and sz["trunk_bytes"] == REAL_TRUNK
    assert sz["model_level_bytes"] == REAL_MODEL_LEVEL
    assert sz["experts_total"] == 82_432 and sz["expert_bytes"] == 17_547_264
    need = rep["model"]["pack"]["trunk_bytes_needed"]
    assert REAL_TRUNK <= need < 109.0e9 and round(need / 1e9) == 109
    dec = rep["decision"]
    assert dec["pick"] == "laptop"
    assert not [p for p in rep["problems"] if p.startswith("memory")]
    assert "sparse" in " ".join(rep["warnings"])
    disk = rep["disk_for_pack"]
    assert bool([p for p in rep["problems"] if p.startswith("disk:")]) == \
        (disk["free_bytes"] < need)
    assert rep["exit_status"] == (1 if rep["problems"] else 0)


def test_doctor_refuses_4gb_for_real_sparse_but_not_for_tiny(real_sparse):
    """Catches a memory check that passes any machine, or one that refuses models that
    do fit (the tiny control)."""
    _, diag = real_sparse
    dec = advice.decide(diag.sizes, hwmem.assumed_memory(4 * 10**9))
    assert dec["pick"] is None
    assert [p for p in dec["problems"] if p.startswith("memory:") and "smallest working" in p]
    tiny = doctor.diagnose(FIXTURE, quick=True, memory=hwmem.assumed_memory(4 * 10**9))
    assert tiny.exit_status == 0 and tiny.report["decision"]["pick"] == "laptop"


def test_doctor_machine_only_report_without_a_model():
    """Catches a doctor that needs a model argument to say anything."""
    diag = doctor.diagnose(None, quick=True, memory=hwmem.assumed_memory(16 * 10**9))
    rep = diag.report
    assert rep["model"] is None and rep["storage"] == [] and diag.exit_status == 0
    assert rep["decision"]["sizes_of"].startswith("Kimi K3")
    assert rep["machine"]["numba"]["layer"] in ("tbb", "omp", "workqueue")
    low = doctor.diagnose(None, quick=True, memory=hwmem.assumed_memory(4 * 10**9))
    assert low.exit_status == 1


def test_doctor_estimate_follows_the_stated_formula(real_sizes):
    """Catches an estimate that ignores pinning, the cache, or the kernels."""
    b = budget.resolve_budget("laptop", model_sizes=real_sizes)
    k = {"bf16_bytes_per_s": 1e10, "mxfp4_bytes_per_s": 2e10, "source": "test"}
    est = advice.estimate(real_sizes, b, 2e9, 1e9, k)
    hit = (b.cache_bytes // real_sizes.expert_slot_bytes) / 82_432
    assert est["expert_hit_rate"] == pytest.approx(hit)
    assert est["trunk_io_s"] == pytest.approx(real_sizes.trunk_bytes / 2e9)
    assert est["expert_io_s"] == pytest.approx(92 * 16 * (1 - hit) * 17_547_264 / 1e9)
    want_compute = ((real_sizes.bf16_trunk_bytes + real_sizes.lm_head_bytes) / 1e10
                    + 92 * 16 * 17_547_264 / 2e10)
    assert est["compute_s"] == pytest.approx(want_compute)
    srv = advice.estimate(real_sizes, budget.resolve_budget("server", model_sizes=real_sizes),
                          2e9, 1e9, k)
    assert srv["trunk_io_s"] == 0 and srv["seconds_per_token"] < est["seconds_per_token"]
    assert advice.estimate(real_sizes, b, None, None, k) is None


def _wait_for_probe(d: Path, proc, full_size=None, timeout=60.0) -> Path:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        files = [p for p in d.iterdir() if p.name.startswith(hwstore.PROBE_PREFIX)]
        if files and (full_size is None or _size(files[0]) >= full_size):
            return files[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    raise AssertionError("the probe file never appeared")


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return -1


@pytest.mark.parametrize("sig, when", [(signal.SIGTERM, "writing"),
                                      (signal.SIGTERM, "reading"),
                                      (signal.SIGINT, "reading")],
                         ids=["SIGTERM-writing", "SIGTERM-reading", "SIGINT-reading"])
def test_doctor_probe_file_removed_on_sigterm(tmp_path, probe_tmp, sig, when):
    """Catches a probe file left behind when the doctor is terminated (or Ctrl-C'd)
    mid-measurement, or one written into the directory probed instead of the temporary
    directory on its filesystem."""
    d = tmp_path / "disk"
    d.mkdir()
    size_mb = 400 if when == "writing" else 120
    exe = shutil.which("k3-doctor")
    cmd = [exe] if exe else [sys.executable, "-c", "from k3_doctor.cli import main; main()"]
    proc = subprocess.Popen(cmd + ["--pack", str(d), "--probe-size-mb", str(size_mb)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(probe_tmp)},
                            # a shell may start us with SIGINT ignored; the child inherits it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        probe = _wait_for_probe(probe_tmp, proc,
                                None if when == "writing" else size_mb * 10**6)
        assert _probe_files(d) == []
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "interrupted" in err
    assert not probe.exists() and _probe_files(probe_tmp) == [] and _probe_files(d) == []


@pytest.fixture
def created_probes(monkeypatch):
    """Every probe file storage creates, by path (they are gone again afterwards)."""
    made = []
    real = hwstore._create_probe

    def spy(directory, into):
        try:
            real(directory, into)
        finally:
            if "path" in into:
                made.append(Path(into["path"]))
    monkeypatch.setattr(hwstore, "_create_probe", spy)
    return made


def test_probe_never_goes_into_the_model_the_pack_or_a_git_checkout(tmp_path, monkeypatch,
                                                                    created_probes):
    """Catches a probe file written into the model's or the pack's directory, or into a
    git checkout (where a leftover would be committed), when the temporary directory is
    one of them: it goes to the nearest ancestor outside them instead; control: a
    temporary directory outside them is used."""
    model, pack = tmp_path / "model", tmp_path / "pack"
    for d in (model / "tmp", pack / "tmp"):
        d.mkdir(parents=True)
    info = hwstore.probe_storage(model, measure=False, tmp=model / "tmp")
    assert info["probe_dir"] == str(tmp_path)
    info = hwstore.probe_storage(tmp_path / "other", measure=False, avoid=(pack,),
                                 tmp=pack / "tmp")
    assert info["probe_dir"] == str(tmp_path)
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=60)
    for d in (repo / "models" / "m", repo / "tmp"):
        d.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(repo / "tmp"))   # TMPDIR in the checkout
    info = hwstore.probe_storage(repo / "models" / "m", measure=False)
    assert info["probe_dir"] == str(tmp_path)
    outside = tmp_path / "t"
    outside.mkdir()
    info = hwstore.probe_storage(repo / "models" / "m", measure=False, tmp=outside)
    assert info["probe_dir"] == str(outside)                            # control
    assert [p.parent for p in created_probes] == [tmp_path] * 3 + [outside]
    assert not any(repo in p.parents or model in p.parents or pack in p.parents
                   for p in created_probes)
    assert _probe_files_under(tmp_path) == []


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt here, as in a tool (a test runner may ignore it)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("how", ["KeyboardInterrupt", "SIGINT", "SIGTERM"])
def test_probe_removed_when_the_read_is_interrupted(tmp_path, probe_tmp, monkeypatch,
                                                    sigint_raises, how):
    """Catches a probe file left behind by Ctrl-C (or SIGTERM) while it is being read:
    the interrupt is injected into the read loop while the file exists."""
    seen = []

    def interrupted(self):
        seen.append(_probe_files(probe_tmp))
        if how == "KeyboardInterrupt":
            raise KeyboardInterrupt
        signal.raise_signal(getattr(signal, how))
        time.sleep(5)                   # the handler raises before this returns
        raise AssertionError("the signal did not interrupt the read")
    monkeypatch.setattr(hwstore._Reads, "run", interrupted)
    with pytest.raises(KeyboardInterrupt) as e:
        hwstore.probe_storage(tmp_path / "disk", probe_bytes=4 << 20, tmp=probe_tmp, **FAST)
    assert len(seen) == 1 and len(seen[0]) == 1                  # it existed while read
    assert isinstance(e.value, hwstore.ProbeInterrupted) == (how == "SIGTERM")
    assert _probe_files_under(tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_probe_removed_when_a_signal_comes_while_it_is_created(tmp_path, probe_tmp,
                                                               monkeypatch, sigint_raises,
                                                               sig, created_probes):
    """Catches the probe's name lost when a signal comes while the file is created (the
    handler raised before the name was known, and the file stayed): the signal is sent
    right after the file exists, before its name is returned."""
    real = tempfile.mkstemp

    def mkstemp(*args, **kwargs):
        out = real(*args, **kwargs)
        signal.raise_signal(sig)
        return out
    monkeypatch.setattr(hwstore.tempfile, "mkstemp", mkstemp)
    with pytest.raises(KeyboardInterrupt) as e:
        hwstore.probe_storage(tmp_path / "disk", measure=False, tmp=probe_tmp)
    assert isinstance(e.value, hwstore.ProbeInterrupted) == (sig == signal.SIGTERM)
    assert [p.parent for p in created_probes] == [probe_tmp]     # it was made, there
    assert _probe_files_under(tmp_path) == []


# ---- a busy machine, unreliable timings -------------------------------------------------

BUSY = hwcpus.Load(usable=2, others=1.5, steal=0.4, loadavg_1m=3.25, seconds=0.5)
IDLE = hwcpus.Load(usable=2, others=0.02, steal=0.0, loadavg_1m=0.1, seconds=0.5)
BUSY_WHY = "other processes used 1.5 of 2 CPUs; the hypervisor took 0.4 of 2 CPUs (steal)"


def _fake_kernels(monkeypatch, bf16: list, mxfp4: list):
    """measure_kernels returns the next of these figures (B/s) per call; the trunk decode
    rate is fixed: no kernel runs."""
    figures = iter(zip(bf16, mxfp4))

    def measure(**kw):
        b, m = next(figures)
        return {"source": "libk3 kernels", "note": None, "working_set_bytes": 1,
                "bf16_bytes_per_s": b, "mxfp4_bytes_per_s": m, "bf16_shapes": 1,
                "mxfp4_shapes": 1}
    monkeypatch.setattr(timing, "measure_kernels", measure)
    monkeypatch.setattr(timing, "measure_trunk_decode", lambda threads, **kw: {
        "decode_bytes_per_s": 4e9, "fraction": 0.7, "threads": threads,
        "sample_bytes": 1, "sample": "fake"})


def test_doctor_busy_machine_warning_in_text_and_json(monkeypatch):
    """Catches a busy machine (others' load and steal over BUSY_CPUS) not reported, or
    reported without its reason, in the text report or in --json: k3-doctor's own front
    end, with the load sample replaced."""
    from click.testing import CliRunner
    from k3_doctor import cli as doctor_cli
    from libk3.machine import threads

    monkeypatch.setattr(hwcpus, "sample_load", lambda *a, **k: BUSY)
    monkeypatch.setattr(threads, "prepare", lambda *a, **k: None)   # numba is loaded here
    args = ["--quick", "--quiet", "--assume-memory-gb", "16"]
    res = CliRunner().invoke(doctor_cli.main, args + ["--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["machine"]["load"]["busy"] == BUSY_WHY.split("; ")
    assert rep["machine"]["load"]["others"] == 1.5
    busy = [w for w in rep["warnings"] if w.startswith("the machine is busy")]
    assert busy and f"({BUSY_WHY})" in busy[0]
    res = CliRunner().invoke(doctor_cli.main, args)
    assert res.exit_code == 0, res.output
    assert (f"load: {', '.join(BUSY.busy)} (sampled 0.5 s; load average 3.25)"
            in res.stdout)
    assert f"warning: the machine is busy ({BUSY_WHY})" in res.stdout


def test_doctor_kernel_timings_far_apart_are_unreliable_with_a_range(monkeypatch):
    """Catches two kernel timings further apart than SPREAD reported as one trusted
    figure: the report says unreliable, why, both figures as a range, and estimates with
    the faster."""
    monkeypatch.setattr(hwcpus, "sample_load", lambda *a, **k: IDLE)
    _fake_kernels(monkeypatch, [1e9, 3e9], [2e9, 2.1e9])
    rep = doctor.diagnose(None, memory=hwmem.assumed_memory(16 * 10**9)).report
    k = rep["kernels"]
    assert k["unreliable"] == "two bf16 timings 1.00 and 3.00 GB/s"       # mxfp4 within
    assert k["bf16_range_bytes_per_s"] == [1e9, 3e9] and k["bf16_bytes_per_s"] == 3e9
    assert k["mxfp4_range_bytes_per_s"] == [2e9, 2.1e9]
    assert "kernel timings are unreliable: two bf16 timings 1.00 and 3.00 GB/s" \
        in rep["warnings"]
    assert json.loads(json.dumps(rep))["kernels"]["unreliable"] == k["unreliable"]
    text = render_text(rep)
    assert ("unreliable (two bf16 timings 1.00 and 3.00 GB/s): measured twice, BF16 "
            "1,000 MB/s to 3,000 MB/s, MXFP4 2,000 MB/s to 2,100 MB/s") in text
    assert "load: the CPUs were free" in text and "busy" not in text


def test_doctor_idle_machine_and_close_timings_say_nothing(monkeypatch):
    """Catches a warning on a quiet machine: idle load and two timings within SPREAD
    give no busy or unreliable line (the control for the two tests above)."""
    monkeypatch.setattr(hwcpus, "sample_load", lambda *a, **k: IDLE)
    _fake_kernels(monkeypatch, [2e9, 2e9 * (1 + timing.SPREAD) * 0.99], [3e9, 3e9])
    rep = doctor.diagnose(None, memory=hwmem.assumed_memory(16 * 10**9)).report
    assert rep["kernels"]["unreliable"] is None and rep["machine"]["load"]["busy"] == []
    assert not [w for w in rep["warnings"] if "busy" in w or "unreliable" in w]
    text = render_text(rep)
    assert "load: the CPUs were free" in text
    assert "unreliable" not in text and "busy" not in text


def test_kernel_timings_on_a_busy_machine_are_unreliable(monkeypatch):
    """Catches kernel figures trusted although the load sampled before a timing was
    busy, or two timings just past SPREAD trusted."""
    loads = iter([IDLE, BUSY])
    monkeypatch.setattr(hwcpus, "sample_load", lambda *a, **k: next(loads))
    _fake_kernels(monkeypatch, [2e9, 2e9], [3e9, 3e9])
    k = timing.measure_kernels_twice()
    assert k["unreliable"] == BUSY_WHY and [x["busy"] for x in k["load"]] == \
        [[], BUSY_WHY.split("; ")]
    monkeypatch.setattr(hwcpus, "sample_load", lambda *a, **k: IDLE)
    _fake_kernels(monkeypatch, [2e9, 2e9], [3e9, 3e9 * (1 + timing.SPREAD) * 1.01])
    k = timing.measure_kernels_twice()
    assert k["unreliable"].startswith("two mxfp4 timings 3.00 and ")


def test_doctor_compression_advice_both_ways(real_sizes):
    """Catches advice that ignores the disk, the decoder or pinning: laptop at 8 GB with a
    slow disk says compress (and its s/token falls); a disk faster than the decoder, or
    memory that pins the whole trunk, says do not."""
    k = {"bf16_bytes_per_s": 1e10, "mxfp4_bytes_per_s": 2e10, "source": "test"}
    dec = {"decode_bytes_per_s": 4e9, "fraction": 0.67}

    def advice_at(mem_gb, seq_bps):
        d = advice.decide(real_sizes, hwmem.assumed_memory(int(mem_gb * 1e9)),
                          seq_bps=seq_bps, rand_bps=1e9, kernels=k)
        return advice.compression_advice(d["presets"][d["pick"]]["estimate"], seq_bps, dec)

    slow = advice_at(8, 1e9)
    assert slow["recommend"] is True
    streamed = slow["trunk_streamed_bytes"]
    assert slow["seconds_per_token_raw"] - slow["seconds_per_token_compressed"] == \
        pytest.approx(streamed / 1e9 - max(0.67 * streamed / 1e9, streamed / 4e9))
    fast = advice_at(8, 8e9)
    assert fast["recommend"] is False and "would not beat" in fast["why"]
    pinned = advice_at(2000, 1e9)
    assert pinned["recommend"] is False and pinned["trunk_streamed_bytes"] == 0
    assert advice.compression_advice(None, 1e9, dec)["recommend"] is None


def test_doctor_cli_recommends_compressing_with_a_slow_disk_override(small_dir, tmp_path,
                                                                    probe_tmp):
    """Catches --assume-read-mbps / --assume-decode-mbps not reaching the advice or the
    next command: a 1 MB/s disk and a fast decoder say compress (k3-pack ...
    --compress-trunk), on exactly those rates; the same decision turned (no) leaves
    --compress-trunk out of the next command."""
    p = subprocess.run(["k3-doctor", str(small_dir), "--pack", str(tmp_path / "p"), "--json",
                        "--assume-memory-gb", "0.38", "--assume-read-mbps", "1",
                        "--assume-decode-mbps", "10000", "--probe-size-mb", "48"],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(probe_tmp)})
    rep = json.loads(p.stdout)
    yes = rep["decision"]["compression"]
    assert yes["recommend"] is True and "--compress-trunk" in rep["next_commands"][0], yes
    assert yes["read_bytes_per_s"] == 1e6 and yes["decode"]["decode_bytes_per_s"] == 1e10
    assert _probe_files(probe_tmp) == [] and _probe_files(small_dir) == []
    turned = {**rep["decision"], "compression": {**yes, "recommend": False}}
    no = doctor._next_steps(small_dir, tmp_path / "p", tmp_path / "p", rep["model"], turned,
                            rep["problems"])
    assert no["commands"][0].startswith("k3-pack ") and "--compress" not in no["commands"][0]


def test_doctor_counts_a_draft_and_says_whether_drafting_pays(tmp_path):
    """Catches a draft left out of the memory plan, a bad draft that passes, and an
    advice that ignores the cost of wide passes: the peaks grow by the draft's bytes, a
    damaged draft is a problem naming its file, and drafting pays when the trunk's reads
    dominate a pass but not when the experts' do."""
    import shutil
    mem = hwmem.assumed_memory(8 * 10**9)
    plain = doctor.diagnose(FIXTURE, quick=True, memory=mem)
    drafted = doctor.diagnose(FIXTURE, quick=True, memory=mem, draft=FIXTURE / "draft")
    dr = drafted.report["decision"]["drafting"]
    assert dr["ok"] and dr["bytes"] > 0 and drafted.exit_status == 0
    grow = (drafted.report["decision"]["presets"]["laptop"]["peak_bytes"]
            - plain.report["decision"]["presets"]["laptop"]["peak_bytes"])
    assert grow >= dr["bytes"]
    bad = tmp_path / "draft"
    shutil.copytree(FIXTURE / "draft", bad)
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:4096])
    broken = doctor.diagnose(FIXTURE, quick=True, memory=mem, draft=bad)
    assert broken.exit_status == 1
    assert any("draft" in p and "model.safetensors" in p for p in broken.report["problems"])
    kernels = {"bf16_bytes_per_s": 1e10}
    trunk_bound = {"trunk_io_s": 20.0, "dense_compute_s": 1.0, "expert_io_s": 4.0,
                   "expert_compute_s": 1.0, "seconds_per_token": 26.0}
    expert_bound = dict(trunk_bound, trunk_io_s=0.0, dense_compute_s=0.2, expert_io_s=9.0,
                        seconds_per_token=10.2)
    yes = advice.drafting_advice(trunk_bound, 10**9, 10**9, kernels, 7)
    no = advice.drafting_advice(expert_bound, 10**9, 10**9, kernels, 7)
    assert yes["pays"] and yes["rows"][1]["proposals"] > 0 and yes["rows"][1]["vs_plain"] < 0.6
    assert [r["vs_plain"] for r in yes["rows"]] == sorted(r["vs_plain"] for r in yes["rows"])[::-1]
    assert no["rows"][1]["vs_plain"] > yes["rows"][1]["vs_plain"]
