"""What batch lines gained from the server (issue 45): ``n`` choices forked by the engine
core from one prefill, each token's log-probabilities (``logprobs``, ``top_logprobs``),
``reasoning_effort`` and ``tool_choice``, checked by the server's rules in the same words,
with the same tokens and log-probabilities at every batch width (formats/batch.md)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from libk3.engine.core import EngineCore, Request
from libk3.engine.generate import GenSettings, generate
from libk3.engine.logprobs import token_logprob
from libk3.engine.session import open_session
from libk3.model.state import State
from libk3.run.batch import BatchLineError, parse_line
from libk3.serve.protocol import ApiError, check_request

from .scripts import k3, k3_here

VOCAB = 512
MESSAGES = [{"role": "user", "content": "hi"}]
CHUNK = 4


@pytest.fixture(scope="module")
def sess(tiny_dir):
    return open_session(tiny_dir)


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 17), ("n", "2"), ("logprobs", "yes"), ("top_logprobs", 21),
    ("top_logprobs", 2), ("reasoning_effort", "max"), ("tool_choice", "required"),
    ("tool_choice", {"type": "function"}), ("parallel_tool_calls", 1),
])
def test_batch_line_and_chat_request_refuse_a_bad_value_in_the_same_words(field, value):
    """Catches a field batch lines check by a rule of their own (a second validator that
    drifts from the server's), or one of the two letting a bad value through."""
    with pytest.raises(BatchLineError) as e:
        parse_line(json.dumps({"id": 1, "messages": MESSAGES, field: value}).encode(), VOCAB)
    with pytest.raises(ApiError) as api:
        check_request({"messages": MESSAGES, field: value}, True, VOCAB)
    err = api.value.body["error"]
    assert api.value.status == 422 and err["param"] == field, err
    assert str(e.value) == err["message"] and f'"{field}"' in str(e.value)


def test_a_chat_only_field_on_a_prompt_line_is_refused_naming_it():
    """Catches "reasoning_effort" or "tool_choice" accepted on a line that has no
    conversation to apply them to (silently ignored)."""
    for field, value in (("reasoning_effort", "low"), ("tool_choice", "none")):
        with pytest.raises(BatchLineError, match=f'"{field}" needs "messages"'):
            parse_line(json.dumps({"id": 1, "prompt": "x", field: value}).encode(), VOCAB)


def _choices(sess, prompt, settings, n, width, logprobs=None, echo=False):
    """GenResults of a request of ``n`` choices through a core of ``width``, by choice,
    and the prompt tokens the core fed."""
    core = EngineCore(sess.forward, lambda k: State(sess.cfg, capacity=k), width,
                      chunk=CHUNK)
    core.add(Request("r", list(prompt), settings, n=n, logprobs=logprobs, echo=echo))
    got = {}
    while core.busy:
        for ev in core.step():
            assert ev.kind != "failed", ev.data
            if ev.kind == "done":
                got[ev.request.choice] = ev.data
    return [got[i] for i in range(n)], core.stats.prompt_tokens


@pytest.mark.parametrize("width", [1, 3])
def test_n_choices_share_one_prefill_and_each_equals_its_seed_alone(sess, width):
    """Catches choices that copy one another, choice i not drawn with seed + i (the
    server's rule: not reproducible one by one), a fork that prefills the prompt again
    per choice, and log-probabilities that differ from a run of that choice alone."""
    prompt = np.random.default_rng(3).integers(0, sess.cfg.vocab_size, 9).tolist()
    s = GenSettings(gen=5, temperature=1.0, seed=40, prefill_chunk=CHUNK)
    results, fed = _choices(sess, prompt, s, 3, width, logprobs=2)
    assert fed == len(prompt) + 2                 # each other choice feeds the last id alone
    assert len({tuple(r.generated_ids) for r in results}) > 1
    for i, r in enumerate(results):
        alone = generate(sess.forward, sess.new_state(), prompt,
                         dataclasses.replace(s, seed=40 + i), logprobs=2)
        assert r.choice == i and r.generated_ids == alone.generated_ids, i
        assert r.logprobs == alone.logprobs and len(r.logprobs) == 5


def test_a_one_id_prompt_forks_from_the_start(sess):
    """Catches a prompt with no id before its last (nothing to prefill once) losing its
    other choices or starting them from the wrong state."""
    s = GenSettings(gen=3, temperature=1.0, seed=7, prefill_chunk=CHUNK)
    results, fed = _choices(sess, [5], s, 2, 1)
    assert fed == 2
    for i, r in enumerate(results):
        alone = generate(sess.forward, sess.new_state(), [5], dataclasses.replace(s, seed=7 + i))
        assert r.generated_ids == alone.generated_ids


def test_generate_logprobs_are_the_log_softmax_of_the_rows_that_chose_them(sess):
    """Catches a token's logprob taken from the wrong row (off by one), after temperature,
    or alternatives out of order: row P-1+j of the logits predicts generated token j."""
    prompt = [3, 1, 4, 1, 5]
    res = generate(sess.forward, sess.new_state(), prompt,
                   GenSettings(gen=4, temperature=0.8, seed=2), keep_logits=True, logprobs=3)
    assert len(res.logprobs) == 4
    for j, (tok, lp) in enumerate(zip(res.generated_ids, res.logprobs)):
        row = res.logits[len(prompt) - 1 + j]
        assert lp == token_logprob(row, tok, 3)
        assert [t for t, _ in lp.top][0] == int(np.argmax(row))
    plain = generate(sess.forward, sess.new_state(), prompt, GenSettings(gen=4, temperature=0.8,
                                                                          seed=2))
    assert plain.logprobs is None and plain.generated_ids == res.generated_ids


LINES = [
    {"id": "lp", "prompt": "hello there", "gen": 4, "logprobs": True, "top_logprobs": 2},
    {"id": "n3", "ids": [5, 6, 7, 8, 9], "gen": 3, "n": 3, "temperature": 1.0, "seed": 40,
     "logprobs": True},
    {"id": "chat", "messages": MESSAGES, "gen": 3, "n": 2, "temperature": 0.9, "seed": 1},
    {"id": "bad", "prompt": "x", "n": 0},
]
KEPT = ("generated_ids", "generated_text", "logprobs", "choices", "message", "stop_reason")


def _results(path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["id"]: json.dumps({k: r.get(k) for k in KEPT}, sort_keys=True) for r in rows}


def test_batch_n_and_logprobs_are_the_same_bytes_at_widths_1_and_3(tiny_dir, tok, tmp_path):
    """Catches widths that give different choices or log-probabilities (width 1 runs a
    one-choice line as ``k3-run --ids`` would, n > 1 through the core), a line of n
    choices written as n lines or before all of them finish, a bad "n" not skipped, and
    a rerun that redoes a finished id (the console script end to end at width 3)."""
    batch = tmp_path / "b.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    out = {}
    for width in (1, 3):
        out[width] = tmp_path / f"r{width}.jsonl"
        p = (k3 if width == 3 else k3_here)(tiny_dir, "--batch", batch, "--out", out[width],
                                            "--batch-width", width)
        assert p.returncode == 0, p.stderr
        assert 'b.jsonl:4: skipped: "n" must be an integer 1..16' in p.stderr
    one, three = _results(out[1]), _results(out[3])
    assert sorted(one) == ["chat", "lp", "n3"] and one == three
    row = {r["id"]: r for r in map(json.loads, out[3].read_text().splitlines())}
    assert [bytes(t["bytes"]) for t in row["lp"]["logprobs"]["content"]] == \
        [tok.token_bytes(i) for i in row["lp"]["generated_ids"]] and \
        len(row["lp"]["generated_ids"]) == 4
    assert all(len(t["top_logprobs"]) == 2 for t in row["lp"]["logprobs"]["content"])
    n3 = row["n3"]["choices"]
    assert [c["index"] for c in n3] == [0, 1, 2] and n3[0]["generated_ids"] == \
        row["n3"]["generated_ids"] and len({tuple(c["generated_ids"]) for c in n3}) > 1
    assert all(len(c["logprobs"]["content"]) == len(c["generated_ids"]) for c in n3)
    assert "message" in row["chat"]["choices"][1] and "choices" not in row["lp"]
    again = k3_here(tiny_dir, "--batch", batch, "--out", out[3], "--batch-width", 3)
    assert again.returncode == 0 and "0 done, 3 already in" in again.stderr, again.stderr


def test_reasoning_effort_renders_as_the_templates_switch(tiny_dir, tmp_path):
    """Catches "reasoning_effort" accepted on a batch line but not rendered (the prompt
    unchanged), or mapped otherwise than the server maps it: "none" is the template's
    thinking switch off, "high" on (the template's default here)."""
    lines = [{"reasoning_effort": "none"}, {"template_kwargs": {"thinking": False}},
             {"reasoning_effort": "high"}, {}]
    batch, out = tmp_path / "b.jsonl", tmp_path / "r.jsonl"
    batch.write_text("".join(json.dumps({"id": i, "messages": MESSAGES, "gen": 1, **extra})
                             + "\n" for i, extra in enumerate(lines)))
    p = k3_here(tiny_dir, "--batch", batch, "--out", out)
    assert p.returncode == 0 and "4 done" in p.stderr, p.stderr
    ids = {r["id"]: r["prompt_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[0] != ids[2]
