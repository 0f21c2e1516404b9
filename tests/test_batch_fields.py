"""Every field of a batch line is used or refused, by the server's rule: an unknown or
misspelt field, or one of the server's a batch does not implement, skips the line with
its reason naming the field; a prompt too long for the context is refused by its bytes
before it is tokenized (formats/batch.md)."""

from __future__ import annotations

import json

import pytest

from libk3.request.fields import refusal
from libk3.run.batch import BatchLineError, parse_line

from .scripts import k3_here

VOCAB = 512


def _line(**fields) -> bytes:
    return json.dumps({"id": 1, "prompt": "hi", **fields}).encode()


@pytest.mark.parametrize("field,value,said", [
    ("temprature", 0.5, 'did you mean "temperature"'),
    ("max_tokens", 8, '"gen"'),
    ("chat_template_kwargs", {}, '"template_kwargs"'),
    ("echo", True, "not implemented in batch lines"),
    ("colour", "blue", "unknown field \"colour\""),
])
def test_batch_line_field_it_would_ignore_is_refused_naming_it(field, value, said):
    """Catches a line whose field k3 does not use run as if it were absent (a misspelt
    "temprature" sampled greedily, "max_tokens" ignored for --gen's default): the line is
    refused naming the field and what to write; the line without it parses (control)."""
    with pytest.raises(BatchLineError) as e:
        parse_line(_line(**{field: value}), VOCAB)
    assert json.dumps(field) in str(e.value) and said in str(e.value), str(e.value)
    assert parse_line(_line(), VOCAB)["id"] == 1


def test_batch_line_every_documented_field_is_taken():
    """Catches the field check refusing a field formats/batch.md documents."""
    obj = parse_line(_line(gen=3, temperature=0.5, top_p=0.9, top_k=4, min_p=0.1,
                           repetition_penalty=1.1, presence_penalty=0.1,
                           frequency_penalty=0.1, seed=2, stop=["x"], stop_ids=[3],
                           logit_bias={"5": 1.0}, response_format={"type": "text"},
                           n=2, logprobs=True, top_logprobs=3), VOCAB)
    assert obj["gen"] == 3 and obj["n"] == 2 and obj["top_logprobs"] == 3
    msgs = json.dumps({"id": 2, "messages": [{"role": "user", "content": "x"}],
                       "tools": [], "template_kwargs": {}, "reasoning_effort": "low",
                       "tool_choice": "none", "parallel_tool_calls": False}).encode()
    assert parse_line(msgs, VOCAB)["id"] == 2


def test_batch_misspelt_field_and_oversized_prompt_skip_their_lines_alone(tiny_dir, tmp_path):
    """Catches a batch that ignores a misspelt field, or tokenizes a prompt far past the
    context before refusing it: both lines are skipped with their reasons, the good
    line finishes."""
    d = tmp_path / "m"
    d.mkdir()
    for f in tiny_dir.iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f)
    doc = json.loads((tiny_dir / "config.json").read_text())
    doc["text_config"]["max_position_embeddings"] = 48
    (d / "config.json").write_text(json.dumps(doc))
    lines = [{"id": "typo", "prompt": "hi", "temprature": 1.5},
             {"id": "huge", "prompt": "word " * 20_000, "gen": 1},
             {"id": "ok", "prompt": "hi", "gen": 2}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = k3_here(d, "--batch", src, "--out", out, "--json", "-q")
    assert r.returncode == 0, r.stderr
    errors = json.loads(r.stdout)["errors"]
    assert [e["line"] for e in errors] == [1, 2]
    assert errors[0]["error"] == refusal("temprature", "batch")     # the server's words too
    assert "100,000 bytes" in errors[1]["error"]
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["ok"]
