"""POST /v1/messages, Anthropic's Messages API over k3's chat path: a live server with the
tiny model driven by the official ``anthropic`` client (test extra) and raw HTTP, the
OpenAI endpoint of the same server as the oracle; skipped without the serve extra
(aiohttp) or the clients."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from libk3.text.tokenizer import K3Tokenizer  # noqa: E402
from libk3.serve import anthropic as shapes  # noqa: E402
from .test_serve import KEY, _post, _start, _stop  # noqa: E402

SYSTEM = "Be brief."
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
# system + user + assistant (thinking, text, tool_use) + user (tool_result, text)
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Look it up.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "call_1",
         "content": [{"type": "text", "text": "21 C"}]},
        {"type": "text", "text": "Thanks"}]}]
# the same conversation as the OpenAI endpoint takes it
OPENAI_CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {
         "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}]
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": TOOLS[0]["input_schema"]}}]
HELLO = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    srv = _start(tiny_dir, tmp_path_factory.mktemp("anthropic") / "stderr.log", "--gen", 8)
    yield srv
    _stop(srv)


def _client(server, key=KEY):
    return anthropic.Anthropic(base_url=server["url"], api_key=key, max_retries=0,
                               timeout=300)


def _raw(server, body: dict, key=KEY):
    """(status, headers, body bytes) of a raw POST /v1/messages with ``x-api-key``."""
    req = urllib.request.Request(server["url"] + "/v1/messages", data=json.dumps(body).encode(),
                                 method="POST", headers={"x-api-key": key,
                                                         "anthropic-version": "2023-06-01",
                                                         "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _openai(server, **body):
    status, out = _post(server, "/v1/chat/completions", json.dumps(
        {"model": "tiny", **body}).encode())
    assert status == 200, out
    return out


def _events(raw: bytes) -> list:
    """(event name, data) of each server-sent event."""
    out = []
    for chunk in raw.decode().split("\n\n"):
        if chunk.strip():
            lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_messages_render_the_conversation_as_the_chat_endpoint_does(server):
    """Catches a system prompt, tool, thinking, text, tool_use or tool_result block
    converted unlike its OpenAI equivalent (or dropped): the prompt ids must be the chat
    endpoint's for the same conversation."""
    m = _client(server).messages.create(model="tiny", max_tokens=1, system=SYSTEM,
                                        messages=CONVERSATION, tools=TOOLS)
    ids = m.model_extra["k3"]["prompt_ids"]
    chat = _openai(server, messages=OPENAI_CONVERSATION, tools=OPENAI_TOOLS, max_tokens=1)
    assert ids == chat["k3"]["prompt_ids"]
    assert m.usage.input_tokens == len(ids)
    # controls: the tools and the tool result's text reach the prompt
    without = _openai(server, messages=OPENAI_CONVERSATION, max_tokens=1)["k3"]["prompt_ids"]
    changed = json.loads(json.dumps(CONVERSATION))
    changed[2]["content"][0]["content"][0]["text"] = "22 C"
    other = _client(server).messages.create(model="tiny", max_tokens=1, system=SYSTEM,
                                            messages=changed, tools=TOOLS)
    assert without != ids and other.model_extra["k3"]["prompt_ids"] != ids
    count = _client(server).messages.count_tokens(model="tiny", system=SYSTEM,
                                                  messages=CONVERSATION, tools=TOOLS)
    assert count.input_tokens == len(ids)                  # what Claude Code asks first


def _blocks(message: dict) -> list:
    """The content blocks the chat endpoint's message maps to."""
    out = []
    if message.get("reasoning_content"):
        out.append({"type": "thinking", "thinking": message["reasoning_content"],
                    "signature": ""})
    if message.get("content"):
        out.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        out.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                    "input": shapes.tool_input(call["function"]["arguments"])})
    return out


def test_a_whole_reply_is_the_chat_endpoints_reply_in_blocks(server):
    """Catches a reply's text, reasoning or tool calls lost or misplaced in the blocks, a
    wrong stop_reason, or usage counting other tokens than were generated."""
    for max_tokens, messages, tools in ((6, HELLO, None), (8, CONVERSATION, TOOLS)):
        kw = {"tools": tools} if tools else {}
        m = _client(server).messages.create(model="tiny", max_tokens=max_tokens,
                                            system=SYSTEM, messages=messages, **kw)
        chat = _openai(server, max_tokens=max_tokens, tools=OPENAI_TOOLS if tools else None,
                       messages=[{"role": "system", "content": SYSTEM}] + HELLO
                       if messages is HELLO else OPENAI_CONVERSATION)
        choice = chat["choices"][0]
        assert m.model_extra["k3"]["generated_ids"] == chat["k3"]["generated_ids"]
        assert [b.to_dict() for b in m.content] == _blocks(choice["message"])
        assert m.content, "the control: the reply has some block"
        assert m.stop_reason == {"length": "max_tokens", "tool_calls": "tool_use",
                                 "stop": "end_turn"}[choice["finish_reason"]]
        assert m.stop_sequence is None and m.type == "message" and m.role == "assistant"
        assert m.id.startswith("msg_k3_") and m.model == "tiny"
        assert (m.usage.input_tokens, m.usage.output_tokens) == (
            chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"])


def test_a_streamed_reply_sends_anthropics_events_and_the_whole_reply(server):
    """Catches events out of Anthropic's order (message_start, ping, blocks each started,
    delta'd and stopped with its index, message_delta, message_stop), a data ``type``
    unlike its event, or streamed text that differs from the whole reply."""
    body = {"model": "tiny", "max_tokens": 8, "system": SYSTEM, "messages": HELLO}
    whole = _client(server).messages.create(**body)
    status, headers, raw = _raw(server, dict(body, stream=True))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = _events(raw)
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                     "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] == whole.usage.input_tokens
    index, open_ = -1, False
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert not open_ and data["index"] == index + 1
            index, open_ = data["index"], True
        elif name in ("content_block_delta", "content_block_stop"):
            assert open_ and data["index"] == index
            open_ = name == "content_block_delta"
        else:
            assert name == "ping", name
    assert not open_ and index >= 0
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert end["usage"]["output_tokens"] == whole.usage.output_tokens
    with _client(server).messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert [b.to_dict() for b in final.content] == [b.to_dict() for b in whole.content]
    assert text == "".join(b.text for b in whole.content if b.type == "text") != ""
    assert final.stop_reason == whole.stop_reason


def test_stream_blocks_follow_the_kind_of_each_delta():
    """Catches a thinking run, a text run or a tool call not each in a block of its own,
    a block left open, or a tool call's input not sent as JSON (Blocks, as the stream
    uses it, on deltas the tiny model does not write)."""
    blocks = shapes.Blocks()
    calls = [{"index": 0, "id": "c1", "type": "function",
              "function": {"name": "f", "arguments": "{\"a\": 1}"}},
             {"index": 1, "id": "c2", "type": "function",
              "function": {"name": "g", "arguments": "not json"}}]
    raw = b"".join(blocks.events(d) for d in (
        {"reasoning_content": "Hm"}, {"reasoning_content": "m."},
        {"reasoning_content": "!", "content": "Hi"}, {"content": " you"},
        {"tool_calls": calls}, {"content": "after"})) + blocks.close()
    got = [(n, d.get("index"), d.get("delta") or d.get("content_block")) for n, d in _events(raw)]
    starts = [(i, b["type"]) for n, i, b in got if n == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use"), (3, "tool_use"),
                      (4, "text")]
    assert [b for n, i, b in got if n == "content_block_delta" and i == 0] == [
        {"type": "thinking_delta", "thinking": t} for t in ("Hm", "m.", "!")]
    assert [b for n, i, b in got if n == "content_block_delta" and i == 1] == [
        {"type": "text_delta", "text": t} for t in ("Hi", " you")]
    assert [b for n, i, b in got if n == "content_block_delta" and i in (2, 3)] == [
        {"type": "input_json_delta", "partial_json": "{\"a\": 1}"},
        {"type": "input_json_delta",
         "partial_json": json.dumps({shapes.UNPARSED: "not json"})}]
    assert [i for n, i, _ in got if n == "content_block_stop"] == [0, 1, 2, 3, 4]
    assert [b for n, i, b in got if n == "content_block_start" and i == 2] == [
        {"type": "tool_use", "id": "c1", "name": "f", "input": {}}]


def _word_token(tiny_dir, ids):
    """The text of a generated token past the first few that is an ASCII word (a stop
    string that can only match in ordinary tokens)."""
    tok = K3Tokenizer.from_dir(tiny_dir)
    specials = set(tok.special_ids.values())
    for i in ids[2:]:
        text = tok.decode([i])
        if i not in specials and text.strip().isascii() and text.strip().isalpha():
            return text.strip()
    pytest.skip("the tiny model's reply has no word token to stop at")


def test_stop_sequences_and_max_tokens_give_their_stop_reason(server, tiny_dir):
    """Catches a stop string that ends the reply without stop_reason "stop_sequence", the
    wrong one of several named, text past the stop, or a reply cut by max_tokens without
    "max_tokens"."""
    c = _client(server)
    long = c.messages.create(model="tiny", max_tokens=30, system=SYSTEM, messages=HELLO)
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 30
    short = c.messages.create(model="tiny", max_tokens=2, system=SYSTEM, messages=HELLO)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    word = _word_token(tiny_dir, long.model_extra["k3"]["generated_ids"])
    stops = ["qqzzqq", word]
    m = c.messages.create(model="tiny", max_tokens=30, system=SYSTEM, messages=HELLO,
                          stop_sequences=stops)
    chat = _openai(server, max_tokens=30, stop=stops,
                   messages=[{"role": "system", "content": SYSTEM}] + HELLO)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert m.usage.output_tokens < 30
    assert "".join(b.text for b in m.content if b.type == "text") == \
        chat["choices"][0]["message"]["content"]
    with c.messages.stream(model="tiny", max_tokens=30, system=SYSTEM, messages=HELLO,
                           stop_sequences=stops) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", word)


def test_thinking_maps_to_the_templates_switch_as_reasoning_effort_does(server):
    """Catches ``thinking`` ignored (the same prompt either way), mapped the wrong way
    round, a budget_tokens below max_tokens refused (Anthropic's clients always send one
    below it), or one below 1 accepted."""
    def ids(**extra):
        m = _client(server).messages.create(model="tiny", max_tokens=1, messages=HELLO,
                                            **extra)
        return m.model_extra["k3"]["prompt_ids"]

    def effort(value):
        return _openai(server, messages=HELLO, max_tokens=1,
                       reasoning_effort=value)["k3"]["prompt_ids"]
    on = ids(thinking={"type": "enabled", "budget_tokens": 1})
    off = ids(thinking={"type": "disabled"})
    assert on != off
    assert on == effort("high") and off == effort("none")
    status, _, body = _raw(server, {"model": "tiny", "max_tokens": 8, "messages": HELLO,
                                    "thinking": {"type": "enabled", "budget_tokens": 4}})
    assert status == 200, body              # enforced (test_tool_choice), not refused
    status, _, body = _raw(server, {"model": "tiny", "max_tokens": 8, "messages": HELLO,
                                    "thinking": {"type": "enabled", "budget_tokens": 0}})
    err = json.loads(body)
    assert status == 422 and err["type"] == "error" and "budget_tokens" in \
        err["error"]["message"]


@pytest.mark.parametrize("change, named", [
    ({"max_tokens": None}, "max_tokens"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, "image"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}],
                    "name": "bob"}]}, "name"),
])
def test_refusals_are_4xx_in_anthropics_error_shape(server, change, named):
    """Catches a request k3 cannot honour answered anyway (or with a 5xx), or refused in
    OpenAI's error shape where Anthropic's clients read theirs."""
    body = {"model": "tiny", "max_tokens": 4, "messages": HELLO}
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    status, headers, raw = _raw(server, body)
    err = json.loads(raw)
    assert 400 <= status < 500, err
    assert set(err) == {"type", "error"} and err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error" and named in err["error"]["message"]
    assert headers["x-request-id"].startswith("req_")


def test_the_client_reads_refusals_and_a_wrong_key_is_401(server):
    """Catches the key in ``x-api-key`` (Anthropic's clients' header) refused or not
    checked, a 401 in OpenAI's shape on /v1/messages, or the OpenAI routes' error shape
    changed by the Messages API's."""
    with pytest.raises(anthropic.BadRequestError) as e:
        _client(server).messages.create(model="tiny", max_tokens=4, messages=HELLO,
                                        extra_body={"frobnicate": 1})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        _client(server, key="wrong").messages.create(model="tiny", max_tokens=4,
                                                     messages=HELLO)
    assert e.value.status_code == 401 and e.value.body == {
        "type": "error", "error": {"type": "authentication_error",
                                   "message": e.value.body["error"]["message"]}}
    status, _, raw = _raw(server, {"model": "tiny", "max_tokens": 4, "messages": HELLO}, "")
    assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"
    status, body = _post(server, "/v1/chat/completions", b"{}", key="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and "type" not in \
        {k for k in body if k != "error"}
    status, _, raw = _raw(server, {"model": "other", "max_tokens": 4, "messages": HELLO})
    assert status == 404 and json.loads(raw)["error"]["type"] == "not_found_error"


def test_stop_reason_rules():
    """Catches the precedence of tool_use over the length cut, or end_turn given for a
    turn end / a stop string's reason mixed up (the tiny model rarely writes either)."""
    class Result:
        def __init__(self, reason):
            self.stop_reason, self.generated_ids = reason, []
    assert shapes.stop_reason(Result("length"), True, None, ()) == ("tool_use", None)
    assert shapes.stop_reason(Result("length"), False, None, ()) == ("max_tokens", None)
    assert shapes.stop_reason(Result("stop_id"), False, None, ()) == ("end_turn", None)
    assert shapes.tool_input("{\"a\": [1]}") == {"a": [1]}
    assert shapes.tool_input("[1]") == {shapes.UNPARSED: "[1]"}
    assert shapes._arguments({shapes.UNPARSED: "[1"}) == "[1"


def test_tool_choice_is_enforced_as_on_the_chat_endpoint(server):
    """Catches Anthropic's tool_choice refused or ignored: "tool" names the one function
    every reply calls (with arguments its input_schema accepts), "any" calls one of the
    tools, "none" calls nothing; a name not among the tools is refused."""
    c = _client(server)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    short = [{**TOOLS[0], "input_schema": {      # a short call: the random model ends it
        "type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"enum": ["Paris", "Rome"]}}}}]
    for seed_choice in ({"type": "tool", "name": "get_weather",
                         "disable_parallel_tool_use": True}, {"type": "any"}):
        m = c.messages.create(model="tiny", max_tokens=120, messages=msgs, tools=short,
                              tool_choice=seed_choice, extra_body={"temperature": 1.0})
        calls = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and calls, m
        assert {b.name for b in calls} == {"get_weather"} and all(
            b.input in ({"city": "Paris"}, {"city": "Rome"}) for b in calls)
    m = c.messages.create(model="tiny", max_tokens=8, messages=msgs, tools=TOOLS,
                          tool_choice={"type": "none"})
    assert not [b for b in m.content if b.type == "tool_use"]
    status, _, raw = _raw(server, {"model": "tiny", "max_tokens": 4, "messages": msgs,
                                   "tools": TOOLS, "tool_choice": {"type": "tool", "name": "x"}})
    assert status == 422 and "tool_choice" in json.loads(raw)["error"]["message"]
