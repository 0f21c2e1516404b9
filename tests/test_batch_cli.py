"""k3-run --batch in lockstep through the console script (issue 12): the same result lines
at every --batch-width, refusal of a width that cannot fit, --shard partitions, resume
after kill -9, the summary's fields; and the width rule of libk3.budget."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from libk3.run.batch import parse_shard, shard_of
from libk3.errors import BudgetError
from libk3.budget import (BATCH_SNAPSHOTS, MAX_AUTO_WIDTH, Budget, ModelSizes, batch_width,
                          load_rules, peak_bytes, sequence_bytes)
from libk3.doctor.report import reference_config
from .scripts import k3, k3_here

# what a result line keeps whatever the width (times, reads and the width differ)
SAME = ("generated_ids", "prompt_ids", "stop_reason", "id", "line")


def _lines(n: int = 7) -> list:
    out = []
    for i in range(n):
        job = {"id": f"p{i}" if i % 2 else i, "ids": [(37 * i + j) % 500 for j in range(1 + i % 4)],
               "gen": 2 + (3 * i) % 6}
        if i % 3 == 1:
            job.update(temperature=0.9, top_p=0.8, seed=i)
        if i == 3:
            job["stop_ids"] = [0]
        out.append(json.dumps(job))
    return out


def _rows(path) -> dict:
    rows = [json.loads(x) for x in open(path).read().splitlines()]
    assert len({json.dumps(r["id"]) for r in rows}) == len(rows)      # no duplicates
    return {json.dumps(r["id"]): {k: r[k] for k in SAME} for r in rows}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    p = tmp_path_factory.mktemp("batch") / "b.jsonl"
    p.write_text("\n".join(_lines()) + "\n")
    return p


@pytest.fixture(scope="module")
def alone(batch, tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("alone") / "r.jsonl"
    p = k3_here(tiny_dir, "--batch", batch, "--out", out, "--batch-width", 1)
    assert p.returncode == 0, p.stderr
    return _rows(out)


@pytest.mark.parametrize("width", ["3", "auto"])
def test_batch_cli_lines_equal_width_1(width, batch, alone, tiny_dir, tmp_path):
    """Catches a lockstep batch whose result lines differ from running each prompt alone
    (ids, stop reason), and a summary that misses the aggregate figures."""
    out = tmp_path / "r.jsonl"
    p = k3_here(tiny_dir, "--batch", batch, "--out", out, "--batch-width", width, "--json")
    assert p.returncode == 0, p.stderr
    assert _rows(out) == alone
    s = json.loads(p.stdout)
    assert s["width"] == (3 if width == "3" else 7) and s["done"] == 7
    assert s["generated_tokens"] == sum(len(r["generated_ids"]) for r in alone.values())
    assert s["tokens_per_second"] > 0 and s["passes"] > 0 and s["max_in_flight"] > 1
    assert s["trunk_bytes_per_token"] > 0 and s["expert_bytes_per_token"] >= 0
    assert len(s["expert_union_per_layer"]) == 12
    assert all(1 <= u <= 8 for u in s["expert_union_per_layer"].values())
    assert {p["id"] for p in s["prompts"]} == {json.loads(k) for k in alone}
    assert all({"prompt_tokens", "generated_tokens", "prefill_seconds", "decode_seconds"}
               <= set(p) for p in s["prompts"])
    assert any("width" in r for r in s["width_reasons"])


def test_batch_cli_refuses_a_width_that_cannot_fit_before_work(batch, tiny_dir, tmp_path):
    """Catches a width admitted beyond memory (it would fail mid-batch, or swap): exit 4,
    one line with the figures, no result written (the lock leaves the file empty); the
    control width runs."""
    out = tmp_path / "r.jsonl"
    budgets = ("--trunk-gb", 1, "--cache-gb", 1)          # fixed: the width rule refuses
    p = k3_here(tiny_dir, "--batch", batch, "--out", out, "--batch-width", 10 ** 8, *budgets)
    assert p.returncode == 4, p.stderr
    assert "batch width 100000000 does not fit" in p.stderr and "expected width <= " in p.stderr
    assert "Traceback" not in p.stderr and out.read_bytes() == b""
    p = k3_here(tiny_dir, "--batch", batch, "--out", out, "--batch-width", 10 ** 8)   # auto budget
    assert p.returncode == 4 and "beside batch width 100000000" in p.stderr, p.stderr
    assert out.read_bytes() == b""
    assert k3_here(tiny_dir, "--batch", batch, "--out", out, "--batch-width", 2).returncode == 0


@pytest.mark.parametrize("args, needle", [
    (("--batch-width", "0"), "positive integer"), (("--batch-width", "x"), "positive integer"),
    (("--draft-max", "2"), "--draft-max and --draft-dump go with --draft"),
    (("--shard", "3/2"), "1 <= K <= N"), (("--shard", "2"), "K/N")])
def test_batch_cli_usage_errors_exit_2(args, needle, batch, tiny_dir, tmp_path):
    """Catches --draft-max silently ignored without a draft and malformed widths or
    shards."""
    p = k3_here(tiny_dir, "--batch", batch, "--out", tmp_path / "r.jsonl", *args)
    assert p.returncode == 2 and needle in p.stderr, p.stderr
    p = k3_here(tiny_dir, "--ids", "1,2", "--gen", 1, "--batch-width", "2")
    assert p.returncode == 2 and "go with --batch" in p.stderr


@pytest.mark.parametrize("source", [("--spec", "2"), ("--draft", "draft")])
def test_batch_cli_drafting_in_lockstep_gives_the_same_lines(source, batch, alone, tiny_dir,
                                                             tmp_path):
    """Catches drafting that changes a line's tokens (greedy or sampled) or is refused
    in lockstep: every lane drafts, the lines equal the prompts run alone."""
    out = tmp_path / "r.jsonl"
    flag, value = source
    value = str(tiny_dir / value) if flag == "--draft" else value
    p = k3_here(tiny_dir, "--batch", batch, "--out", out, flag, value, "--batch-width", "2",
                "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["width"] == 2 and _rows(out) == alone


def test_batch_cli_shards_partition_the_ids(batch, alone, tiny_dir, tmp_path):
    """Catches a shard rule that drops or repeats ids: three shards' outputs together
    hold every id exactly once, with the lines of the unsharded run."""
    got = {}
    for k in (1, 2, 3):
        out = tmp_path / f"r{k}.jsonl"
        p = k3_here(tiny_dir, "--batch", batch, "--out", out, "--shard", f"{k}/3", "--json")
        assert p.returncode == 0, p.stderr
        rows = _rows(out) if out.exists() else {}
        assert not set(rows) & set(got)
        assert all(shard_of(json.loads(key), 3) == k for key in rows)
        assert json.loads(p.stdout)["other_shard"] == 7 - len(rows)
        got.update(rows)
    assert got == alone


def test_shard_of_is_stable_and_covers_every_shard():
    """Catches a hash that changes between runs or machines (Python's salted hash()) or
    a shard numbering off by one: fixed values, and every id in 1..N."""
    assert [shard_of(i, 4) for i in ("a", 7, "7", "\u00e9")] == [2, 3, 1, 1]
    assert [shard_of(i, 1000) for i in ("a", 7, "7")] == [350, 231, 789]   # 7 is not "7"
    ids = list(range(200)) + [f"id-{i}" for i in range(200)]
    for n in (1, 2, 5):
        hits = {shard_of(i, n) for i in ids}
        assert hits == set(range(1, n + 1))
    assert parse_shard("2/8") == (2, 8)


def test_batch_cli_resumes_after_kill_9(tiny_dir, tmp_path):
    """Catches a lockstep batch that loses finished prompts or duplicates them after a
    kill -9 mid-batch: the rerun completes the file, each id once, lines as alone."""
    lines = [json.dumps({"id": i, "ids": [i + 1, 2 * i + 3], "gen": 30 + i}) for i in range(8)]
    batch = tmp_path / "b.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    ref = tmp_path / "ref.jsonl"
    assert k3_here(tiny_dir, "--batch", batch, "--out", ref, "--batch-width", 1).returncode == 0
    out = tmp_path / "r.jsonl"
    proc = subprocess.Popen(["k3-run", str(tiny_dir), "--batch", str(batch), "--out", str(out),
                             "--batch-width", "3"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 1:
            break
        time.sleep(0.05)
    killed = proc.poll() is None
    if killed:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = out.read_text().count("\n")
    assert killed and before < 8, "the batch finished before the kill; lengthen it"
    p = k3(tiny_dir, "--batch", batch, "--out", out, "--batch-width", "3", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["skipped"] == before
    assert _rows(out) == _rows(ref)


# ---- the width rule (libk3.budget.batch_width) ------------------------------------------

def _real():
    return ModelSizes.from_config(reference_config())


def test_batch_width_auto_is_the_largest_that_fits():
    """Catches an auto width that overcommits memory or leaves a whole sequence unused:
    W fits within headroom, W + 1 does not (below the caps)."""
    sizes, rules = _real(), load_rules()
    budget = Budget(int(3.7e9), int(0.4e9), "laptop", ())
    mem = 16 * 10 ** 9
    w, reasons = batch_width(budget, sizes, mem, "auto", rules=rules)
    allowed = rules.headroom_fraction * mem
    assert 1 < w < MAX_AUTO_WIDTH
    assert peak_bytes(budget, sizes, rules, width=w) <= allowed
    assert peak_bytes(budget, sizes, rules, width=w + 1) > allowed
    assert batch_width(budget, sizes, mem, "auto", jobs=2, rules=rules)[0] == 2
    assert batch_width(budget, sizes, mem, w, rules=rules)[0] == w          # control
    with pytest.raises(BudgetError, match=f"batch width {w + 1} does not fit") as e:
        batch_width(budget, sizes, mem, w + 1, rules=rules)
    assert e.value.exit_code == 4 and f"width <= {w}" in e.value.one_line()


def test_batch_width_refused_when_not_even_one_sequence_fits():
    """Catches auto falling back to a width whose state does not fit at all."""
    sizes = _real()
    budget = Budget(int(3.7e9), int(0.4e9), "laptop", ())
    with pytest.raises(BudgetError, match="does not fit"):
        batch_width(budget, sizes, int(7.5e9), "auto")


def test_sequence_bytes_is_the_state_the_overhead_counts():
    """Catches a per-sequence figure that disagrees with the single-run overhead (one
    rule): the overhead at width 1 holds exactly one sequence at context_positions."""
    sizes, rules = _real(), load_rules()
    one = sequence_bytes(sizes, rules.context_positions)
    assert peak_bytes(Budget(0, 0, None, ()), sizes, rules, width=3) \
        - peak_bytes(Budget(0, 0, None, ()), sizes, rules, width=1) == 2 * one
    assert 0.6e9 < one < 0.75e9            # Kimi K3: 0.465 GB state + 0.226 GB MLA cache


def test_doctor_recommends_the_width_that_reads_least_trunk_per_token():
    """Catches a batch recommendation that follows the single-prompt pick (the largest
    preset, where few sequences fit and each token streams most of the trunk): with 32 GB
    for Kimi K3 it is the laptop budget at the width that fits beside it."""
    from libk3.doctor import advice
    sizes = _real()
    d = advice.decide(sizes, 32 * 10 ** 9)
    laptop = d["presets"]["laptop"]
    budget = Budget(laptop["budget"]["trunk_bytes"], laptop["budget"]["cache_bytes"], None, ())
    w = batch_width(budget, sizes, 32 * 10 ** 9, "auto", held=BATCH_SNAPSHOTS)[0]
    assert d["pick"] == "desktop" and d["presets"]["desktop"]["batch_width"] < w
    assert d["batch"]["preset"] == "laptop" and d["batch"]["width"] == laptop["batch_width"] == w
    assert d["sequence_bytes"] == sequence_bytes(sizes, load_rules().context_positions)


def test_batch_line_whose_gen_runs_past_the_context_is_skipped(tiny_dir, tmp_path):
    """Catches a line accepted although its prompt and "gen" run past the model's context
    (formats/batch.md: skipped with its reason), while the good line beside it runs."""
    batch = tmp_path / "b.jsonl"
    batch.write_text('{"id": "long", "ids": [1, 2, 3], "gen": 1048574}\n'
                     '{"id": "ok", "ids": [1, 2, 3], "gen": 2}\n')
    out = tmp_path / "r.jsonl"
    p = k3_here(tiny_dir, "--batch", batch, "--out", out, "--json", "--quiet")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    assert summary["done"] == 1 and summary["malformed"] == 1, summary
    assert "past the model's context" in summary["errors"][0]["error"]
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["ok"]


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_batch_results_path_that_is_not_a_file_is_refused_at_once(kind, tiny_dir, tmp_path):
    """Catches a results path that is a directory refused as a usage error (exit 2; the
    README's table says a rejected results file is 3) and a FIFO that blocks the run
    forever: both are exit 3 at once, naming the path."""
    batch = tmp_path / "b.jsonl"
    batch.write_text('{"id": 1, "ids": [1, 2]}\n')
    out = tmp_path / "r.jsonl"
    out.mkdir() if kind == "directory" else os.mkfifo(out)
    p = k3(tiny_dir, "--batch", batch, "--out", out, timeout=60)
    assert p.returncode == 3, p.stderr
    assert "not a regular file" in p.stderr and str(out) in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_batch_file_that_is_not_a_regular_file_is_refused_at_once(tiny_dir, tmp_path):
    """Catches --batch /dev/zero read until memory runs out (it grew to 2 GB): a batch
    file must be a regular file, else exit 3 at once naming it."""
    p = k3(tiny_dir, "--batch", "/dev/zero", "--out", tmp_path / "r.jsonl", timeout=60)
    assert p.returncode == 3, p.stderr
    assert "not a regular file" in p.stderr and "/dev/zero" in p.stderr


def test_batch_ids_are_told_apart_by_their_text(tiny_dir, tmp_path):
    """Catches two result lines that a script reading ids as text cannot tell apart: an
    integer id and the string of its digits are one id (the second line is a duplicate),
    and a result under one finishes the other on the next run."""
    from .scripts import k3_here
    batch = tmp_path / "b.jsonl"
    batch.write_text('{"id": 7, "ids": [5, 6], "gen": 1}\n{"id": "7", "ids": [8, 9], "gen": 1}\n'
                     '{"id": "x", "ids": [3, 4], "gen": 1}\n')
    out = tmp_path / "out.jsonl"
    res = k3_here(tiny_dir, "--batch", batch, "--out", out, "--json", "-q")
    summary = json.loads(res.stdout)
    assert summary["malformed"] == 1 and summary["errors"][0]["line"] == 2
    assert "duplicate id" in summary["errors"][0]["error"]
    assert sorted(str(json.loads(ln)["id"]) for ln in out.read_text().splitlines()) == ["7", "x"]
    batch.write_text('{"id": "7", "ids": [8, 9], "gen": 1}\n')
    again = json.loads(k3_here(tiny_dir, "--batch", batch, "--out", out, "--json", "-q").stdout)
    assert again["skipped"] == 1 and again["done"] == 0
