"""Structured output (response_format): the grammar mask keeps every sequence's text JSON
valid against its schema, sampled or greedy, alone, in lockstep and drafting, and changes
nothing without one; bad formats and a missing extra are refused as docs/run.md says."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from libk3.engine.generate import GenSettings, generate

from .scripts import k3_here

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from libk3.constrain.grammar import compile_grammar  # noqa: E402  (after the skip)

_S = {"type": "string", "maxLength": 8}
_I = {"type": "integer", "minimum": 0, "maximum": 999}


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


SCHEMAS = [
    _obj({"name": _S, "age": _I}),
    _obj({"kind": {"enum": ["cat", "dog", "bird"]}, "ok": {"type": "boolean"}}),
    _obj({"tags": {"type": "array", "items": _S, "minItems": 1, "maxItems": 3}}),
    _obj({"owner": _obj({"id": _I, "email": _S}), "n": _I}),
    _obj({"name": _S, "age": _I, "kind": {"enum": ["a", "b"]},
          "tags": {"type": "array", "items": _I, "maxItems": 3},
          "owner": _obj({"id": _I, "tags": {"type": "array", "items": _S, "maxItems": 2}})}),
]


def _fmt(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema,
                                                   "strict": True}}


class _Noise:
    """A stand-in model for the property tests: the logits of a position are N(0, 2)
    noise keyed by (seed, position), so 100 sequences cost no forward pass."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.seed = vocab, seed

    def new_state(self):
        return SimpleNamespace(pos=0, ids=[], logits=None,
                               cfg=SimpleNamespace(vocab_size=self.vocab))

    def __call__(self, ids, state, all_logits=True, phase=None, taps=None):
        rows = []
        for t in ids:
            state.ids.append(int(t))
            state.pos += 1
            rows.append(np.random.default_rng([self.seed, state.pos]).normal(0, 2, self.vocab))
        return np.array(rows, np.float32)

    def run(self, segments):
        """A pass over several sequences, as ``Forward.run`` (the engine core's call)."""
        return [self(seg.ids, seg.state) for seg in segments]


def _text(tok, res, grammar) -> str:
    """The reply's text without its end token."""
    ends = set(grammar.end_ids())
    return tok.decode([i for i in res.generated_ids if i not in ends])


@pytest.mark.parametrize("schema", SCHEMAS, ids=["str-int", "enum-bool", "array", "nested",
                                                 "all"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_output_parses_and_validates(tok, schema, temperature):
    """Catches a mask that lets through a token breaking the JSON or the schema, an end
    token allowed before the JSON is complete, or a sequence that does not end once it
    is (20 seeds, sampled and greedy, over the tiny vocabulary's own bytes)."""
    g = compile_grammar(tok, _fmt(schema))
    ended = 0
    for seed in range(20):
        model = _Noise(tok.vocab_size, seed)
        s = GenSettings(gen=300, temperature=temperature, seed=seed, grammar=g)
        res = generate(model, model.new_state(), [1, 2, 3], s, tokenizer=tok)
        if res.stop_reason == "length":
            continue                          # cut: documented as not valid JSON
        assert res.stop_reason == "stop_id" and res.generated_ids[-1] in g.end_ids()
        jsonschema.validate(json.loads(_text(tok, res, g)), schema)
        ended += 1
    assert ended >= 15, "too few sequences ended for the check to mean anything"


def test_json_object_and_model(tok, tiny_dir, tmp_path):
    """Catches the CLI path losing the format (k3-run --response-format with the tiny
    model, greedy and sampled): the text must be a JSON object, or a schema's JSON."""
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SCHEMAS[1]))
    for fmt, schema in (("json_object", {"type": "object"}), (f"@{path}", SCHEMAS[1])):
        for temp in ("0", "1"):
            r = k3_here(tiny_dir, "-p", "hello", "-n", "60", "--temperature", temp, "--seed",
                        "2", "--response-format", fmt, "--json", "-q")
            assert r.returncode == 0, r.stderr
            rep = json.loads(r.stdout)
            assert "grammar_mask_seconds" in rep
            if rep["stop_reason"] == "length":
                continue
            ids = rep["generated_ids"][:-1]
            jsonschema.validate(json.loads(tok.decode(ids)), schema)


# Tokens the tiny model gave before structured output existed (the sampler, generate and
# stops of the commit before it), prompt "hello world", gen 12.
BEFORE = [
    (dict(temperature=0.0), [491, 194, 232, 318, 176, 144, 258, 242, 203, 263, 49, 290]),
    (dict(temperature=1.0, seed=5), [491, 167, 431, 272, 351, 73, 440, 189, 448, 39, 313, 17]),
    (dict(temperature=0.8, seed=9, top_k=40, top_p=0.9, repetition_penalty=1.2,
          presence_penalty=0.5, logit_bias=((92, 3.0), (123, -5.0))),
     [56, 21, 203, 92, 392, 114, 147, 345, 17, 496, 378, 93]),
]


@pytest.fixture(scope="module")
def sess(tiny_dir):
    from libk3.engine.session import open_session
    s = open_session(tiny_dir)
    yield s
    s.weights.close()


def test_no_grammar_tokens_unchanged(sess):
    """Catches any change to sampling without a grammar (the mask step must be a no-op
    bit for bit): the tokens equal those recorded before the grammar existed."""
    tok = sess.tokenizer
    for kw, want in BEFORE:
        res = generate(sess.forward, sess.new_state(), tok.encode("hello world"),
                       GenSettings(gen=12, **kw), tokenizer=tok)
        assert res.generated_ids == want, kw
        assert res.grammar_seconds is None


def test_matcher_copy_and_rollback(tok):
    """Catches lanes sharing grammar state (``copy``) and a sync that does not roll back
    what a rejected proposal left (drafting's exactness)."""
    g = compile_grammar(tok, {"type": "json_object"})
    m = g.matcher()
    ids = tok.encode('{"a":1}')
    m.sync(ids[:3])
    c = m.copy()
    c.sync(ids)
    assert c.is_complete() and not m.is_complete() and m.ids == ids[:3]
    ok = m.allowed(tok.vocab_size).copy()
    m.sync(ids)                      # forward, then back to where it was
    m.sync(ids[:3])
    m._kept.clear()                  # computed afresh, not the kept mask
    assert np.array_equal(m.allowed(tok.vocab_size), ok)
    assert not ok[list(g.end_ids())].any()
    done = c.allowed(tok.vocab_size)
    assert done[list(g.end_ids())].all() and done.sum() == len(g.end_ids())


def _batch(tmp_path, tiny_dir, lines, *extra):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}.jsonl"
    r = k3_here(tiny_dir, "--batch", src, "--out", out, "--json", "-q", *extra)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    return {row["id"]: row for row in rows}, json.loads(r.stdout)


def test_lockstep_lines_equal_alone(tmp_path, tiny_dir, tok):
    """Catches lanes sharing a matcher, a mask leaking into unconstrained neighbours, or
    lockstep picking other tokens than a line alone (width 3, constrained and free lines
    mixed; width 1 runs each line alone)."""
    lines = [
        {"id": "obj", "prompt": "a cat", "gen": 20, "temperature": 1.0, "seed": 1,
         "response_format": {"type": "json_object"}},
        {"id": "free", "prompt": "a dog", "gen": 14, "temperature": 1.0, "seed": 2},
        {"id": "schema", "prompt": "hello", "gen": 24, "seed": 3,
         "response_format": _fmt(SCHEMAS[1])},
        {"id": "text", "prompt": "hello", "gen": 10, "temperature": 0.7, "seed": 4,
         "response_format": {"type": "text"}},
    ]
    wide, _ = _batch(tmp_path, tiny_dir, lines, "--batch-width", "3")
    alone, _ = _batch(tmp_path, tiny_dir, lines, "--batch-width", "1")
    for key in wide:
        assert wide[key]["generated_ids"] == alone[key]["generated_ids"], key
    assert "grammar_mask_seconds" in wide["obj"] and "grammar_mask_seconds" not in wide["free"]
    free = k3_here(tiny_dir, "-p", "hello", "-n", "10", "--temperature", "0.7", "--seed", "4",
                   "--json", "-q")
    assert json.loads(free.stdout)["generated_ids"] == wide["text"]["generated_ids"]


def test_drafting_keeps_the_tokens(tiny_dir):
    """Catches a verify pass masking its rows without the anchor and proposals before
    them: prompt-lookup drafting under a grammar (proposals kept and rejected) must give
    the tokens plain decoding gives."""
    args = (tiny_dir, "-p", '{"a":"b","a":"b","a":"b","a":"b"', "-n", "40",
            "--response-format", "json_object", "--json", "-q")
    plain = json.loads(k3_here(*args).stdout)
    spec = k3_here(*args, "--spec", "4")
    assert spec.returncode == 0, spec.stderr
    rep = json.loads(spec.stdout)
    assert rep["generated_ids"] == plain["generated_ids"]
    drafts = rep["speculative"]
    assert drafts["accepted"] > 0 and drafts["drafted"] > drafts["accepted"], drafts


def test_refusals(tmp_path, tiny_dir, monkeypatch):
    """Catches a bad schema, a file that is not JSON or a bad batch line getting past the
    checks, and a missing extra failing later than the usage check (or breaking runs
    that do not ask for structured output)."""
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "nope"}')
    r = k3_here(tiny_dir, "-p", "hi", "--response-format", f"@{bad}")
    assert r.returncode == 2 and str(bad) in r.stderr and len(r.stderr.splitlines()) == 1
    notjson = tmp_path / "x.json"
    notjson.write_text("{nope")
    r = k3_here(tiny_dir, "-p", "hi", "--response-format", f"@{notjson}")
    assert r.returncode == 2 and str(notjson) in r.stderr
    lines = [{"id": 1, "prompt": "hi", "gen": 2, "response_format": {"type": "xml"}},
             {"id": 2, "prompt": "hi", "gen": 2,
              "response_format": _fmt({"type": "string", "pattern": "("})},
             {"id": 3, "prompt": "hi", "gen": 2}]
    rows, summary = _batch(tmp_path, tiny_dir, lines)
    assert list(rows) == [3] and [e["line"] for e in summary["errors"]] == [1, 2]
    monkeypatch.setitem(sys.modules, "llguidance", None)         # the extra is missing
    r = k3_here(tiny_dir, "-p", "hi", "-n", "2", "--response-format", "json_object")
    assert r.returncode == 2 and "structured" in r.stderr and len(r.stderr.splitlines()) == 1
    r = k3_here(tiny_dir, "-p", "hi", "-n", "2", "--json", "-q")
    assert r.returncode == 0, r.stderr
