"""``tool_choice`` and ``parallel_tool_calls`` enforced by a grammar on the chat markup
(docs/serve.md, tool_choice): the grammar itself (think channel, forbidden channels) on
the tiny tokenizer, and a live server with the tiny random model, whose replies at
temperature 1 never call a tool by chance; skipped without llguidance, the serve extra
or the openai client."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")
pytest.importorskip("aiohttp")
pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from libk3.constrain.tool_grammar import compile_tool_grammar, think_mode  # noqa: E402
from libk3.text.chat_parse import parse_reply, pieces  # noqa: E402
from .test_serve import _client, _post, _start, _stop  # noqa: E402

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99},
    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MSGS = [{"role": "user", "content": "Weather in Oslo, and 2+2?"}]
SEEDS = 10          # choices of one request: seeds 0..9, decoded together
NO_THINK = {"chat_template_kwargs": {"thinking": False}}   # the prompt closes think


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    srv = _start(tiny_dir, tmp_path_factory.mktemp("tools") / "stderr.log")
    yield srv
    _stop(srv)


def _ask(server, **kw):
    """The choices of one chat request over SEEDS seeds at temperature 1."""
    body = {"model": "tiny", "messages": MSGS, "tools": TOOLS, "temperature": 1.0,
            "seed": 0, "n": SEEDS, "max_tokens": 300, "extra_body": dict(NO_THINK)}
    body["extra_body"].update(kw.pop("extra_body", {}))
    body.update(kw)
    r = _client(server).chat.completions.create(**body)
    assert len(r.choices) == SEEDS
    return r.choices


def _valid_calls(choice, names):
    """The choice's calls, each checked: a name from ``names``, arguments that parse and
    validate against that tool's schema."""
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls, choice
    for call in calls:
        assert call.type == "function" and call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def _ids(tok, *parts):
    """Ids of ``parts``: a markup name ("<|open|>") as its special id, else text."""
    out = []
    for p in parts:
        out += [tok.id_of(p)] if p.startswith("<|") else tok.encode(p)
    return out


CALL = ("<|open|>", "tools", "<|sep|>", "<|open|>", 'call name="add" id="c1"', "<|sep|>",
        '{"a":1,"b":2}', "<|close|>", "call", "<|sep|>", "<|close|>", "tools", "<|sep|>")
THINK = ("<|open|>", "think", "<|sep|>", "let me see", "<|close|>", "think", "<|sep|>")


def _accepts(grammar, ids) -> bool:
    """Whether ``grammar`` takes ``ids`` as a whole reply (an end token may follow)."""
    m = grammar.matcher()
    try:
        for t in ids:
            m.advance(t)
    except ValueError:
        return False
    return m.is_complete()


def test_grammar_keeps_thinking_and_forbids_what_the_choice_excludes(tok):
    """Catches the think channel made impossible under "required" (or allowed again after
    a prompt that closed it), a tools channel let through under "none", text content or
    a second call let through under "required" without parallel calls, and a call
    parsed from the accepted ids differing from what was written."""
    required = compile_tool_grammar(tok, TOOLS, "required", parallel=False)
    assert _accepts(required, _ids(tok, *CALL))
    assert _accepts(required, _ids(tok, *THINK, *CALL))
    assert _accepts(required, _ids(tok, *THINK, *CALL, "<|close|>", "assistant", "<|sep|>"))
    assert not _accepts(required, _ids(tok, *THINK))                   # no call
    assert not _accepts(required, _ids(tok, "<|open|>", "response", "<|sep|>", "hi",
                                       "<|close|>", "response", "<|sep|>", *CALL))
    two = CALL[:10] + CALL[3:]
    assert not _accepts(required, _ids(tok, *two))
    assert _accepts(compile_tool_grammar(tok, TOOLS, "required"), _ids(tok, *two))
    bad_args = tuple('{"a":1}' if p == '{"a":1,"b":2}' else p for p in CALL)
    assert not _accepts(required, _ids(tok, *bad_args))               # "b" is required
    closed = compile_tool_grammar(tok, TOOLS, "required", think="closed")
    assert not _accepts(closed, _ids(tok, *THINK, *CALL))
    assert _accepts(closed, _ids(tok, *CALL))
    opened = compile_tool_grammar(tok, TOOLS, "required", think="open")
    assert _accepts(opened, _ids(tok, *THINK[3:], *CALL))
    named = compile_tool_grammar(tok, TOOLS, {"type": "function",
                                              "function": {"name": "get_weather"}})
    assert not _accepts(named, _ids(tok, *CALL))
    weather = tuple('call name="get_weather"' if p.startswith("call name") else
                    '{"city":"Oslo"}' if p.startswith("{") else p for p in CALL)
    assert _accepts(named, _ids(tok, *weather))
    assert _accepts(named, _ids(tok, *(weather[:10] + weather[3:])))   # parallel: two
    none = compile_tool_grammar(tok, TOOLS, "none")
    assert not _accepts(none, _ids(tok, *CALL))
    assert _accepts(none, _ids(tok, *THINK, "<|open|>", "response", "<|sep|>", "hi",
                               "<|close|>", "response", "<|sep|>"))
    assert _accepts(none, _ids(tok, "plain text"))
    at_most_one = compile_tool_grammar(tok, TOOLS, "auto", parallel=False)
    assert _accepts(at_most_one, _ids(tok, "sure", *CALL))
    assert not _accepts(at_most_one, _ids(tok, *two))
    assert compile_tool_grammar(tok, TOOLS, "auto") is None
    reply = parse_reply(pieces(tok, _ids(tok, *THINK, *CALL)))
    assert reply.reasoning == "let me see" and reply.content == ""
    assert reply.tool_calls == [{"id": "c1", "type": "function", "function": {
        "name": "add", "arguments": '{"a":1,"b":2}'}}]


def test_think_mode_reads_where_the_prompt_leaves_the_think_channel(tok):
    """Catches a prompt that closed the think channel (thinking off) read as one the
    reply may still open, and the other way round."""
    assert think_mode(tok, _ids(tok, "<|open|>", "assistant", "<|sep|>")) == "optional"
    assert think_mode(tok, _ids(tok, "<|open|>", "assistant", "<|sep|>",
                                *THINK[:3], *THINK[4:])) == "closed"
    assert think_mode(tok, _ids(tok, "<|open|>", "assistant", "<|sep|>",
                                *THINK[:3])) == "open"


def test_required_always_calls_listed_tools_with_valid_arguments(server):
    """Catches "required" not enforced (the random model never writes the tools markup by
    itself), a call naming a tool not in the request, and arguments that do not parse or
    do not validate against the tool's parameters schema."""
    names = set()
    for choice in _ask(server, tool_choice="required"):
        names |= {c.function.name for c in _valid_calls(choice, SCHEMAS)}
        assert not choice.message.content, choice      # "required": calls, no text
    assert names == set(SCHEMAS)        # both tools drawn: the choice is not fixed


def test_named_function_is_the_only_one_called(server):
    """Catches a named tool_choice enforced as "required" (any tool: the model then
    calls "add" as often as "get_weather"). One call each (parallel_tool_calls false):
    several calls with random ids would not fit the token limit."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in _ask(server, tool_choice=named, parallel_tool_calls=False):
        assert [c.function.name for c in _valid_calls(choice, {"get_weather"})] == \
            ["get_weather"]


def test_parallel_tool_calls_false_means_exactly_one_call(server):
    """Catches parallel_tool_calls false ignored: with it true the random model writes
    several calls in some of the seeds (the control), with it false never."""
    counts = [len(_valid_calls(c, SCHEMAS)) for c in _ask(server, tool_choice="required")]
    assert max(counts) > 1, counts                      # the control: parallel allowed
    for choice in _ask(server, tool_choice="required", parallel_tool_calls=False):
        assert len(_valid_calls(choice, SCHEMAS)) == 1


def test_none_allows_no_tools_channel(server, tok):
    """Catches "none" not enforced: with <|open|> pushed up by a logit bias, "auto" (the
    control) writes <|open|> after <|open|>, while under "none" every element opened is
    a response (or think) channel, and no choice has a tool call."""
    open_id = str(tok.id_of("<|open|>"))
    plain = _ask(server, tool_choice="auto", logit_bias={open_id: 100}, max_tokens=40)
    none = _ask(server, tool_choice="none", logit_bias={open_id: 100}, max_tokens=40)
    assert any("<|open|><|open|>" in (c.message.content or "") for c in plain)
    for choice in none:
        assert not choice.message.tool_calls and choice.finish_reason != "tool_calls"
        text = choice.message.content or ""
        assert text.startswith("<|open|>response<|sep|>") and \
            text.count("<|open|>") == 1, text   # the channel's body: no markup


def test_required_streamed_sends_the_calls(server):
    """Catches the grammar applied to whole replies only: a streamed "required" reply
    sends tool_call deltas and ends with finish_reason "tool_calls"."""
    stream = _client(server).chat.completions.create(
        model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", temperature=1.0,
        seed=3, max_tokens=300, stream=True, extra_body=NO_THINK)
    calls, finish = {}, None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or ():
                calls.setdefault(d.index, "")
                calls[d.index] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and calls
    for args in calls.values():
        json.loads(args)


def test_refusals_name_tool_choice(server):
    """Catches a tool_choice k3 cannot enforce answered anyway: an unknown function, a
    call asked for without tools, a malformed choice, a non-boolean parallel_tool_calls,
    and "required" beside a JSON response_format all refused (422, naming the field);
    controls: "none" without tools and "none" beside a response_format are answered."""
    base = {"model": "tiny", "messages": MSGS, "max_tokens": 2}
    unknown = {"type": "function", "function": {"name": "nope"}}
    for extra, param in (({"tools": TOOLS, "tool_choice": unknown}, "tool_choice"),
                         ({"tool_choice": "required"}, "tool_choice"),
                         ({"tool_choice": unknown}, "tool_choice"),
                         ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
                         ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
                         ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
                         ({"tools": TOOLS, "tool_choice": "required",
                           "response_format": {"type": "json_object"}}, "tool_choice"),
                         ({"tools": [{"type": "function", "function": {"name": "a b"}}],
                           "tool_choice": "required"}, "tools")):
        status, err = _post(server, "/v1/chat/completions", json.dumps({**base, **extra}).encode())
        assert status == 422 and err["error"]["param"] == param, (extra, status, err)
    for extra in ({"tool_choice": "none"},
                  {"tools": TOOLS, "tool_choice": "none",
                   "response_format": {"type": "json_object"}},
                  {"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False}):
        status, body = _post(server, "/v1/chat/completions", json.dumps({**base, **extra}).encode())
        assert status == 200, (extra, body)
    status, err = _post(server, "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "hi", "max_tokens": 1, "tool_choice": "required"}).encode())
    assert status == 400 and err["error"]["param"] == "tool_choice"



def test_thinking_budget_cuts_the_think_channel_and_leaves_the_rest_free(tok):
    """Catches a reasoning budget that is not enforced (a think channel longer than it
    accepted), one that forbids what follows the channel or a reply without one (a
    response, tools, plain text), and a budget applied where the prompt closed the
    channel: after BUDGET tokens of reasoning the only token allowed is the channel's
    closing tag; and a second think channel, which would reason past the budget, is
    refused."""
    from libk3.constrain.tool_grammar import compile_think_budget
    budget = 8
    g = compile_think_budget(tok, "optional", budget)
    words = tok.encode(" one two three four five six")
    assert len(words) > budget
    m = g.matcher()
    for t in _ids(tok, "<|open|>", "think", "<|sep|>") + words[:budget]:
        m.advance(t)
    allowed = np.flatnonzero(m.allowed(tok.vocab_size))
    assert allowed.tolist() == [tok.id_of("<|close|>")]
    short = ("<|open|>", "think", "<|sep|>", " one two", "<|close|>", "think", "<|sep|>")
    assert len(tok.encode(" one two")) <= budget
    reply = ("<|open|>", "response", "<|sep|>", "hi", "<|close|>", "response", "<|sep|>")
    for ok in (short + reply, short + CALL, reply, CALL, ("plain text",),
               short + ("<|close|>", "assistant", "<|sep|>")):
        assert _accepts(g, _ids(tok, *ok)), ok
    for twice in (short + THINK, short + reply + THINK, reply + THINK):
        assert not _accepts(g, _ids(tok, *twice)), twice
    assert not _accepts(g, _ids(tok, "<|open|>", "think", "<|sep|>", " one two three four",
                                "<|close|>", "think", "<|sep|>"))
    assert not _accepts(g, _ids(tok, "<|open|>", "thinking", "<|sep|>", " one two three",
                                " four", "<|close|>", "thinking", "<|sep|>"))   # not free
    opened = compile_think_budget(tok, "open", budget)
    assert _accepts(opened, _ids(tok, " one two", "<|close|>", "think", "<|sep|>", *reply))
    assert not _accepts(opened, _ids(tok, " one two", "<|close|>", "think", "<|sep|>", *THINK))
    assert not _accepts(opened, _ids(tok, " one two three four", "<|close|>", "think",
                                     "<|sep|>"))
    assert compile_think_budget(tok, "closed", budget) is None


def test_thinking_budget_holds_in_generation(tiny_dir, tok):
    """Catches a budget grammar the sampler does not apply (the tiny random model,
    sampled, writes reasoning until the length limit): from a prompt that opened the
    think channel, the reply's reasoning is BUDGET tokens and the channel's closing tag
    follows; control: without the budget the same seed writes past it unclosed."""
    from libk3.engine.generate import GenSettings, generate
    from libk3.constrain.tool_grammar import compile_think_budget
    from libk3.engine.session import open_session
    s = open_session(tiny_dir)
    prompt = _ids(tok, "<|open|>", "user", "<|sep|>", "Hi", "<|close|>", "user", "<|sep|>",
                  "<|end_of_msg|>", "<|open|>", "assistant", "<|sep|>",
                  "<|open|>", "think", "<|sep|>")
    assert think_mode(tok, prompt) == "open"
    budget, close = 5, tok.id_of("<|close|>")
    base = GenSettings(gen=20, temperature=1.0, seed=7)
    free = generate(s.forward, s.new_state(), prompt, base).generated_ids
    assert close not in free[:budget + 1]                      # the control would run on
    capped = GenSettings(gen=20, temperature=1.0, seed=7,
                         grammar=compile_think_budget(tok, "open", budget))
    got = generate(s.forward, s.new_state(), prompt, capped).generated_ids
    first, tag = got.index(close), _ids(tok, "<|close|>", "think", "<|sep|>")
    assert first <= budget and got[first:first + len(tag)] == tag, got


def test_batch_line_tool_choice_is_enforced_as_on_the_server(server, tiny_dir, tmp_path):
    """Catches a batch line's "tool_choice" accepted but not enforced (the random model
    calls no tool on its own), or enforced otherwise than the server enforces it: the
    same request through /v1/chat/completions and a batch file calls the same tools."""
    from .scripts import k3_here
    ask = {"messages": MSGS, "tools": TOOLS, "temperature": 1.0, "seed": 3, "n": 2,
           "tool_choice": {"type": "function", "function": {"name": "add"}},
           "parallel_tool_calls": False}
    status, r = _post(server, "/v1/chat/completions", json.dumps(
        {"model": "tiny", "max_tokens": 200, "chat_template_kwargs": {"thinking": False},
         **ask}).encode())
    assert status == 200, r
    batch, out = tmp_path / "b.jsonl", tmp_path / "r.jsonl"
    batch.write_text(json.dumps({"id": 1, "gen": 200, "template_kwargs": {"thinking": False},
                                 **ask}) + "\n")
    p = k3_here(tiny_dir, "--batch", batch, "--out", out)
    assert p.returncode == 0 and "1 done" in p.stderr, p.stderr
    line = json.loads(out.read_text())
    for mine, theirs in zip(line["choices"], r["choices"]):
        calls = mine["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["add"]
        assert [c["function"] for c in calls] == \
            [c["function"] for c in theirs["message"]["tool_calls"]]
