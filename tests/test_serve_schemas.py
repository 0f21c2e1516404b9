"""k3-run --serve: a request whose schema k3 cannot enforce gets its own 422 (a vendor
key 400) before it takes a lane, on every endpoint, and the requests decoding beside it
get the tokens they get alone. Live server on the tiny model; skipped without the serve
extra, the openai client or llguidance."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("openai")
pytest.importorskip("llguidance")

from tests.test_serve import _post, _start, _stop  # noqa: E402

ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
MSGS = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    srv = _start(tiny_dir, tmp_path_factory.mktemp("serve_schemas") / "stderr.log")
    yield srv
    _stop(srv)


def _fmt(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


def _tool(schema) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": schema}}


POISON = [
    ("/v1/chat/completions", {"messages": MSGS, "response_format": _fmt({"$ref": "#"})},
     "response_format"),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": _fmt(ENDLESS), "n": 2},
     "response_format"),
    ("/v1/completions", {"prompt": "x", "response_format": _fmt(ENDLESS)}, "response_format"),
    ("/v1/chat/completions", {"messages": MSGS, "tools": [_tool(ENDLESS)],
                              "tool_choice": "required"}, "tools"),
    ("/v1/messages", {"messages": MSGS, "tools": [{"name": "f", "input_schema": ENDLESS}],
                      "tool_choice": {"type": "any"}}, "tools"),
]


def _innocent(server, i: int) -> list:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": 12, "temperature": 0.9, "seed": i}
    status, reply = _post(server, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, reply
    return reply["k3"]["generated_ids"]


def test_serve_endless_schema_is_its_own_422_and_spares_the_neighbours(server):
    """Catches a schema no finite value satisfies admitted into the shared pass (there it
    failed every lane: three innocent requests got 500): on each endpoint it is refused
    422 naming its field, before any work, while three innocent requests decoding at the
    same time get exactly the tokens they get alone (control: the same requests alone)."""
    alone = [_innocent(server, i) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        innocents = [pool.submit(_innocent, server, i) for i in range(3)]
        poisons = [pool.submit(_post, server, path, json.dumps(
            {"model": "tiny", "max_tokens": 16, **body}).encode()) for path, body, _ in POISON]
        got = [f.result() for f in innocents]
        refused = [f.result() for f in poisons]
    assert got == alone
    for (path, _, param), (status, err) in zip(POISON, refused):
        assert status == 422, (path, err)
        if path == "/v1/messages":
            assert param in err["error"]["message"], err
        else:
            assert err["error"]["param"] == param, err


def test_serve_vendor_key_in_a_schema_is_400_naming_it(server):
    """Catches a client's x-guidance reaching the grammar library (item_separator made
    '[-3600XX12XX0]' finish "stop"; lenient dropped keywords): 400 naming the key, for a
    response_format and a tool's parameters; the schema without it is served (control)."""
    xg = {"type": "array", "items": {"type": "integer"}, "x-guidance": {"item_separator": "XX"}}
    for body in ({"messages": MSGS, "response_format": _fmt(xg)},
                 {"messages": MSGS, "tools": [_tool(xg)], "tool_choice": "required"}):
        status, err = _post(server, "/v1/chat/completions", json.dumps(
            {"model": "tiny", "max_tokens": 4, **body}).encode())
        assert status == 400 and "x-guidance" in err["error"]["message"], err
    status, err = _post(server, "/v1/messages", json.dumps(
        {"model": "tiny", "max_tokens": 4, "messages": MSGS,
         "tools": [{"name": "f", "input_schema": xg}]}).encode())
    assert status == 400 and "x-guidance" in err["error"]["message"], err
    plain = {k: v for k, v in xg.items() if k != "x-guidance"}
    status, reply = _post(server, "/v1/chat/completions", json.dumps(
        {"model": "tiny", "max_tokens": 4, "messages": MSGS,
         "response_format": _fmt(plain)}).encode())
    assert status == 200, reply


def test_serve_bad_regex_message_is_whole(server):
    """Catches a bad pattern's message cut after its first line ("regex parse error:")."""
    status, err = _post(server, "/v1/chat/completions", json.dumps(
        {"model": "tiny", "max_tokens": 4, "messages": MSGS,
         "response_format": _fmt({"type": "string", "pattern": "("})}).encode())
    assert status == 422 and "unclosed group" in err["error"]["message"], err


def test_serve_refusal_names_no_server_path(server, tiny_dir):
    """Catches a 422 whose message holds the server's absolute path to the template file
    (role "developer", which the template refuses): the file is named by its name only;
    the same refusal's K3Error keeps the path for the log (control)."""
    from libk3.errors import UsageError
    from libk3.serve.protocol import client_line, refusal_of
    status, err = _post(server, "/v1/chat/completions", json.dumps(
        {"model": "tiny", "max_tokens": 2,
         "messages": [{"role": "developer", "content": "x"}]}).encode())
    if status == 422:
        assert str(tiny_dir) not in err["error"]["message"], err
    e = UsageError("the template failed", path=tiny_dir / "tokenizer_config.json")
    assert client_line(e) == "tokenizer_config.json: the template failed"
    assert str(tiny_dir) in e.one_line() and refusal_of(e)[0] == 422
    assert str(tiny_dir) not in refusal_of(e)[1]["error"]["message"]


def test_usage_errors_name_each_tool_not_main():
    """Catches "requires an argument" errors naming the program "main" (click's name
    of the function) in every tool: each names itself."""
    from .scripts import tool
    for name, args in (("k3-run", ("--ids",)), ("k3-pack", ("--against",)),
                       ("k3-doctor", ("--threads",)), ("k3-trace", ("replay", "--slots"))):
        r = tool(name, *args)
        assert r.returncode == 2 and r.stderr.startswith(f"{name}"), r.stderr
        assert "main" not in r.stderr, r.stderr


# admitted (its witness is {}), yet a reply that writes the key "x" can never go on
DEAD_END = {"type": "object", "properties": {"x": {"$ref": "#/$defs/bad"}},
            "additionalProperties": False, "$defs": {"bad": {"$ref": "#/$defs/bad"}}}


def test_serve_grammar_failing_mid_pass_ends_that_request_alone(server, tiny_dir):
    """Catches a grammar failure inside the shared pass failing every lane (innocent
    requests got 500): a schema that passes admission but whose reply is steered (by
    logit_bias on '"') into a key no value can follow fails that request alone, 422
    naming the grammar, while three requests decoding beside it get exactly the tokens
    they get alone (control: those requests alone)."""
    from libk3.text.tokenizer import K3Tokenizer
    quote = K3Tokenizer.from_dir(tiny_dir).encode('"')
    assert len(quote) == 1
    body = {"model": "tiny", "max_tokens": 16, "messages": MSGS,
            "response_format": _fmt(DEAD_END), "logit_bias": {str(quote[0]): 100}}
    alone = [_innocent(server, i) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        bad = pool.submit(_post, server, "/v1/chat/completions", json.dumps(body).encode())
        innocents = [pool.submit(_innocent, server, i) for i in range(3)]
        got = [f.result() for f in innocents]
        status, err = bad.result()
    assert got == alone
    assert status == 422 and "grammar failed" in err["error"]["message"], (status, err)
