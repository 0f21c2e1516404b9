"""The flags users bring from llama.cpp and vLLM, end to end through the console scripts
(docs/run.md "Options"): -h, -p, -f, -n (-1: until a stop or the context), -t, -m; the
sampling flags and their batch-line fields; --load-state alone continuing a saved run."""

from __future__ import annotations

import json
import os

import pytest

from k3_doctor.cli import main as doctor_main
from k3_pack.cli import main as pack_main
from k3_run.cli import main as run_main
from k3_trace.cli import main as trace_main
from libk3.engine.generate import GenSettings, generate
from libk3.engine.session import open_session

from .hostile import check_refused, invoke
from .scripts import k3, k3_here

SAMPLING = ["--temperature", "0.9", "--seed", "11", "--top-k", "7", "--min-p", "0.02",
            "--repeat-penalty", "1.3", "--presence-penalty", "0.6",
            "--frequency-penalty", "0.25"]
SAMPLING_FIELDS = dict(temperature=0.9, seed=11, top_k=7, min_p=0.02, repetition_penalty=1.3,
                       presence_penalty=0.6, frequency_penalty=0.25)


def _ids(p) -> list:
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["generated_ids"]


@pytest.mark.parametrize("main", [run_main, pack_main, trace_main, doctor_main],
                         ids=["run", "pack", "trace", "doctor"])
def test_every_tool_takes_dash_h_as_help(main):
    """Catches a tool where -h is an unknown option (llama.cpp's, vLLM's, every Unix
    tool's help flag): it prints the same help as --help, exit 0."""
    short, long_ = invoke(main, ["-h"]), invoke(main, ["--help"])
    assert short.code == 0 and not short.stderr, short
    assert short.stdout == long_.stdout and "-h, --help" in short.stdout


def test_run_short_flags_equal_the_long_ones(tiny_dir, tmp_path):
    """Catches -m, -p, -f, -n or -t meaning anything but --model (the positional's
    twin), --prompt, --prompt-file, --gen and --threads: the same ids either way."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello there")
    long_ = _ids(k3(tiny_dir, "--prompt", "Hello there", "--gen", 5, "--threads", 1, "--json"))
    assert len(long_) == 5
    assert _ids(k3("-m", tiny_dir, "-p", "Hello there", "-n", 5, "-t", 1, "--json")) == long_
    assert _ids(k3_here(tiny_dir, "-f", prompt, "-n", 5, "--json")) == long_


@pytest.mark.parametrize("argv,says", [
    ([], "MODEL"),
    (["{tiny}", "-m", "{tiny}", "--ids", "1"], "MODEL"),
    (["-m", "{tiny}", "-p", "x", "--ids", "1"], "exactly one of"),
    (["{tiny}", "--gen", "-2", "--ids", "1"], "--gen"),
])
def test_run_model_and_prompt_options_are_refused_when_ambiguous(tiny_dir, argv, says):
    """Catches a model given both as MODEL and -m (which one runs?), none at all, two
    prompts, or a --gen below -1, accepted: one line, exit 2."""
    argv = [a.format(tiny=tiny_dir) for a in argv]
    check_refused(invoke(run_main, argv), 2, says)


def _short_context(tiny_dir, tmp_path, n: int):
    """tiny with max_position_embeddings = n (its shards linked, not copied)."""
    d = tmp_path / f"ctx{n}"
    d.mkdir()
    for f in tiny_dir.iterdir():
        if f.name != "config.json" and f.is_file():
            os.symlink(f, d / f.name)
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = n
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_run_gen_minus_one_runs_to_the_context_or_a_stop(tiny_dir, tmp_path):
    """Catches -n -1 refused, taken as a count, or running past the model's context:
    with a 10-position context and 3 prompt ids it generates 7 tokens; with a stop id it
    ends there (the turn's end)."""
    d = _short_context(tiny_dir, tmp_path, 10)
    p = k3_here(d, "--ids", "1,2,3", "-n", -1, "--json")
    assert _ids(p) == _ids(k3_here(tiny_dir, "--ids", "1,2,3", "-n", 7, "--json"))
    assert json.loads(p.stdout)["stop_reason"] == "length"
    ids = _ids(k3_here(tiny_dir, "--ids", "1,2,3", "-n", 6, "--json"))
    q = k3_here(tiny_dir, "--ids", "1,2,3", "-n", -1, "--stop-id", ids[4], "--json")
    assert _ids(q) == ids[:ids.index(ids[4]) + 1]
    assert json.loads(q.stdout)["stop_reason"] == "stop_id"


def test_run_load_state_alone_continues_the_saved_run(tiny_dir, tmp_path):
    """Catches --load-state without a prompt refused, or continuing from anything but
    the saved run's last position (a token fed twice, the last logits lost): 4 tokens
    saved, then 4 more from the state alone, equal one run of 8; sampled, so the
    position-keyed noise must line up too."""
    st = tmp_path / "s.k3state"
    first = _ids(k3_here(tiny_dir, "--ids", "1,2,3", "-n", 4, "--temperature", 0.8, "--seed", 3,
                         "--save-state", st, "--json"))
    more = _ids(k3_here(tiny_dir, "--load-state", st, "-n", 4, "--temperature", 0.8, "--seed", 3,
                        "--json"))
    whole = _ids(k3_here(tiny_dir, "--ids", "1,2,3", "-n", 8, "--temperature", 0.8, "--seed", 3,
                         "--json"))
    assert first + more == whole


def test_run_sampling_flags_reach_the_engine(tiny_dir):
    """Catches a sampling flag that is parsed but not passed on (or passed to the wrong
    field): the CLI's ids equal the engine's with the same settings; control: they differ
    from the run without the new flags."""
    ids = [5, 17, 300, 42, 7, 5, 17, 300]
    got = _ids(k3_here(tiny_dir, "--ids", ",".join(map(str, ids)), "-n", 10, *SAMPLING, "--json"))
    s = open_session(tiny_dir)
    want = generate(s.forward, s.new_state(), ids, GenSettings(gen=10, **SAMPLING_FIELDS))
    plain = generate(s.forward, s.new_state(), ids, GenSettings(gen=10, temperature=0.9,
                                                                seed=11))
    assert got == want.generated_ids != plain.generated_ids


def test_batch_lines_take_the_sampling_fields(tiny_dir, tmp_path):
    """Catches batch fields top_k, min_p, repetition_penalty, presence_penalty and
    frequency_penalty ignored, or accepted outside their range, and "gen": -1 refused:
    a line with them equals the engine; lines with bad values are skipped naming the
    field, the others run (-1 up to the stop id)."""
    ids = [5, 17, 300, 42, 7, 5, 17, 300]
    fields = dict(SAMPLING_FIELDS)
    s = open_session(tiny_dir)
    greedy = generate(s.forward, s.new_state(), ids, GenSettings(gen=4)).generated_ids
    lines = [dict(id="ok", ids=ids, gen=10, **fields),
             dict(id="k", ids=ids, top_k=-2), dict(id="m", ids=ids, min_p=1.5),
             dict(id="r", ids=ids, repetition_penalty=0), dict(id="pp", ids=ids,
                                                               presence_penalty=2.5),
             dict(id="f", ids=ids, frequency_penalty="1"),
             dict(id="g", ids=ids, gen=-1, stop_ids=[greedy[2]])]
    batch = tmp_path / "b.jsonl"
    batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "r.jsonl"
    p = k3_here(tiny_dir, "--batch", batch, "--out", out, "--json")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    bad = {e["line"]: e["error"] for e in summary["errors"]}
    for line, field in ((2, "top_k"), (3, "min_p"), (4, "repetition_penalty"),
                        (5, "presence_penalty"), (6, "frequency_penalty")):
        assert field in bad.get(line, ""), (line, bad)
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == ["g", "ok"]
    assert rows["g"]["generated_ids"] == greedy[:greedy.index(greedy[2]) + 1]
    want = generate(s.forward, s.new_state(), ids, GenSettings(gen=10, **fields))
    assert rows["ok"]["generated_ids"] == want.generated_ids


def _bias_args(bias) -> list:
    return [x for v, b in bias for x in ("--logit-bias", f"{v}={b}")]


def test_run_logit_bias_bans_and_forces_tokens_as_the_engine_does(tiny_dir):
    """Catches --logit-bias parsed but not passed on (or only one of several), or with
    id and bias swapped: the CLI's ids equal the engine's with the same bias and
    penalty, never hold the banned id (plain greedy's first token), and differ from the
    plain run; a +100 bias makes every token its id."""

    ids = [5, 17, 300, 42]
    s = open_session(tiny_dir)
    plain = generate(s.forward, s.new_state(), ids, GenSettings(gen=6)).generated_ids
    bias = tuple(sorted({(plain[0], -100.0), (7 if plain[0] != 7 else 8, 2.5)}))
    argv = [tiny_dir, "--resident", "--ids", "5,17,300,42", "-n", 6, "--json"]
    got = _ids(k3_here(*argv, "--repeat-penalty", 1.3, *_bias_args(bias)))
    want = generate(s.forward, s.new_state(), ids,
                    GenSettings(gen=6, repetition_penalty=1.3, logit_bias=bias))
    assert got == want.generated_ids != plain and plain[0] not in got
    assert _ids(k3_here(*argv, "--logit-bias", "300=100")) == [300] * 6


@pytest.mark.parametrize("bias,says", [
    (["512=1"], "token id 512"), (["5=100.5"], "[-100, 100]"), (["5=nan"], "[-100, 100]"),
    (["5=1", "5=-1"], "twice"), (["5"], "ID=BIAS"), (["-3=1"], "ID=BIAS"),
    (["five=1"], "ID=BIAS"),
])
def test_run_logit_bias_refuses_bad_values_before_any_work(tiny_dir, tmp_path, bias, says):
    """Catches an id outside the vocabulary, a bias out of range, an id given twice or a
    malformed ID=BIAS accepted, or refused only after work began (a batch's results file
    created by its lock): one line naming the problem, exit 2, no results file."""
    batch = tmp_path / "b.jsonl"
    batch.write_text('{"id": 1, "ids": [1, 2]}\n')
    out = tmp_path / "r.jsonl"
    argv = [tiny_dir, "--batch", batch, "--out", out]
    check_refused(invoke(run_main, argv + [x for b in bias for x in ("--logit-bias", b)]),
                  2, says, "--logit-bias")
    assert not out.exists()


def test_batch_lines_take_logit_bias_as_the_flag_does(tiny_dir, tmp_path):
    """Catches a batch line's "logit_bias" ignored, read with its keys as anything but
    token ids, not replacing the command line's --logit-bias (or {} not clearing it),
    or a bad one accepted or stopping the batch: the line's ids equal k3-run's with the
    same --logit-bias flags, a line without the field takes the flag's, {} runs plain,
    and each bad line is skipped with its number, naming the field."""

    ids = [5, 17, 300, 42]
    s = open_session(tiny_dir)
    plain = generate(s.forward, s.new_state(), ids, GenSettings(gen=6)).generated_ids
    bias = tuple(sorted({(plain[0], -100.0), (7 if plain[0] != 7 else 8, 2.5)}))
    flag = _ids(k3_here(tiny_dir, "--resident", "--ids", "5,17,300,42", "-n", 6, "--json",
                        *_bias_args(bias)))
    as_json = {str(v): b for v, b in bias}
    lines = [dict(id="ok", ids=ids, gen=6, logit_bias=as_json),
             dict(id="k", ids=ids, logit_bias={"512": 1}),
             dict(id="v", ids=ids, logit_bias={"5": 101}),
             dict(id="x", ids=ids, logit_bias={"0x5": 1}),
             dict(id="l", ids=ids, logit_bias=[[5, 1]]),
             dict(id="t", ids=ids, logit_bias={"5": True}),
             dict(id="many", ids=ids, logit_bias={str(i): 1 for i in range(301)}),
             dict(id="none", ids=ids, gen=6, logit_bias={}),
             dict(id="flag", ids=ids, gen=6)]
    batch = tmp_path / "b.jsonl"
    batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "r.jsonl"
    cli = ((plain[0], -100.0), (flag[0], -100.0))    # moves both "ok" and "flag" lines
    p = k3_here(tiny_dir, "--resident", "--batch", batch, "--out", out, "--json",
                *_bias_args(cli))
    assert p.returncode == 0, p.stderr
    bad = {e["line"]: e["error"] for e in json.loads(p.stdout)["errors"]}
    assert sorted(bad) == [2, 3, 4, 5, 6, 7] and all("logit_bias" in e for e in bad.values())
    for line in range(2, 8):
        assert f"{batch}:{line}: skipped" in p.stderr
    rows = {r["id"]: r["generated_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert rows["ok"] == flag != plain
    assert rows["none"] == plain
    on_flag = generate(s.forward, s.new_state(), ids,
                       GenSettings(gen=6, logit_bias=tuple(sorted(cli)))).generated_ids
    assert rows["flag"] == on_flag != plain
