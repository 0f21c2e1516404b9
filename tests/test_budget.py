"""One trunk-feasibility rule: what `k3-trace size` recommends, k3-run admits (formats/presets.md 2)."""

from __future__ import annotations

import json
import subprocess

import pytest

from libk3.errors import BudgetError
from libk3.io.checkpoint import Checkpoint
from libk3.pack.writer import pack
from libk3.budget import (Budget, ModelSizes, admission_problems, floor_problems,
                          minimum_budget, plan_trunk, resolve_budget, trunk_floor)
from libk3.trace.sizing import size_budget
from libk3.synth.traces import write_synth_trace

ROOMY = 10**12          # machine memory: only the floors can refuse a split


@pytest.fixture(scope="module")
def tiny_sizes(tiny_dir):
    with Checkpoint.open(tiny_dir) as ckpt:
        return ModelSizes.from_checkpoint(ckpt)


@pytest.fixture(scope="module")
def tiny_pack_trace(tiny_dir, tmp_path_factory, tiny_sizes):
    d = tmp_path_factory.mktemp("budget")
    with Checkpoint.open(tiny_dir) as ckpt:
        pack(ckpt, d / "pk", progress=False)
        cfg = ckpt.config
    trace = write_synth_trace(d / "t.k3trace", 40, n_layers=cfg.num_hidden_layers,
                              n_experts=cfg.num_experts, top_k=cfg.num_experts_per_token,
                              expert_bytes=cfg.expert_bytes)
    return d / "pk", trace


def _admitted(trunk, cache, sizes) -> bool:
    problems = admission_problems(Budget(trunk, cache, None, ()), sizes, ROOMY)
    try:
        resolve_budget(None, trunk_gb=trunk / 1e9, cache_gb=cache / 1e9, model_sizes=sizes)
    except BudgetError:
        return False
    return not problems


def test_budget_trunk_of_one_largest_layer_is_admitted_as_sizing_plans_it(tiny_sizes):
    """Catches admission requiring two ring slots where the ring runs with one (sizing
    then recommended a split k3-run refused: largest layer + 1 byte)."""
    cache = minimum_budget(tiny_sizes).cache_bytes
    largest = max(tiny_sizes.layer_bytes)
    assert _admitted(largest + 1, cache, tiny_sizes)
    assert not _admitted(largest - 1, cache, tiny_sizes)           # control: below one slot


def test_budget_every_split_size_marks_feasible_is_admitted(tiny_pack_trace, tiny_sizes):
    """Catches sizing and admission using different floors, in either direction: over a
    range of total budgets each split `size` rates is rated the same by k3-run's admission."""
    pk, trace = tiny_pack_trace
    largest = max(tiny_sizes.layer_bytes)
    floor = minimum_budget(tiny_sizes)
    seen = {True: 0, False: 0}
    for total in range(largest, tiny_sizes.trunk_bytes + 2 * floor.cache_bytes,
                       max(1, largest // 3)):
        try:
            rep = size_budget(trace, pk, total, 1.5e9, 0.9e9, steps=8)
        except BudgetError:
            continue
        for row in rep["splits"]:
            assert _admitted(row["trunk_bytes"], row["cache_bytes"], tiny_sizes) \
                == row["feasible"], row
            seen[row["feasible"]] += 1
    assert seen[True] and seen[False]


def test_budget_size_recommendations_run_through_the_console_scripts(tiny_dir, tiny_pack_trace,
                                                                     tiny_sizes):
    """Catches k3-run refusing a split `k3-trace size` rates feasible: its best split and
    its first one-slot-ring split both run."""
    pk, trace = tiny_pack_trace
    floor = minimum_budget(tiny_sizes)
    total = max(tiny_sizes.layer_bytes) + 1 + 2 * floor.cache_bytes
    p = subprocess.run(["k3-trace", "size", str(trace), "--budget-gb", f"{total / 1e9:.9f}",
                        "--pack", str(pk), "--seq-mbps", "1500", "--rand-mbps", "900",
                        "--steps", "64", "--json"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    one_slot = next(r for r in rep["splits"] if r["feasible"] and r["ring_slots"] == 1)
    for row in (rep["best"], one_slot):
        p = subprocess.run(["k3-run", str(tiny_dir), "--ids", "5,17,300", "--gen", "2",
                            "--trunk-gb", f"{row['trunk_bytes'] / 1e9:.9f}",
                            "--cache-gb", f"{row['cache_bytes'] / 1e9:.9f}"],
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, (row, p.stderr)


def test_budget_floor_error_prints_the_budget_and_the_floor_differently():
    """Catches a budget error a person cannot act on ('trunk budget 0.00 GB is below 0.00
    GB'): a small model's budget and floor are printed in a unit that tells them apart."""
    import re
    problems = floor_problems(1000, 10_000, [227_360, 5_000], 16_384, 2, 40)
    assert len(problems) == 2
    for text in problems:
        given_, floor = re.match(r"\w+ budget (.+?) is below (.+?) \(", text).groups()
        assert given_ != floor and "GB" not in given_ + floor, text


def test_budget_trunk_hint_is_not_below_the_floor_it_names():
    """Catches a --trunk-gb hint rounded down below the floor (0.000227 for 227,360
    bytes): following the hint must admit the trunk."""
    layers = [227_360, 5_000]
    with pytest.raises(BudgetError) as e:
        plan_trunk(layers, 1000)
    value = float(e.value.hint.rsplit(" ", 1)[-1])
    assert int(round(value * 1e9)) >= trunk_floor(layers)
    plan_trunk(layers, int(round(value * 1e9)))                    # control: it runs


def test_prefill_chunk_rule_takes_its_activations_from_the_cache_never_below_its_floor():
    """Catches a prefill chunk whose activations land on top of the budget (the peak past
    budget + overhead), one that starves the expert cache below its floor, or a rule that
    never raises the chunk: at Kimi K3's dims the floor and the laptop cache keep 64
    tokens, the desktop cache takes 512; every chunk's extra activations are exactly what
    the cache gives up; a requested chunk at the floor leaves the cache at its floor."""
    from libk3.budget import PREFILL_CHUNKS, activation_peak, prefill_chunk
    from libk3.k3_dims import real_config
    cfg = real_config()
    sizes = ModelSizes.from_config(cfg)
    per = sizes.activation_token_bytes
    assert per == activation_peak(cfg, 1)[0] and activation_peak(cfg, 512)[0] == 512 * per
    floor = minimum_budget(sizes)
    assert prefill_chunk(floor, sizes, 64) == (64, floor.cache_bytes, "")
    for gb in (0.4, 1, 2, 4, 10, 30):
        b = Budget(floor.trunk_bytes, int(gb * 1e9), None, ())
        chunk, cache, why = prefill_chunk(b, sizes, 64)
        assert chunk in (64,) + PREFILL_CHUNKS
        assert b.cache_bytes - cache == (chunk - 64) * per          # taken, not added
        assert cache >= floor.cache_bytes and (chunk - 64) * per <= b.cache_bytes / 16
        assert (chunk > 64) == bool(why)
    assert prefill_chunk(Budget(0, int(0.4e9), None, ()), sizes, 64)[0] == 64
    assert prefill_chunk(Budget(0, int(10e9), None, ()), sizes, 64)[0] == 512
    chunk, cache, why = prefill_chunk(floor, sizes, 64, requested=256)
    assert (chunk, cache) == (256, floor.cache_bytes) and "raise the peak" in why


def test_a_server_s_memory_beside_the_model_is_counted_in_admission_and_auto(tiny_dir,
                                                                             tiny_sizes):
    """Catches a server whose kept turns (--reuse-gb) and request reader come on top of a
    budget admitted without them (its planned peak then exceeds the memory it was checked
    against): an explicit budget that fits only without them is refused naming them, and
    ``auto`` leaves exactly that much more room."""
    from libk3.budget import load_rules, peak_bytes, with_beside
    from libk3.run.runner import RunOptions, resolve_run_budget
    from libk3.serve.app import READER_RESERVE_BYTES, beside_bytes
    headroom = load_rules().headroom_fraction
    beside = beside_bytes(10 ** 6)
    assert beside == 10 ** 6 + READER_RESERVE_BYTES
    whole = Budget(tiny_sizes.trunk_bytes, tiny_sizes.cache_all_bytes, "whole", ())
    memory = int(peak_bytes(whole, tiny_sizes) / headroom) + 4096   # fits without the server

    def run(held, **budget):
        opts = RunOptions(model=str(tiny_dir), memory_override=memory, serve=True,
                          beside_bytes=held, **budget)
        with Checkpoint.open(tiny_dir) as ckpt:
            return resolve_run_budget(opts, ckpt)[0]
    explicit = dict(trunk_gb=whole.trunk_bytes / 1e9, cache_gb=whole.cache_bytes / 1e9,
                    budget_order=["trunk_gb", "cache_gb"])
    assert run(0, **explicit) is not None                                       # control
    with pytest.raises(BudgetError, match="--reuse-gb and its request reader"):
        run(beside, **explicit)
    tight = (peak_bytes(minimum_budget(tiny_sizes), with_beside(tiny_sizes, beside))
             + tiny_sizes.cache_all_bytes // 2)                 # the whole model does not fit
    memory = int(tight / headroom)
    served = run(beside)
    assert served.cache_bytes < tiny_sizes.cache_all_bytes
    assert peak_bytes(served, with_beside(tiny_sizes, beside)) <= headroom * memory
    memory = int((tight - beside) / headroom)           # the same room, nothing beside
    alone = run(0)
    assert alone.trunk_bytes == served.trunk_bytes                  # (bytes lost rounding)
    assert abs(alone.cache_bytes - served.cache_bytes) <= 2


def test_a_server_with_a_prefix_cache_counts_its_snapshot_writer_s_states(tiny_dir):
    """Catches the states a server's snapshot writer holds (queued, and the one being
    written) left out of its width: with --prefix-cache the width that fits is smaller by
    exactly those, and the reasons name them; the turn cache queues no more than that."""
    from libk3.budget import SERVER_SNAPSHOTS
    from libk3.run.runner import RunOptions, resolve_run_budget
    from libk3.serve.turn_cache import WRITES_QUEUED
    assert WRITES_QUEUED + 1 == SERVER_SNAPSHOTS

    def fit(**extra):
        opts = RunOptions(model=str(tiny_dir), memory_override=2 * 10 ** 9, serve=True,
                          batch_width="auto", **extra)
        with Checkpoint.open(tiny_dir) as ckpt:
            reasons = resolve_run_budget(opts, ckpt)[2]
        return int(reasons[0].rsplit(": ", 1)[1].split()[0]), reasons[0]
    plain, _ = fit()
    cached, why = fit(prefix_cache="auto")
    assert plain - cached == SERVER_SNAPSHOTS and f"and {SERVER_SNAPSHOTS} snapshots" in why
