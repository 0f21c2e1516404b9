"""One bad schema never fails its neighbours: a schema k3 cannot enforce (no finite value
satisfies it, too large, a vendor key of the grammar library) is refused before any
work on every surface, and a lane whose grammar still fails during a pass leaves alone,
the others' tokens those they get alone (docs/run.md "Structured output")."""

from __future__ import annotations

import json

import pytest

from libk3.engine.generate import GenSettings, generate, run_requests
from libk3.engine.core import Request

from .scripts import k3, k3_here

pytest.importorskip("llguidance")

from libk3.constrain import schema_check  # noqa: E402  (after the skip)
from libk3.constrain.grammar import JSON_OPTIONS, Grammar, GrammarTokenizer  # noqa: E402

# schemas llguidance compiles that no finite value satisfies
ENDLESS = {
    "self": {"$ref": "#"},
    "required-recursion": {"type": "object", "properties": {"a": {"$ref": "#"}},
                           "required": ["a"]},
    "nonempty-array-of-itself": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
}
# controls: recursive, but with a way out, and ordinary schemas
FINITE = {
    "linked-list": {"type": "object", "properties": {"l": {"$ref": "#/$defs/list"}},
                    "required": ["l"], "$defs": {"list": {"anyOf": [
                        {"type": "null"},
                        {"type": "object", "properties": {"v": {"type": "integer"},
                                                          "next": {"$ref": "#/$defs/list"}},
                         "required": ["v", "next"]}]}}},
    "optional-recursion": {"type": "object", "properties": {"a": {"$ref": "#"}}},
    "email": {"type": "string", "format": "email"},
    "pattern": {"type": "object", "properties": {"code": {"type": "string",
                                                          "pattern": "^[A-Z]+-[0-9]{3}$"}},
                "required": ["code"]},
}


def _fmt(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


@pytest.mark.parametrize("name", ENDLESS)
def test_schema_check_refuses_schemas_no_finite_value_satisfies(name):
    """Catches an admission that only compiles the schema (llguidance compiles these and
    fails while decoding): each is refused with its reason; the controls, recursive or
    with patterns, pass with a witness value."""
    assert schema_check.schema_problem(ENDLESS[name], JSON_OPTIONS)
    for control in FINITE.values():
        assert schema_check.schema_problem(control, JSON_OPTIONS) is None, control


def test_schema_check_witness_is_a_value_the_schema_accepts():
    """Catches a search that calls a schema satisfiable on a value it does not accept."""
    jsonschema = pytest.importorskip("jsonschema")
    import llguidance as llg
    for schema in FINITE.values():
        text = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        value, why = schema_check.witness(text)
        assert value is not None, why
        jsonschema.validate(json.loads(value), schema)


def test_schema_check_refuses_vendor_keys_anywhere_in_the_schema():
    """Catches x-guidance passed to the library (it overrides k3's compact JSON, item
    separators, lenient keyword dropping): at the root or nested it is refused, naming
    where; a property merely named so is data (control)."""
    root = {"type": "array", "x-guidance": {"item_separator": "XX"}}
    nested = {"type": "object", "properties": {"a": {"anyOf": [{"x-guidance": {}}]}}}
    assert '"x-guidance"' in schema_check.vendor_key_problem(root)
    assert schema_check.vendor_key(nested) == '"properties"."a"."anyOf"[0]."x-guidance"'
    named = {"type": "object", "properties": {"x-guidance": {"type": "string"}}}
    assert schema_check.vendor_key_problem(named) is None
    assert schema_check.schema_problem(named, JSON_OPTIONS) is None
    assert schema_check.request_vendor_key(None, [{"type": "function", "function": {
        "name": "f", "parameters": root}}])[0] == "tools"


def test_schema_check_bounds_the_size():
    """Catches a schema of any size compiled (its compile time and memory are the
    library's): over SCHEMA_MAX_BYTES of JSON is refused; a small one passes."""
    big = {"enum": ["x" * 1000] * (schema_check.SCHEMA_MAX_BYTES // 1000 + 1)}
    assert "bytes of JSON" in schema_check.schema_problem(big, JSON_OPTIONS)
    assert schema_check.schema_problem({"enum": ["x"] * 10}, JSON_OPTIONS) is None


def test_schema_check_deep_nesting_is_a_refusal_not_a_crash():
    """Catches a schema nested past Python's recursion limit raising RecursionError out
    of the check (the request's reader or a batch then failing): it is refused; a
    shallow one passes (control)."""
    deep = {"type": "string"}
    for _ in range(3000):
        deep = {"type": "array", "items": deep}
    assert schema_check.schema_problem(deep, JSON_OPTIONS)
    assert schema_check.vendor_key(deep) is None
    shallow = {"type": "array", "items": {"type": "array", "items": {"type": "string"}}}
    assert schema_check.schema_problem(shallow, JSON_OPTIONS) is None


@pytest.fixture(scope="module")
def sess(tiny_dir):
    from libk3.engine.session import open_session
    s = open_session(tiny_dir)
    yield s
    s.weights.close()


def _unchecked(tok, schema) -> Grammar:
    """``schema`` compiled past the admission check (as before it existed)."""
    import llguidance as llg
    gt = GrammarTokenizer.for_tokenizer(tok)
    return Grammar(gt, llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS),
                   "unchecked:" + json.dumps(schema))


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "drafting"])
@pytest.mark.parametrize("name", ["self", "required-recursion"])
def test_lockstep_failing_grammar_lane_leaves_alone_and_spares_its_neighbours(sess, name,
                                                                             drafted):
    """Catches one lane's grammar failure raised out of the shared pass (every lane then
    lost), with or without drafting (each lane's proposals are masked too): the failing
    lane alone is reported, and the three innocent lanes decoding beside it get exactly
    the tokens they get alone."""
    from libk3.speculate.proposers import PromptLookup
    from libk3.speculate.speculative import Drafting
    tok = sess.tokenizer
    innocent = [GenSettings(gen=10), GenSettings(gen=12, temperature=0.9, seed=3),
                GenSettings(gen=8, temperature=1.2, top_p=0.8, seed=11)]
    prompts = [tok.encode(t) for t in ("hello world hello world hello", "a cat sat",
                                       "numbers: 1 2 3 1 2 3 1 2")]
    alone = [generate(sess.forward, sess.new_state(), p, s, tokenizer=tok).generated_ids
             for p, s in zip(prompts, innocent)]
    failed = {}
    bad = GenSettings(gen=20, grammar=_unchecked(tok, ENDLESS[name]))
    reqs = [Request("bad", tok.encode("give json"), bad)] + \
        [Request(i, p, s) for i, (p, s) in enumerate(zip(prompts, innocent))]
    done, _ = run_requests(sess.forward, lambda n: sess.new_state(), reqs, 4, tokenizer=tok,
                           on_failed=lambda job, e: failed.__setitem__(job.tag, e),
                           drafting=Drafting(PromptLookup(), 4) if drafted else None)
    assert [done[i].generated_ids for i in range(3)] == alone
    assert list(failed) == ["bad"] and "grammar failed" in str(failed["bad"])
    with pytest.raises(Exception):            # control: without on_failed it is raised
        run_requests(sess.forward, lambda n: sess.new_state(),
                     [Request("bad", tok.encode("give json"), bad)], 2, tokenizer=tok)


def test_cli_endless_schema_is_one_line_exit_2(tiny_dir, tmp_path):
    """Catches --response-format @FILE with a schema no value satisfies ending in a
    traceback (exit 1) during generation: one line naming the file, exit 2, before any
    work; a finite schema runs (control)."""
    bad = tmp_path / "endless.json"
    bad.write_text(json.dumps(ENDLESS["required-recursion"]))
    r = k3_here(tiny_dir, "-p", "hi", "-n", "4", "--response-format", f"@{bad}")
    assert r.returncode == 2 and str(bad) in r.stderr and len(r.stderr.splitlines()) == 1
    vendor = tmp_path / "vendor.json"
    vendor.write_text(json.dumps({"type": "object", "x-guidance": {"lenient": True}}))
    r = k3_here(tiny_dir, "-p", "hi", "-n", "4", "--response-format", f"@{vendor}")
    assert r.returncode == 2 and "x-guidance" in r.stderr, r.stderr
    r = k3(tiny_dir, "-p", "hi", "-n", "4", "--response-format", f"@{bad}")  # the script
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr
    good = tmp_path / "list.json"
    good.write_text(json.dumps(FINITE["linked-list"]))
    r = k3_here(tiny_dir, "-p", "hi", "-n", "4", "--response-format", f"@{good}", "-q")
    assert r.returncode == 0, r.stderr


def test_batch_endless_schema_line_is_skipped_and_the_good_lines_finish(tiny_dir, tmp_path):
    """Catches a batch line with a schema no value satisfies crashing the batch (its good
    lines lost, every rerun crashing at the same line): the line is skipped with its
    reason, the others finish, and a rerun has nothing left but the same skip."""
    lines = [{"id": "a", "prompt": "hello", "gen": 4},
             {"id": "bad", "prompt": "json", "gen": 8,
              "response_format": _fmt(ENDLESS["self"])},
             {"id": "tools", "messages": [{"role": "user", "content": "x"}], "gen": 2,
              "tools": [{"type": "function", "function": {
                  "name": "f", "parameters": {"type": "object", "x-guidance": {}}}}]},
             {"id": "b", "prompt": "world", "gen": 4, "response_format": {"type": "json_object"}}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    for width in ("2", "2"):                  # the rerun resumes
        r = k3_here(tiny_dir, "--batch", src, "--out", out, "--batch-width", width,
                    "--json", "-q")
        assert r.returncode == 0, r.stderr
        summary = json.loads(r.stdout)
        assert [e["line"] for e in summary["errors"]] == [2, 3], summary["errors"]
        assert "x-guidance" in summary["errors"][1]["error"]
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == ["a", "b"]
