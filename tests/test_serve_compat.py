"""llama-server's and Ollama's routes (docs/serve.md "llama-server and Ollama routes"),
each driven with the request shapes those projects document, answered by the same
engine as the OpenAI routes; skipped without the serve extra."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("aiohttp")

from .test_serve import KEY, _post, server  # noqa: E402,F401  (the module's live server)


def _raw(srv, method: str, path: str, doc=None) -> tuple:
    """(status, content type, body bytes) of a request with the API key."""
    data = None if doc is None else json.dumps(doc).encode()
    req = urllib.request.Request(srv["url"] + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {KEY}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def _ok(srv, method, path, doc=None):
    status, kind, body = _raw(srv, method, path, doc)
    assert status == 200, body[:300]
    return kind, body


def test_llama_completion_is_the_openai_completion_whole_and_streamed(server):  # noqa: F811
    """Catches /completion answering 404, n_predict not reaching max_tokens, or a stream
    whose events do not add up to the whole answer: llama.cpp's README request gives
    the text /v1/completions gives, streamed as SSE events ending with stop: true."""
    ask = {"prompt": "Building a website can be done in 10 simple steps:", "n_predict": 5}
    _, body = _ok(server, "POST", "/completion", ask)
    whole = json.loads(body)
    status, oai = _post(server, "/v1/completions",
                        json.dumps({"prompt": ask["prompt"], "max_tokens": 5}).encode())
    assert status == 200 and whole["content"] == oai["choices"][0]["text"]
    assert whole["stop"] is True and whole["tokens_predicted"] == 5
    assert whole["stop_type"] == "limit" and whole["tokens_evaluated"] > 0
    kind, body = _ok(server, "POST", "/completion", dict(ask, stream=True, cache_prompt=True))
    events = [json.loads(ln[6:]) for ln in body.decode().splitlines() if ln.startswith("data: ")]
    assert kind.startswith("text/event-stream") and events[-1]["stop"] is True
    assert not any(e["stop"] for e in events[:-1])
    assert "".join(e["content"] for e in events) == whole["content"]


def test_llama_props_and_slots_describe_the_server(server):  # noqa: F811
    """Catches /props and /slots missing or disagreeing: the slots are the lanes, the
    context the model's, the chat template the checkpoint's."""
    props = json.loads(_ok(server, "GET", "/props")[1])
    slots = json.loads(_ok(server, "GET", "/slots")[1])
    assert props["total_slots"] == len(slots) >= 1
    assert props["default_generation_settings"]["n_ctx"] == slots[0]["n_ctx"] == 1048576
    assert "<|open|>" in props["chat_template"]
    assert all(s["is_processing"] is False for s in slots)


def test_ollama_generate_and_chat_answer_as_the_openai_chat(server):  # noqa: F811
    """Catches /api/chat or /api/generate running anything but the chat request the
    OpenAI route runs (the same reply for the same messages), a default that is not
    streaming (Ollama streams unless stream is false), or NDJSON lines that do not add up
    to the whole answer."""
    msgs = [{"role": "user", "content": "why is the sky blue?"}]
    status, oai = _post(server, "/v1/chat/completions",
                        json.dumps({"messages": msgs, "max_tokens": 4}).encode())
    want = oai["choices"][0]["message"]["content"]
    chat = {"model": "tiny:latest", "messages": msgs, "options": {"num_predict": 4}}
    _, body = _ok(server, "POST", "/api/chat", dict(chat, stream=False))
    whole = json.loads(body)
    assert whole["message"]["content"] == want and whole["done"] is True
    assert whole["done_reason"] == "length" and whole["eval_count"] == 4
    kind, body = _ok(server, "POST", "/api/chat", chat)
    lines = [json.loads(ln) for ln in body.decode().splitlines()]
    assert kind.startswith("application/x-ndjson") and lines[-1]["done"] is True
    assert "".join(ln["message"]["content"] for ln in lines) == want
    gen = {"model": "tiny", "prompt": "why is the sky blue?", "options": {"num_predict": 4}}
    _, body = _ok(server, "POST", "/api/generate", dict(gen, stream=False))
    assert json.loads(body)["response"] == want
    lines = [json.loads(ln) for ln in _ok(server, "POST", "/api/generate", gen)[1].splitlines()]
    assert "".join(ln["response"] for ln in lines) == want and lines[-1]["done"] is True


def test_ollama_raw_generate_is_the_openai_completion(server):  # noqa: F811
    """Catches raw: true still wrapped in the chat template: its text is the plain
    completion's."""
    status, oai = _post(server, "/v1/completions",
                        json.dumps({"prompt": "Hello", "max_tokens": 3}).encode())
    _, body = _ok(server, "POST", "/api/generate",
                  {"model": "tiny", "prompt": "Hello", "raw": True, "stream": False,
                   "options": {"num_predict": 3, "seed": -1, "num_ctx": 4096}})
    assert json.loads(body)["response"] == oai["choices"][0]["text"]


def test_ollama_tags_show_and_version(server):  # noqa: F811
    """Catches the model list, its details or the version missing (clients list models
    from /api/tags and send the name back), and another model shown; control: the
    listed name is accepted by /api/show."""
    tags = json.loads(_ok(server, "GET", "/api/tags")[1])
    name = tags["models"][0]["name"]
    assert name == "tiny:latest" and tags["models"][0]["size"] > 0
    show = json.loads(_ok(server, "POST", "/api/show", {"model": name})[1])
    assert "<|open|>" in show["template"]
    assert show["model_info"]["kimi_k3.context_length"] == 1048576
    assert _raw(server, "POST", "/api/show", {"model": "llama3"})[0] == 404
    assert json.loads(_ok(server, "GET", "/api/version")[1])["version"]


@pytest.mark.parametrize("path,doc,field", [
    ("/completion", {"prompt": "x", "mirostat": 2}, "mirostat"),
    ("/completion", {"prompt": "x", "grammar": "root ::= \"a\""}, "grammar"),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "x",
                                                   "images": ["aGk="]}]}, "images"),
    ("/api/generate", {"model": "tiny", "prompt": "x", "options": {"mirostat": 1}},
     "options.mirostat"),
])
def test_compat_fields_k3_does_not_implement_are_refused(server, path, doc, field):  # noqa: F811
    """Catches a llama-server or Ollama field that would change the reply accepted and
    ignored: 400 naming it; control: their do-nothing values (mirostat 0, a resource
    option) are accepted."""
    status, _, body = _raw(server, "POST", path, doc)
    assert status == 400 and field in json.loads(body)["error"]["message"], body
    ok = {"/completion": {"prompt": "x", "mirostat": 0, "n_predict": 1},
          "/api/chat": {"model": "tiny", "stream": False, "options": {"num_predict": 1},
                        "messages": [{"role": "user", "content": "x"}]},
          "/api/generate": {"model": "tiny", "prompt": "x", "stream": False,
                            "options": {"num_thread": 2, "num_predict": 1}}}[path]
    assert _raw(server, "POST", path, ok)[0] == 200


def test_ollama_empty_prompt_or_messages_load_the_model(server):  # noqa: F811
    """Catches a client's load request (an empty prompt, no messages) generating from an
    empty turn: it is done at once with done_reason "load"; control: another model's
    name is still 404."""
    gen = json.loads(_ok(server, "POST", "/api/generate", {"model": "tiny:latest"})[1])
    assert gen["done"] is True and gen["done_reason"] == "load" and gen["response"] == ""
    chat = json.loads(_ok(server, "POST", "/api/chat", {"model": "tiny", "messages": []})[1])
    assert chat["done_reason"] == "load" and chat["message"]["content"] == ""
    assert _raw(server, "POST", "/api/generate", {"model": "llama3"})[0] == 404


@pytest.mark.parametrize("path,doc,status", [
    ("/api/generate", {"model": "tiny", "messages": []}, 400),
    ("/api/generate", {"model": "tiny", "prompt": 5}, 422),
    ("/api/generate", {"model": "tiny", "prompt": "a", "think": "yes"}, 422),
    ("/api/chat", {"model": "tiny", "messages": "hi"}, 422),
    ("/api/chat", {"model": "tiny", "messages": [], "options": "fast"}, 422),
    ("/completion", {"prompt": "a", "n_predict": "many"}, 422),
    ("/completion", b"not json", 400),
])
def test_compat_malformed_bodies_are_refused_not_run(server, path, doc, status):  # noqa: F811
    """Catches a malformed llama-server or Ollama body run anyway (a number as the prompt
    rendered into a turn, a think flag that is not a boolean handed to the template) or
    a 500: the documented 4xx; control: the well-formed request runs."""
    if isinstance(doc, bytes):
        req = urllib.request.Request(server["url"] + path, data=doc, method="POST",
                                     headers={"Authorization": f"Bearer {KEY}"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == status
    else:
        assert _raw(server, "POST", path, doc)[0] == status
    ok = {"/api/generate": {"model": "tiny", "prompt": "a", "think": False, "stream": False,
                            "options": {"num_predict": 1}},
          "/api/chat": {"model": "tiny", "stream": False, "options": {"num_predict": 1},
                        "messages": [{"role": "user", "content": "hi"}]},
          "/completion": {"prompt": "a", "n_predict": 1}}[path]
    assert _raw(server, "POST", path, ok)[0] == 200


def test_ollama_message_gives_tool_arguments_as_an_object():
    """Catches an Ollama reply whose tool call arguments are OpenAI's JSON text (Ollama's
    clients read an object) or whose reasoning is lost; control: arguments that are
    not JSON stay as given."""
    from libk3.serve.compat import ollama_message
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    got = ollama_message({"content": "x", "reasoning_content": "r", "tool_calls": [call]})
    assert got == {"role": "assistant", "content": "x", "thinking": "r",
                   "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}
    odd = dict(call, function={"name": "f", "arguments": "not json"})
    assert ollama_message({"tool_calls": [odd]})["tool_calls"][0]["function"]["arguments"] \
        == "not json"
