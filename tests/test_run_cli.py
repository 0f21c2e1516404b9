"""k3-run end to end through the console script: same answer at every budget, batch
files with resume, chat with saved state, and every refusal (issue: k3-run)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from libk3.engine.generate import GenSettings, generate
from libk3.engine.session import open_session
from libk3.io.checkpoint import Checkpoint
from libk3.budget import ModelSizes, minimum_budget
from .scripts import k3, k3_here

PROMPT = "5,17,300,42,7,99,128,3,250,11,64,200,9,31"


def _pack(model_dir, out):
    from libk3.pack.writer import pack
    with Checkpoint.open(model_dir) as ckpt:
        pack(ckpt, out, progress=False)
    return out


@pytest.fixture(scope="module")
def small_pack(small_dir, tmp_path_factory):
    return _pack(small_dir, tmp_path_factory.mktemp("pack") / "small.pack")


def _reference(model_dir):
    """Resident-weights greedy run: the forward-pass result the streamed runs must equal
    (tests/test_model.py ties the resident forward to the float64 reference)."""
    s = open_session(model_dir)
    ids = [int(i) for i in PROMPT.split(",")]
    return generate(s.forward, s.new_state(), ids, GenSettings(gen=6), keep_logits=True)


def _budgets(model_dir):
    with Checkpoint.open(model_dir) as ckpt:
        sizes = ModelSizes.from_checkpoint(ckpt)
    floor = minimum_budget(sizes)
    gb = lambda b: f"{b / 1e9:.9f}"  # noqa: E731
    return [
        ("--resident",),
        ("--trunk-gb", gb(floor.trunk_bytes + 1), "--cache-gb", gb(floor.cache_bytes + 1)),
        ("--trunk-gb", gb(sizes.trunk_bytes // 2), "--cache-gb", gb(sizes.cache_all_bytes // 8)),
        ("--trunk-gb", gb(sizes.trunk_bytes * 0.8), "--cache-gb", gb(sizes.cache_all_bytes // 2)),
        ("--preset", "max"),
    ]


@pytest.mark.parametrize("which", ["tiny", "small"])
def test_run_same_logits_at_every_budget_threads_and_pack(which, tiny_dir, small_dir,
                                                          small_pack, tmp_path):
    """Catches any budget, ring size, cache size, thread count or pack that changes the
    arithmetic: tokens and logits bytes must be identical to the resident forward."""
    model = tiny_dir if which == "tiny" else small_dir
    pack_dir = small_pack if which == "small" else _pack(tiny_dir, tmp_path / "tiny.pack")
    ref = _reference(model)
    want = ref.logits
    runs = [(b, ()) for b in _budgets(model)]
    runs.append((_budgets(model)[1], ("--pack", pack_dir)))
    runs.append((_budgets(model)[2], ("--pack", pack_dir, "--threads", "1")))
    for i, (budget, extra) in enumerate(runs):
        out, rep = tmp_path / f"l{i}.npy", tmp_path / f"r{i}.json"
        run = k3 if "--threads" in extra else k3_here     # a team size is set at start-up
        p = run(model, "--ids", PROMPT, "--gen", 6, *budget, *extra, "--logits-out", out,
                "--report-json", rep)
        assert p.returncode == 0, p.stderr
        got = np.load(out)
        report = json.loads(rep.read_text())
        assert report["generated_ids"] == ref.generated_ids, (budget, extra)
        assert got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (budget, extra)
        if budget != ("--resident",):
            assert report["peak_rss_bytes"] > 0 and report["budget"]["trunk_bytes"] > 0


def test_run_minimum_budget_streams_everything(small_dir, tmp_path):
    """Catches a 'streamed' run that silently keeps everything resident: at the floor (one
    ring slot, budget.floor_problems) the trunk is read every token and experts are
    evicted."""
    b = _budgets(small_dir)[1]
    rep = tmp_path / "r.json"
    p = k3_here(small_dir, "--ids", PROMPT, "--gen", 3, *b, "--report-json", rep)
    assert p.returncode == 0, p.stderr
    r = json.loads(rep.read_text())
    assert r["pinned_layers"] == [] and r["ring_slots"] == 1
    with Checkpoint.open(small_dir) as ckpt:
        trunk = ModelSizes.from_checkpoint(ckpt).trunk_bytes
    assert r["trunk_bytes_read"] >= 3 * trunk       # prefill chunk + 2 decode steps
    assert r["cache_hit_rate"] < 0.5


def test_run_feeds_the_last_token_only_when_the_state_is_kept(tiny_dir, tmp_path):
    """Catches a one-shot run that feeds its last token for nothing (at the floor, a whole
    trunk read: 1/7 of a 6-token run), and a saved state that lacks that token."""
    from libk3.io.identity import weights_identity
    from libk3.model.state import State

    b = _budgets(tiny_dir)[1]                       # the floor: every pass reads the trunk
    reps = {}
    for name, extra in (("once", ()), ("saved", ("--save-state", tmp_path / "s.k3state"))):
        rep = tmp_path / f"{name}.json"
        p = k3_here(tiny_dir, "--ids", PROMPT, "--gen", 4, *b, *extra, "--report-json", rep)
        assert p.returncode == 0, p.stderr
        reps[name] = json.loads(rep.read_text())
    assert reps["once"]["generated_ids"] == reps["saved"]["generated_ids"]
    # one prefill pass (14 ids, one chunk) + 3 decode passes, vs + 4 when the state is kept
    assert reps["saved"]["trunk_bytes_read"] * 4 == reps["once"]["trunk_bytes_read"] * 5
    with Checkpoint.open(tiny_dir) as ckpt:
        st = State.load(ckpt.config, tmp_path / "s.k3state", weights_identity(ckpt))
    assert st.pos == len(PROMPT.split(",")) + 4


def test_run_budget_below_minimum_refused_before_work(small_dir):
    """Catches a run that starts and then fails (or thrashes) below the working floor."""
    p = k3_here(small_dir, "--ids", "1,2", "--trunk-gb", "0.001", "--cache-gb", "0.001")
    assert p.returncode == 4
    assert "below the smallest that can work" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_run_later_flag_overrides_preset(small_dir, tmp_path):
    """Catches flags applied in a fixed order instead of argv order."""
    rep = tmp_path / "r.json"
    p = k3_here(small_dir, "--ids", "1,2", "--gen", 1, "--preset", "max", "--cache-gb", "0.01",
                "--report-json", rep)
    assert p.returncode == 0, p.stderr
    assert json.loads(rep.read_text())["budget"]["cache_bytes"] == 10_000_000
    p = k3_here(small_dir, "--ids", "1,2", "--gen", 1, "--cache-gb", "0.01", "--preset", "max",
                "--report-json", rep)
    assert p.returncode == 0, p.stderr
    assert json.loads(rep.read_text())["budget"]["cache_bytes"] > 10_000_000


def test_run_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    """Catches a guess or a traceback on a non-K3 directory."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    p = k3_here(tmp_path, "--ids", "1")
    assert p.returncode == 3 and "missing required key" in p.stderr
    assert "Traceback" not in p.stderr


def test_run_refuses_a_pack_of_another_checkpoint(tiny_dir, small_pack):
    """Catches streaming a trunk file that belongs to another model."""
    p = k3_here(tiny_dir, "--ids", "1", "--pack", small_pack, "--preset", "max")
    assert p.returncode == 3 and "different checkpoint" in p.stderr


def test_run_usage_errors_exit_2(tiny_dir):
    """Catches ambiguous prompt options being accepted."""
    p = k3_here(tiny_dir, "--ids", "1", "--prompt", "x")
    assert p.returncode == 2 and "exactly one of" in p.stderr
    p = k3_here(tiny_dir, "--ids", "1,x")
    assert p.returncode == 2


def test_run_batch_skips_malformed_lines_and_resumes(tiny_dir, tmp_path):
    """Catches a batch that dies on a bad line, or redoes finished ids on rerun."""
    lines = ['{"id": "a", "ids": [1, 2, 3], "gen": 3}', "not json",
             '{"id": "b", "prompt": "Hello world", "gen": 4}', '{"id": 5, "ids": [99999]}',
             '{"id": "c", "ids": [7], "gen": 2, "temperature": 0.8, "seed": 3}']
    batch = tmp_path / "b.jsonl"
    batch.write_text("\n".join(lines[:3]) + "\n")
    out = tmp_path / "r.jsonl"
    p = k3_here(tiny_dir, "--batch", batch, "--out", out)
    assert p.returncode == 0, p.stderr
    assert f"{batch}:2: skipped" in p.stderr
    first = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in first] == ["a", "b"]
    with open(out, "a") as f:                # a crash mid-write leaves a torn line
        f.write('{"id": "x", "gener')
    batch.write_text("\n".join(lines) + "\n")
    p = k3_here(tiny_dir, "--batch", batch, "--out", out)
    assert p.returncode == 0, p.stderr
    assert f"{batch}:4: skipped" in p.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b", "c"]
    assert rows[0] == first[0]
    assert len(rows[2]["generated_ids"]) == 2


def test_run_batch_result_equals_single_run(tiny_dir, tmp_path):
    """Catches state leaking from one batch prompt into the next."""
    batch = tmp_path / "b.jsonl"
    batch.write_text('{"id": 1, "ids": [9, 8, 7], "gen": 5}\n{"id": 2, "ids": [1, 2, 3], "gen": 5}\n')
    out = tmp_path / "r.jsonl"
    assert k3_here(tiny_dir, "--batch", batch, "--out", out).returncode == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    single = json.loads(k3_here(tiny_dir, "--ids", "1,2,3", "--gen", 5, "--json").stdout)
    assert rows[1]["generated_ids"] == single["generated_ids"]


def test_run_chat_two_turns_with_saved_state_equals_one_session(tiny_dir, tmp_path):
    """Catches a chat that re-prefills earlier turns differently or a state file that loses
    the first turn: turn 2 after save/load prints exactly what one session prints."""
    both = k3_here(tiny_dir, "--chat", "--gen", 6, input="hello there\nand again\n\n")
    assert both.returncode == 0, both.stderr
    st = tmp_path / "chat.k3state"
    one = k3_here(tiny_dir, "--chat", "--gen", 6, "--save-state", st, input="hello there\n\n")
    assert one.returncode == 0 and st.exists(), one.stderr
    two = k3_here(tiny_dir, "--chat", "--gen", 6, "--load-state", st, input="and again\n\n")
    assert two.returncode == 0, two.stderr
    replies = [line for line in both.stdout.splitlines() if line.strip()]
    assert len(replies) >= 1
    assert one.stdout + two.stdout == both.stdout


def test_run_prompt_text_streams_and_reports(tiny_dir, tmp_path):
    """Catches text mode not using the model's tokenizer (prompt ids or printed text that
    are not its encoding and decoding), a stream that differs from the reported text, and
    a report missing its fields."""
    from libk3.text.tokenizer import K3Tokenizer
    prompt = "The capital of France is"
    rep = tmp_path / "r.json"
    p = k3_here(tiny_dir, "--prompt", prompt, "--gen", 4, "--report-json", rep)
    assert p.returncode == 0, p.stderr
    r = json.loads(rep.read_text())
    for key in ("prompt_ids", "generated_ids", "prefill_seconds", "decode_seconds",
                "seconds_per_token", "trunk_bytes_read", "expert_bytes_read", "cache_hit_rate",
                "reads_in_flight", "peak_rss_bytes", "budget", "generated_text"):
        assert key in r
    tok = K3Tokenizer.from_dir(tiny_dir)
    assert r["prompt_ids"] == tok.encode(prompt)
    assert len(r["generated_ids"]) == 4
    text = tok.decode(r["generated_ids"])
    assert text and r["generated_text"] == text
    assert p.stdout == text + "\n"


def test_run_single_shard_without_index_and_flat_config(tiny_dir, tmp_path):
    """Catches a loader that needs model.safetensors.index.json, several shards or the
    nested config: one model.safetensors + a flat config.json gives the same logits."""
    from libk3.config import load_config
    from libk3.io.safetensors import read_header, write_shard
    d = tmp_path / "one"
    d.mkdir()
    tensors = []
    for shard in sorted(tiny_dir.glob("*.safetensors")):
        blob = shard.read_bytes()
        tensors += [(e.name, e.dtype, e.shape, blob[e.offset:e.offset + e.nbytes])
                    for e in read_header(shard)]
    write_shard(d / "model.safetensors", tensors)
    (d / "config.json").write_text(json.dumps(load_config(tiny_dir).to_flat_dict()))
    for f in ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py"):
        shutil.copy(tiny_dir / f, d / f)
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    assert k3_here(tiny_dir, "--ids", "3,1,4,1,5", "--gen", 4, "--logits-out", a).returncode == 0
    p = k3_here(d, "--ids", "3,1,4,1,5", "--gen", 4, "--logits-out", b)
    assert p.returncode == 0, p.stderr
    assert np.array_equal(np.load(a).view(np.uint32), np.load(b).view(np.uint32))


def test_run_stop_string_without_tokenizer_is_a_usage_error(tiny_dir, tmp_path):
    """Catches --stop being silently ignored when no tokenizer can see the text."""
    d = shutil.copytree(tiny_dir, tmp_path / "t")
    (d / "tiktoken.model").unlink()
    p = k3_here(d, "--ids", "1,2", "--gen", 2, "--stop", "x")
    assert p.returncode == 2 and "--stop needs" in p.stderr
    assert k3_here(d, "--ids", "1,2", "--gen", 2, "--stop-id", 5).returncode == 0   # control


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="needs /proc")
def test_run_peak_rss_is_its_own_not_the_parents(tiny_dir, tmp_path):
    """Catches a peak RSS that includes the launching process's memory (getrusage's
    ru_maxrss survives exec): tiny run under a parent holding 1.5 GB must report its own
    ~0.2 GB."""
    held = np.ones(1_500_000_000 // 8)              # touched: resident in this process
    rep = tmp_path / "r.json"
    p = k3(tiny_dir, "--ids", "1,2,3", "--gen", 2, "--report-json", rep)
    assert p.returncode == 0, p.stderr
    peak = json.loads(rep.read_text())["peak_rss_bytes"]
    assert 10e6 < peak < 1.0e9, peak
    del held


def test_run_prefill_chunk_grows_with_the_cache_and_keeps_the_logits(small_dir, tmp_path):
    """Catches a prefill chunk the budget's rule raises but the run does not use (the
    trunk still read once per 64 prompt tokens), or one whose longer passes change the
    arithmetic: a 300-token prompt with the whole expert cache runs in 256-token passes
    and at the floor in 64-token ones, with the same tokens and logits bytes as each
    other and as --prefill-chunk 97 (a chunk that divides neither)."""
    with Checkpoint.open(small_dir) as ckpt:
        sizes = ModelSizes.from_checkpoint(ckpt)
    floor = minimum_budget(sizes)
    gb = lambda b: f"{b / 1e9:.9f}"  # noqa: E731
    ids = ",".join(str(7 * i % 200 + 3) for i in range(300))
    trunk = ("--trunk-gb", gb(floor.trunk_bytes + 1))
    runs = {"roomy": trunk + ("--cache-gb", "1"),
            "floor": trunk + ("--cache-gb", gb(floor.cache_bytes + 1)),
            "odd": trunk + ("--cache-gb", "1", "--prefill-chunk", "97")}
    got = {}
    for name, args in runs.items():
        out, rep = tmp_path / f"{name}.npy", tmp_path / f"{name}.json"
        p = k3_here(small_dir, "--ids", ids, "--gen", 3, *args, "--logits-out", out,
                    "--report-json", rep)
        assert p.returncode == 0, p.stderr
        got[name] = (np.load(out).view(np.uint32), json.loads(rep.read_text()))
    chunks = {name: r["prefill_chunk"] for name, (_, r) in got.items()}
    assert chunks == {"roomy": 256, "floor": 64, "odd": 97}
    assert any("prefill chunk 256" in x for x in got["roomy"][1]["budget"]["reasons"])
    passes = {name: r["trunk_bytes_read"] / sizes.trunk_bytes for name, (_, r) in got.items()}
    assert passes == {name: -(-300 // chunks[name]) + 3 for name in runs}   # + 3 decode
    for name in ("floor", "odd"):
        assert got[name][1]["generated_ids"] == got["roomy"][1]["generated_ids"]
        assert np.array_equal(got[name][0], got["roomy"][0]), name
