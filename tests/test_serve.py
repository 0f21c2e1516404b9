"""k3-run --serve: the OpenAI-compatible endpoint on loopback with the tiny model, driven
by the official ``openai`` client (test extra) and raw HTTP; skipped without the serve
extra (aiohttp) or the client."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from libk3.budget import ModelSizes, minimum_budget, peak_bytes  # noqa: E402
from libk3.text.chat_template import load_chat_template  # noqa: E402
from libk3.io.checkpoint import Checkpoint  # noqa: E402
from libk3.text.tokenizer import K3Tokenizer  # noqa: E402
from .scripts import k3, k3_here  # noqa: E402

KEY = "test-key-k3"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def _start(model, log, *args, mode_first: bool = False) -> dict:
    """A live server (with an API key) started with ``args``: its base URL, port, log
    and process, once it listens; ``mode_first``: as ``k3-run serve MODEL ADDRESS``."""
    where = ["serve", str(model), "127.0.0.1:0"] if mode_first else \
        [str(model), "--serve", "127.0.0.1:0"]
    with open(log, "w") as err:
        proc = subprocess.Popen(["k3-run", *where, "--api-key", KEY, *map(str, args)],
                                stderr=err, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    port = None
    while port is None and time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text())
        port = int(m.group(1)) if m else time.sleep(0.2)
    assert port is not None, log.read_text()
    return {"url": f"http://127.0.0.1:{port}", "port": port, "log": log, "proc": proc}


def _stop(server) -> None:
    server["proc"].send_signal(signal.SIGTERM)
    assert server["proc"].wait(timeout=120) == 0, server["log"].read_text()


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """A live server and its base URL; stopped by SIGTERM at the end."""
    srv = _start(tiny_dir, tmp_path_factory.mktemp("serve") / "stderr.log", "--gen", 3)
    yield srv
    _stop(srv)


def _client(server, key=KEY):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=key, max_retries=0,
                         timeout=300)


def _post(server, path, body: bytes, key=KEY):
    """(status, parsed JSON body) of a raw POST."""
    req = urllib.request.Request(server["url"] + path, data=body, method="POST",
                                 headers={"Authorization": f"Bearer {key}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _health(server):
    req = urllib.request.Request(server["url"] + "/health",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _rendered(tiny_dir, messages, **kw):
    return load_chat_template(tiny_dir).encode(K3Tokenizer.from_dir(tiny_dir), messages, **kw)


def test_serve_chat_matches_the_template_and_a_plain_run(server, tiny_dir):
    """Catches a server that renders the conversation differently from the template, or
    generates other tokens than k3-run does from the same ids and turn ends."""
    r = _client(server).chat.completions.create(model="tiny", messages=MSGS, max_tokens=3)
    k3x = r.model_extra["k3"]
    assert k3x["prompt_ids"] == _rendered(tiny_dir, MSGS)
    tok = K3Tokenizer.from_dir(tiny_dir)
    stops = [str(tok.id_of("[EOS]")), str(tok.id_of("<|end_of_msg|>"))]
    alone = k3_here(tiny_dir, "--ids", ",".join(map(str, k3x["prompt_ids"])), "--gen", 3,
                    "--json", "--stop-id", stops[0], "--stop-id", stops[1])
    assert json.loads(alone.stdout)["generated_ids"] == k3x["generated_ids"]
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(k3x["prompt_ids"])
    assert r.choices[0].finish_reason in ("length", "stop")


def test_serve_turn_two_resumes_turn_one_with_fresh_results(server, tiny_dir):
    """Catches turn 2 of a chat prefilled again from the start, or resumed from a state
    that gives other tokens than a fresh run on the whole conversation."""
    c = _client(server)
    turn1 = [{"role": "system", "content": "You answer questions about capitals. " * 8},
             {"role": "user", "content": "France?"}]
    r1 = c.chat.completions.create(model="tiny", messages=turn1, max_tokens=2)
    turn2 = turn1 + [r1.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "And Italy?"}]
    r2 = c.chat.completions.create(model="tiny", messages=turn2, max_tokens=3).model_extra["k3"]
    p1 = r1.model_extra["k3"]["prompt_ids"]
    assert r1.model_extra["k3"]["reused_tokens"] == 0 and r2["reused_tokens"] >= len(p1)
    assert r2["prompt_ids"][:len(p1)] == p1 and r2["prompt_ids"] == _rendered(tiny_dir, turn2)
    tok = K3Tokenizer.from_dir(tiny_dir)
    fresh = k3_here(tiny_dir, "--ids", ",".join(map(str, r2["prompt_ids"])), "--gen", 3, "--json",
                    "--stop-id", tok.id_of("[EOS]"), "--stop-id", tok.id_of("<|end_of_msg|>"))
    assert json.loads(fresh.stdout)["generated_ids"] == r2["generated_ids"]
    assert _health(server)["turn_reuse"]["hits"] >= 1


def test_serve_logs_each_request_before_answering_it(server):
    """Catches a response sent before its request's log line and /health figures are
    written (a client, or bench/turn_reuse.py, then read the previous request's line):
    right after each answer the log holds one more request line and /health counts it."""
    c = _client(server)
    for i in range(5):
        lines = server["log"].read_text().count("request: ")
        served = _health(server)["served"]
        c.chat.completions.create(model="tiny", max_tokens=1,
                                  messages=[{"role": "user", "content": f"count {i}"}])
        assert server["log"].read_text().count("request: ") == lines + 1
        assert _health(server)["served"] == served + 1


def test_serve_stream_sends_the_same_reply_as_whole(server):
    """Catches streamed deltas that lose, repeat or reorder text, or no finish chunk."""
    c = _client(server)
    whole = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3)
    chunks = list(c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and finishes.count(None) == len(finishes) - 1
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_serve_tool_call_round_trip_renders_tools_and_results(server, tiny_dir):
    """Catches tools, an assistant's tool calls or a tool result dropped on the way to
    the template (the prompt must be the template's rendering of all of them)."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object",
                                              "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = _client(server).chat.completions.create(model="tiny", messages=msgs, tools=tools,
                                                max_tokens=2,
                                                extra_body={"chat_template_kwargs":
                                                            {"thinking": False}})
    expected = _rendered(tiny_dir, msgs, tools=tools, template_kwargs={"thinking": False})
    assert r.model_extra["k3"]["prompt_ids"] == expected
    assert expected != _rendered(tiny_dir, msgs, template_kwargs={"thinking": False})  # control


def test_serve_completions_and_models(server):
    """Catches /v1/completions or /v1/models missing or shaped unlike the OpenAI API."""
    c = _client(server)
    r = c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2)
    assert r.model_extra["k3"]["prompt_ids"] == [5, 6, 7] and r.usage.completion_tokens == 2
    assert [m.id for m in c.models.list().data] == ["tiny"]


def test_serve_20_concurrent_requests_answer_as_alone_in_lockstep(server):
    """Catches requests that share state or interleave tokens, sampling that depends on
    the neighbours, or a server that still decodes one request at a time: 20 at once
    (greedy and seeded sampling), each gets the ids the same request gets alone, in
    fewer passes than the tokens they generate."""
    c = _client(server)
    convos = [[{"role": "user", "content": f"question {i}"}] for i in range(4)]
    sampling = [{}, {"temperature": 0.9, "seed": 7}, {"temperature": 1.3, "top_p": 0.8,
                                                      "seed": 2 ** 63}, {"seed": 5}]

    def ask(i):
        return c.chat.completions.create(model="tiny", messages=convos[i % 4], max_tokens=2,
                                         **sampling[i % 4]).model_extra["k3"]["generated_ids"]
    alone = [ask(i) for i in range(4)]
    before = _health(server)["engine"]
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        got = list(pool.map(ask, range(20)))
    after = _health(server)["engine"]
    assert got == [alone[i % 4] for i in range(20)]
    passes = after["passes"] - before["passes"]
    generated = after["generated_tokens"] - before["generated_tokens"]
    assert generated == sum(len(g) for g in got) and passes < generated, (passes, generated)
    assert after["max_in_flight"] > 1 and after["width"] >= after["max_in_flight"]


def _stream_until_tokens(server, body: dict, n: int) -> socket.socket:
    """A raw streamed request, read until ``n`` chunks arrived; the open socket."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server["port"]), timeout=60)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    got = s.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    while got.count(b"data:") < n:
        got += s.recv(4096)
    return s


def _wait_for(server, test, what: str):
    deadline = time.monotonic() + 120
    while not test(_health(server)):
        assert time.monotonic() < deadline, f"waited 120 s for {what}: {_health(server)}"
        time.sleep(0.05)


def test_serve_killed_client_cancels_its_generation(server):
    """Catches a generation that runs on after its client is gone, holding the engine."""
    before = _health(server)["cancelled"]
    s = _stream_until_tokens(server, {"model": "tiny", "messages": MSGS, "max_tokens": 100000,
                                      "stream": True}, 1)
    s.close()
    _wait_for(server, lambda h: h["cancelled"] > before, "the cancel")
    h = _health(server)
    assert h["cancelled"] == before + 1 and not h["busy"]
    r = _client(server).chat.completions.create(model="tiny", messages=MSGS, max_tokens=1)
    assert r.usage.completion_tokens == 1                                      # still serving


def test_serve_killed_client_mid_lockstep_leaves_the_others_unchanged(server):
    """Catches a cancelled lane that takes its neighbours down, shifts their states or
    tokens, or keeps its lane: three completions decoding in lockstep beside a stream
    whose client is killed give the ids they give alone."""
    c = _client(server)

    def ask(i):
        return c.completions.create(model="tiny", prompt=[5 + i, 6, 7], max_tokens=12,
                                    temperature=0.7 * i, seed=i).model_extra["k3"]["generated_ids"]
    alone = [ask(i) for i in range(3)]
    before = _health(server)
    s = _stream_until_tokens(server, {"model": "tiny", "messages": MSGS, "max_tokens": 100000,
                                      "stream": True}, 3)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(ask, i) for i in range(3)]
        _wait_for(server, lambda h: h["engine"]["in_flight"] >= 2, "a second lane")
        s.close()
        got = [f.result() for f in futs]
    _wait_for(server, lambda h: h["cancelled"] > before["cancelled"], "the cancel")
    h = _health(server)
    assert got == alone and [len(g) for g in got] == [12] * 3
    assert h["cancelled"] == before["cancelled"] + 1 and h["served"] == before["served"] + 3
    assert not h["busy"] and h["engine"]["in_flight"] == 0


MALFORMED = [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b"[1, 2]", 400),
    ("/v1/chat/completions", b"\xff\xfe", 400),
    ("/v1/chat/completions", b"", 400),
    ("/v1/chat/completions", b'{"messages": "hi"}', 422),
    ("/v1/chat/completions", b'{"messages": []}', 422),
    ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": 5}]}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "max_tokens": "9"}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "max_tokens": -1}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "max_tokens": 1.5}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "temperature": "hot"}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "temperature": -1}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "top_p": 0}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "top_p": true}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "seed": -5}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "seed": "x"}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "stop": 3}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "stop": ["a","b","c","d","e"]}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "stream": "yes"}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "n": 17}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "tools": {"a": 1}}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "tools": [1]}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "chat_template_kwargs": 1}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "model": 7}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "chat_template_kwargs": '
                             b'{"messages": 1}}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "stream_options": 1}', 422),
    ("/v1/chat/completions", b'{"messages": [[]]}', 422),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "max_tokens": 1e400}', 422),
    ("/v1/chat/completions", b'[' * 100000, 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "max_tokens": 99999999999}', 422),
    ("/v1/completions", b'{}', 422),
    ("/v1/completions", b'{"prompt": ""}', 422),
    ("/v1/completions", b'{"prompt": []}', 422),
    ("/v1/completions", b'{"prompt": [1, -2]}', 422),
    ("/v1/completions", b'{"prompt": [1, 99999999]}', 422),
    ("/v1/completions", b'{"prompt": [1, true]}', 422),
    ("/v1/completions", b'{"prompt": ["a", "b"]}', 422),
    ("/v1/completions", b'{"prompt": {"a": 1}}', 422),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": null, "top_p": 2}', 422),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e-300}', 422),
    ("/v1/completions", b'{"prompt": "x", "seed": 18446744073709551616}', 422),
    ("/v1/completions", b'{"prompt": "x", "stop": [""]}', 422),
    ("/v1/completions", b'nul\x00l', 400),
    ("/v1/nothing", b'{}', 404),
    ("/v1/models", b'{}', 405),
    ("/health", b'{}', 405),
]


def test_serve_50_malformed_requests_get_openai_errors_and_it_keeps_serving(server):
    """Catches a traceback, a 500, a dropped connection or a dead server on bad input:
    each malformed request gets its 4xx with an OpenAI error body."""
    big = b'{"prompt": "' + b"a" * (32 * 2 ** 20) + b'"}'
    over = json.dumps({"prompt": [1] * (2 ** 20 + 1), "max_tokens": 1}).encode()
    cases = MALFORMED + [("/v1/completions", big, 413), ("/v1/completions", over, 413)]
    assert len(cases) >= 50
    for path, body, status in cases:
        got, err = _post(server, path, body)
        assert got == status, (path, body[:80], err)
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    got, err = _post(server, "/v1/chat/completions", b'{"messages": [{"role": "user"}]}',
                     key="wrong")
    assert got == 401 and err["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").models.list()
    assert _health(server)["status"] == "ok"
    r = _client(server).chat.completions.create(model="tiny", messages=MSGS, max_tokens=1)
    assert r.usage.completion_tokens == 1                                      # control


def test_serve_refuses_a_public_address_without_api_key(tiny_dir):
    """Catches a server that would listen beyond loopback with nobody's key checked."""
    p = k3(tiny_dir, "--serve", "0.0.0.0:0")
    assert p.returncode == 2 and "--api-key" in p.stderr
    p = k3_here(tiny_dir, "--serve", "localhost:99999")
    assert p.returncode == 2 and "PORT 0..65535" in p.stderr
    p = k3_here(tiny_dir, "--ids", "1", "--api-key", "k")
    assert p.returncode == 2 and "--api-key goes with --serve" in p.stderr


def _vm_hwm(pid: int) -> int:
    """Peak RSS of a live process (VmHWM), bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_serve_floor_budget_answers_as_resident_within_its_memory(tiny_dir, tmp_path):
    """Catches --trunk-gb/--cache-gb ignored by --serve, or a budget that changes what
    concurrent requests get: a server at the floor budget answers with the ids a resident
    one gives, streams (trunk read every pass, experts through the cache), logs tokens,
    s/token and cache hits, and peaks within trunk + cache + fixed overhead + its width's
    sequence states."""
    with Checkpoint.open(tiny_dir) as ckpt:
        sizes = ModelSizes.from_checkpoint(ckpt)
    floor = minimum_budget(sizes)
    gb = lambda b: f"{b / 1e9:.9f}"  # noqa: E731
    width = 4
    budgets = {"resident": ("--resident",),
               "floor": ("--trunk-gb", gb(floor.trunk_bytes), "--cache-gb", gb(floor.cache_bytes),
                         "--reuse-gb", 0)}
    asks = [({"role": "user", "content": f"tell me about {w}"}, kw) for w, kw in [
        ("rivers", {}), ("bread", {"temperature": 0.8, "seed": 3}), ("tides", {"seed": 1}),
        ("owls", {"temperature": 1.1, "top_p": 0.9, "seed": 9}), ("salt", {"max_tokens": 2})]]
    warm = k3(tiny_dir, "--ids", "1", "--gen", 1, *budgets["floor"][:4])
    assert warm.returncode == 0, warm.stderr        # kernels compiled outside the measured peak
    got, figures = {}, {}
    for name, args in budgets.items():
        srv = _start(tiny_dir, tmp_path / f"{name}.log", "--batch-width", width, *args)
        try:
            c = _client(srv)
            with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
                got[name] = list(pool.map(lambda a: c.chat.completions.create(
                    model="tiny", messages=[a[0]], **{"max_tokens": 5, **a[1]})
                    .model_extra["k3"]["generated_ids"], asks))
            figures[name] = _health(srv)["engine"]
            figures[name]["hwm"] = _vm_hwm(srv["proc"].pid)
        finally:
            _stop(srv)
    assert got["floor"] == got["resident"] and all(got["floor"])
    fl = figures["floor"]
    assert fl["width"] == width and fl["max_in_flight"] > 1
    assert fl["trunk_bytes_read"] >= fl["passes"] * sizes.trunk_bytes
    assert fl["cache_hit_rate"] is not None and figures["resident"]["cache_hit_rate"] is None
    assert fl["seconds_per_token"] > 0
    log = (tmp_path / "floor.log").read_text()
    assert len(re.findall(r"request: .*\d+ tokens, [0-9.]+ s/token .*cache hit [0-9.]+%", log)) \
        == len(asks), log
    assert fl["hwm"] <= peak_bytes(floor, sizes, width=width), (fl["hwm"], width)


def test_serve_refuses_an_infeasible_budget_before_listening(tiny_dir):
    """Catches a server that listens (or dies with a traceback) when its budget cannot
    work: below the floor, a width whose states do not fit, or kept turns (--reuse-gb)
    that leave no room for the model; exit 4, one line."""
    for args in (("--trunk-gb", "0.000001", "--cache-gb", "0.000001"),
                 ("--trunk-gb", "0.01", "--cache-gb", "0.01", "--batch-width", 10 ** 6),
                 ("--reuse-gb", 10 ** 6)):
        p = k3(tiny_dir, "--serve", "127.0.0.1:0", *args, timeout=120)
        assert p.returncode == 4, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
        assert "serving" not in p.stderr
        assert ("--reuse-gb" in p.stderr) == ("--reuse-gb" in args)
    p = k3_here(tiny_dir, "--ids", "1", "--batch-width", 2)           # control: not a serve
    assert p.returncode == 2 and "--batch-width also with --serve" in p.stderr


def test_serve_with_a_draft_answers_as_without(server, tiny_dir, tmp_path):
    """Catches drafting that changes a served reply (greedy or sampled, requests decoding
    together in lockstep), or a server that cannot draft: the same requests to a server
    started with --draft give the ids the plain server gives, and it did verify."""
    def ask(srv, i):
        return _client(srv).completions.create(
            model="tiny", prompt=[5 + i, 6, 7, 5 + i, 6], max_tokens=10,
            temperature=0.7 * i, seed=i).model_extra["k3"]["generated_ids"]
    plain = [ask(server, i) for i in range(3)]
    drafted = _start(tiny_dir, tmp_path / "stderr.log", "--draft", tiny_dir / "draft",
                     "--batch-width", 2)
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda i: ask(drafted, i), range(3)))
        spec = _health(drafted)["engine"]["speculative"]
    finally:
        _stop(drafted)
    assert got == plain
    assert spec["verify_passes"] > 0 and _health(server)["engine"]["speculative"] is None


def test_serve_sampling_fields_mean_what_the_cli_options_mean(server, tiny_dir, tmp_path):
    """Catches top_k, min_p and the penalties accepted and ignored by the server (or read
    otherwise than k3-run reads them), and an empty stop string or an out-of-range value
    accepted: the request's ids equal k3-run's with the same options, and differ from
    the same request without them (control)."""
    from .scripts import k3_here

    fields = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 3.0,
              "presence_penalty": 1.5, "frequency_penalty": 0.5}
    base = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0.9,
            "seed": 11}
    status, body = _post(server, "/v1/completions", json.dumps({**base, **fields}).encode())
    assert status == 200, body
    got = body["k3"]["generated_ids"]
    rep = tmp_path / "r.json"
    p = k3_here(tiny_dir, "--resident", "--ids", "5,6,7", "--gen", 8, "--temperature", 0.9,
                "--seed", 11, "--top-k", 5, "--min-p", 0.05, "--repeat-penalty", 3.0,
                "--presence-penalty", 1.5, "--frequency-penalty", 0.5, "--report-json", rep)
    assert p.returncode == 0, p.stderr
    assert got == json.loads(rep.read_text())["generated_ids"]
    status, plain = _post(server, "/v1/completions", json.dumps(base).encode())
    assert status == 200 and plain["k3"]["generated_ids"] != got
    for bad in ({"top_k": 1.5}, {"min_p": 2}, {"presence_penalty": float("nan")},
                {"repetition_penalty": 0}, {"stop": ""}, {"stop": ["a", ""]}):
        status, err = _post(server, "/v1/completions", json.dumps({**base, **bad}).encode())
        assert status == 422 and err["error"]["param"] == next(iter(bad)), (bad, err)


def test_serve_logit_bias_bans_and_forces_tokens_and_is_checked(server, tiny_dir, tmp_path):
    """Catches logit_bias accepted and ignored (or read otherwise than k3-run's
    --logit-bias), on chat or on completions, logprobs taken from the biased logits
    instead of the model's, and a bad value accepted: -100 on the token the server picks
    greedily changes the reply and that id never comes back; the completion equals
    k3-run's with the same flag; +100 forces its token, whose logprob stays the model's
    (far below 0); out-of-range biases, keys that are not ids, ids outside the
    vocabulary and over 300 entries are 422 naming logit_bias."""
    from .scripts import k3_here

    base = {"model": "tiny", "prompt": [5, 17, 300, 42], "max_tokens": 4}
    status, plain = _post(server, "/v1/completions", json.dumps(base).encode())
    assert status == 200, plain
    first = plain["k3"]["generated_ids"][0]
    status, banned = _post(server, "/v1/completions", json.dumps(
        {**base, "logit_bias": {str(first): -100}}).encode())
    assert status == 200, banned
    got = banned["k3"]["generated_ids"]
    assert got != plain["k3"]["generated_ids"] and first not in got
    rep = tmp_path / "r.json"
    p = k3_here(tiny_dir, "--resident", "--ids", "5,17,300,42", "--gen", 4,
                "--logit-bias", f"{first}=-100", "--report-json", rep)
    assert p.returncode == 0, p.stderr
    assert got == json.loads(rep.read_text())["generated_ids"]
    status, forced = _post(server, "/v1/completions", json.dumps(
        {**base, "logit_bias": {"300": 100}, "logprobs": 0}).encode())
    assert status == 200 and forced["k3"]["generated_ids"] == [300] * 4, forced
    assert max(forced["choices"][0]["logprobs"]["token_logprobs"]) < -0.5
    chat = {"model": "tiny", "messages": MSGS, "max_tokens": 3}
    status, reply = _post(server, "/v1/chat/completions", json.dumps(chat).encode())
    assert status == 200, reply
    said = reply["k3"]["generated_ids"][0]
    status, other = _post(server, "/v1/chat/completions", json.dumps(
        {**chat, "logit_bias": {str(said): -100.0}}).encode())
    assert status == 200 and said not in other["k3"]["generated_ids"], other
    for bad in ({"5": 101}, {"5": -100.5}, {"5": float("nan")}, {"5": "1"}, {"5": True},
                {"x": 1}, {"-5": 1}, {"5.0": 1}, {"512": 1}, {"99999999999999999999999": 1},
                {str(i): 1 for i in range(301)}, [[5, 1]], "5=1"):
        for path, body in (("/v1/completions", base), ("/v1/chat/completions", chat)):
            status, err = _post(server, path, json.dumps({**body, "logit_bias": bad}).encode())
            assert status == 422 and err["error"]["param"] == "logit_bias", (bad, err)
    status, ok = _post(server, "/v1/completions", json.dumps(
        {**base, "logit_bias": {str(i): 0 for i in range(300)}}).encode())
    assert status == 200 and ok["k3"]["generated_ids"] == plain["k3"]["generated_ids"]


def test_serve_refuses_fields_it_would_ignore_and_models_it_does_not_serve(server):
    """Catches a request answered with 200 while a field it sent is silently ignored
    (tool_choice "required" on a completion, which has no tools; best_of, ...) or a
    message's image, audio or other non-text part is dropped by the template, a model
    name that is not the served one accepted and echoed, and /v1/models/{id} missing;
    controls: the do-nothing values of those fields and bookkeeping fields pass."""
    base = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1}
    for bad in ({"tool_choice": "required"}, {"best_of": 2}, {"suffix": "x"}, {"frobnicate": 1}):
        status, err = _post(server, "/v1/completions", json.dumps({**base, **bad}).encode())
        assert status == 400 and err["error"]["param"] == next(iter(bad)), (bad, err)
        assert err["error"]["code"] == "unsupported_field"
    for fine in ({"logprobs": False}, {"tool_choice": "auto"}, {"logit_bias": {}},
                 {"user": "me", "metadata": {"a": "b"}}, {"response_format": {"type": "text"}},
                 {"echo": None}):
        status, body = _post(server, "/v1/completions", json.dumps({**base, **fine}).encode())
        assert status == 200, (fine, body)
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"}]}],
            "max_tokens": 1}
    for part in ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                 {"type": "image"}, {"type": "input_audio"}, {"type": "text"}, "text"):
        bad = {**chat, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"}, part]}]}
        status, err = _post(server, "/v1/chat/completions", json.dumps(bad).encode())
        # an image part is read, and these bytes are no image (tests/test_image_serve.py)
        code = "invalid_image" if isinstance(part, dict) and part["type"] == "image_url" \
            else "unsupported_content"
        assert status == 400 and err["error"]["code"] == code, (part, err)
        assert '"content"][1]' in err["error"]["message"]
    status, body = _post(server, "/v1/chat/completions", json.dumps(chat).encode())
    assert status == 200, body                             # a text part is read
    status, err = _post(server, "/v1/completions", json.dumps({**base, "model": "tinny"}).encode())
    assert status == 404 and err["error"]["code"] == "model_not_found"
    c = _client(server)
    assert c.models.retrieve("tiny").id == "tiny"
    import openai
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("other")


def test_serve_refuses_a_misspelt_field_in_the_words_a_batch_line_is_skipped_with(server):
    """Catches the server and batch lines wording one unknown field differently (or the
    server running the request without it): each route answers 400 with the sentence
    ``parse_line`` skips the line with, in its API's error shape."""
    from libk3.run.batch import BatchLineError, parse_line
    with pytest.raises(BatchLineError) as skipped:
        parse_line(b'{"id": 1, "prompt": "x", "temprature": 0.9}', 512)
    said = str(skipped.value)
    assert said.startswith('unknown field "temprature" (did you mean "temperature"?)')
    msgs = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/chat/completions", {"messages": msgs}),
                       ("/v1/completions", {"prompt": "x"}),
                       ("/v1/messages", {"messages": msgs, "max_tokens": 1})):
        status, err = _post(server, path, json.dumps({**body, "temprature": 0.9}).encode())
        assert status == 400 and err["error"]["message"] == said, (path, err)
        assert err.get("type") == "error" if path == "/v1/messages" else \
            err["error"]["param"] == "temprature", (path, err)


def test_serve_preamble_survives_a_restart_through_the_prefix_cache(tiny_dir, tmp_path):
    """Catches a server whose kept states die with it: after a restart on the same
    --prefix-cache, a new conversation with the same long system prompt resumes from the
    snapshot of that preamble (on disk) and answers as a fresh run of its ids does; the
    first request asks for two choices (whose shared prefill must keep the preamble too)."""
    system = {"role": "system", "content": "You are the log keeper of a slow ship. " * 6}
    cache = tmp_path / "cache"
    first = _start(tiny_dir, tmp_path / "a.log", "--prefix-cache", cache, "--prefill-chunk", 8)
    try:
        r1 = _client(first).chat.completions.create(
            model="tiny", max_tokens=2, n=2, messages=[system, {"role": "user", "content": "Hi"}])
        assert r1.model_extra["k3"]["reused_tokens"] == 0 and len(r1.choices) == 2
    finally:
        _stop(first)
    assert [p.suffix for p in cache.iterdir()] == [".k3state"]
    second = _start(tiny_dir, tmp_path / "b.log", "--prefix-cache", cache, "--prefill-chunk", 8)
    try:
        msgs = [system, {"role": "user", "content": "Where are we?"}]
        r2 = _client(second).chat.completions.create(model="tiny", max_tokens=3,
                                                     messages=msgs).model_extra["k3"]
        reuse = _health(second)["turn_reuse"]
    finally:
        _stop(second)
    preamble = load_chat_template(tiny_dir).encode(K3Tokenizer.from_dir(tiny_dir), [system],
                                                   add_generation_prompt=False)
    assert r2["reused_tokens"] == len(preamble) and reuse["disk_hits"] == 1
    assert r2["prompt_ids"] == _rendered(tiny_dir, msgs)
    tok = K3Tokenizer.from_dir(tiny_dir)
    fresh = k3_here(tiny_dir, "--ids", ",".join(map(str, r2["prompt_ids"])), "--gen", 3, "--json",
                    "--stop-id", tok.id_of("[EOS]"), "--stop-id", tok.id_of("<|end_of_msg|>"))
    assert json.loads(fresh.stdout)["generated_ids"] == r2["generated_ids"]


def _short_context_copy(tiny_dir, d, positions: int):
    """The tiny model with max_position_embeddings set (its other files linked)."""
    d.mkdir()
    for f in tiny_dir.iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f)
    doc = json.loads((tiny_dir / "config.json").read_text())
    doc["text_config"]["max_position_embeddings"] = positions
    (d / "config.json").write_text(json.dumps(doc))
    return d


def test_serve_max_tokens_left_out_runs_to_the_end_unless_gen_given(tiny_dir, tmp_path):
    """Catches a request without max_tokens cut at 16 tokens (the CLI's --gen default)
    where clients expect generation until the turn ends or the context is full; and a
    --gen given on the command line not taken as that default."""
    model = _short_context_copy(tiny_dir, tmp_path / "m", 48)
    msgs = [{"role": "user", "content": "Hi"}]
    srv = _start(model, tmp_path / "a.log", "--temperature", 0)
    try:
        r = _client(srv).chat.completions.create(model="m", messages=msgs)
        n = len(r.model_extra["k3"]["prompt_ids"]) + r.usage.completion_tokens
        assert r.usage.completion_tokens > 16
        assert n == 48 or r.choices[0].finish_reason == "stop"
    finally:
        _stop(srv)
    capped = _start(model, tmp_path / "b.log", "--gen", 5)
    try:
        r = _client(capped).chat.completions.create(model="m", messages=msgs)
        assert r.usage.completion_tokens <= 5
    finally:
        _stop(capped)


def _rows(tiny_dir, tmp_path, ids):
    """log-softmax (float64, computed here) of every logits row of a plain k3-run fed
    ``ids`` (the prompt and the reply): row i predicts token i + 1."""
    import numpy as np
    out = tmp_path / "logits.npy"
    run = k3_here(tiny_dir, "--ids", ",".join(map(str, ids)), "--gen", 1, "--json",
                  "--logits-out", out)
    assert run.returncode == 0, run.stderr
    x = np.load(out).astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def test_serve_chat_logprobs_are_the_logits_rows_of_the_same_run(server, tiny_dir, tmp_path):
    """Catches logprobs taken from the wrong row (off by one position), after the
    sampler's temperature or penalties, top alternatives out of order, and a streamed
    reply whose logprobs differ from the whole one's."""
    import numpy as np
    c = _client(server)
    args = dict(model="tiny", messages=MSGS, max_tokens=3, logprobs=True, top_logprobs=4,
                temperature=0.9, seed=5, presence_penalty=1.0)
    r = c.chat.completions.create(**args)
    k3x = r.model_extra["k3"]
    lp = _rows(tiny_dir, tmp_path, k3x["prompt_ids"] + k3x["generated_ids"])
    content = r.choices[0].logprobs.content
    assert len(content) == len(k3x["generated_ids"]) >= 1
    tok = K3Tokenizer.from_dir(tiny_dir)
    p = len(k3x["prompt_ids"])
    for j, (entry, t) in enumerate(zip(content, k3x["generated_ids"])):
        row = lp[p - 1 + j]
        assert abs(entry.logprob - row[t]) < 1e-9
        assert bytes(entry.bytes) == tok.token_bytes(t)
        best = np.argsort(-row, kind="stable")[:4]
        assert [abs(a.logprob - row[b]) < 1e-9 for a, b in zip(entry.top_logprobs, best)] == \
            [True] * 4
        assert [a.bytes for a in entry.top_logprobs] == [list(tok.token_bytes(b)) for b in best]
    streamed = []
    for ch in c.chat.completions.create(**args, stream=True):
        if ch.choices and ch.choices[0].logprobs:
            streamed += ch.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1)
    assert plain.choices[0].logprobs is None                                     # control


def test_serve_completion_echo_and_prompt_logprobs(server, tiny_dir, tmp_path):
    """Catches echo that leaves the prompt out, prompt logprobs shifted by a position or
    taken from a resumed state (a kept prompt is not fed again), a first prompt token
    given a logprob, and streamed echo differing from whole."""
    ids = [5, 17, 300, 42, 7, 99, 128]
    base = {"model": "tiny", "prompt": ids, "max_tokens": 2}
    _post(server, "/v1/completions", json.dumps(base).encode())     # kept: a reuse bait
    status, body = _post(server, "/v1/completions",
                         json.dumps({**base, "echo": True, "logprobs": 2}).encode())
    assert status == 200, body
    got = body["choices"][0]["logprobs"]
    gen = body["k3"]["generated_ids"]
    lp = _rows(tiny_dir, tmp_path, ids + gen)
    tok = K3Tokenizer.from_dir(tiny_dir)
    assert body["k3"]["reused_tokens"] == 0
    assert body["choices"][0]["text"].startswith(tok.decode(ids))
    assert len(got["tokens"]) == len(ids) + len(gen)
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    for i, t in enumerate(ids[1:] + gen, start=1):
        assert abs(got["token_logprobs"][i] - lp[i - 1][t]) < 1e-9, i
        assert len(got["top_logprobs"][i]) <= 2
    assert got["text_offset"][0] == 0 and got["text_offset"] == sorted(got["text_offset"])
    c = _client(server)
    parts = list(c.completions.create(**{**base, "echo": True, "logprobs": 2}, stream=True))
    text = "".join(p.choices[0].text for p in parts if p.choices)
    lps = [x for p in parts if p.choices and p.choices[0].logprobs
           for x in p.choices[0].logprobs.token_logprobs]
    assert text == body["choices"][0]["text"] and lps == got["token_logprobs"]
    status, echo_only = _post(server, "/v1/completions", json.dumps({**base, "echo": True}).encode())
    assert echo_only["choices"][0]["text"] == body["choices"][0]["text"]
    assert echo_only["choices"][0]["logprobs"] is None


def test_serve_logprobs_fields_are_checked(server):
    """Catches out-of-range or contradictory logprobs fields accepted."""
    chat = {"model": "tiny", "messages": MSGS, "max_tokens": 1}
    for bad, param in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                       ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 1}, "logprobs")):
        status, err = _post(server, "/v1/chat/completions", json.dumps({**chat, **bad}).encode())
        assert status == 422 and err["error"]["param"] == param, (bad, err)
    comp = {"model": "tiny", "prompt": [5, 6], "max_tokens": 1}
    for bad in ({"logprobs": 6}, {"logprobs": True}, {"echo": "yes"}):
        status, err = _post(server, "/v1/completions", json.dumps({**comp, **bad}).encode())
        assert status == 422 and err["error"]["param"] == next(iter(bad)), (bad, err)


def test_serve_tokenize_and_detokenize(server, tiny_dir):
    """Catches /tokenize giving other ids than a chat request renders and feeds (or than
    the tokenizer gives a text), /detokenize not inverting it, and unknown fields, bad
    ids or another model's name accepted."""
    c = _client(server)
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1)
    status, got = _post(server, "/tokenize", json.dumps({"messages": MSGS}).encode())
    assert status == 200 and got["tokens"] == r.model_extra["k3"]["prompt_ids"]
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] > 0
    status, head = _post(server, "/tokenize", json.dumps(
        {"messages": MSGS, "add_generation_prompt": False}).encode())
    assert status == 200 and got["tokens"][:len(head["tokens"])] == head["tokens"]
    assert len(head["tokens"]) < len(got["tokens"])
    tok = K3Tokenizer.from_dir(tiny_dir)
    text = "Hello, wörld: tokens & bytes"
    status, plain = _post(server, "/tokenize", json.dumps({"prompt": text}).encode())
    assert status == 200 and plain["tokens"] == tok.encode(text)
    status, back = _post(server, "/detokenize", json.dumps({"tokens": plain["tokens"]}).encode())
    assert status == 200 and back["prompt"] == text
    for path, body, code, param in (
            ("/tokenize", {"prompt": "x", "frob": 1}, 400, "frob"),
            ("/tokenize", {"prompt": 5}, 422, "prompt"),
            ("/detokenize", {"tokens": [1, 10 ** 9]}, 422, "tokens"),
            ("/detokenize", {"tokens": "1,2"}, 422, "tokens"),
            ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model")):
        status, err = _post(server, path, json.dumps(body).encode())
        assert status == code and err["error"]["param"] == param, (path, body, err)


def test_serve_metrics_in_prometheus_format_agree_with_health(server):
    """Catches /metrics missing, not parseable as Prometheus' text format, or counting
    differently from /health (two bookkeepings drifting apart)."""
    from prometheus_client.parser import text_string_to_metric_families
    _client(server).chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)
    req = urllib.request.Request(server["url"] + "/metrics",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    health = _health(server)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("k3_requests_total", (("outcome", "served"),))] == health["served"] >= 1
    assert samples[("k3_generated_tokens_total", ())] == health["generated_tokens"]
    assert samples[("k3_passes_total", ())] == health["engine"]["passes"]
    assert samples[("k3_queue_depth", ())] == health["queued"]
    assert samples[("k3_prompt_tokens_total", ())] >= 1
    assert samples[("k3_prefill_seconds_total", ())] > 0
    assert ("k3_lanes_in_flight", ()) in samples and ("k3_trunk_read_bytes_total", ()) in samples
    bare = urllib.request.Request(server["url"] + "/metrics")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bare, timeout=60)
    assert e.value.code == 401


def test_serve_n_choices_share_one_prefill_each_with_its_seed(server):
    """Catches n > 1 refused or answered with copies of one choice, choices that each
    prefill the prompt again, choice i not drawn with seed + i (so not reproducible one
    by one), and streamed choices that differ from the whole ones."""
    c = _client(server)
    msgs = [{"role": "user", "content": "Tell me a long story about ships. " * 3}]
    args = dict(model="tiny", messages=msgs, max_tokens=3, temperature=1.0)
    before = _health(server)["engine"]["prompt_tokens"]
    r = c.chat.completions.create(**args, n=3, seed=40)
    fed = _health(server)["engine"]["prompt_tokens"] - before
    k3x = r.model_extra["k3"]
    p = len(k3x["prompt_ids"])
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert fed <= p + 2 + 2 * 3           # one prefill; each other choice feeds the last id
    ids = [ch["generated_ids"] for ch in k3x["choices"]]
    assert ids[0] == k3x["generated_ids"] and len({tuple(x) for x in ids}) > 1
    assert r.usage.completion_tokens == sum(len(x) for x in ids)
    for i in range(3):
        one = c.chat.completions.create(**args, seed=40 + i).model_extra["k3"]["generated_ids"]
        assert one == ids[i], i
    texts = {0: "", 1: "", 2: ""}
    for ch in c.chat.completions.create(**args, n=3, seed=40, stream=True):
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[i] for i in range(3)] == [ch.message.content for ch in r.choices]
    for bad in ({"n": 0}, {"n": 17}, {"n": "2"}):
        status, err = _post(server, "/v1/chat/completions", json.dumps(
            {"model": "tiny", "messages": msgs, "max_tokens": 1, **bad}).encode())
        assert status == 422 and err["error"]["param"] == "n", (bad, err)
    status, err = _post(server, "/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": msgs, "max_tokens": 1, "best_of": 2}).encode())
    assert status == 400 and err["error"]["param"] == "best_of"


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "size": {"type": "integer", "minimum": 0, "maximum": 999},
                         "kind": {"enum": ["ship", "boat"]}}}


SHORT_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


def test_serve_response_format_is_enforced_streamed_or_not(server):
    """Catches response_format accepted but not enforced (the random tiny model writes
    no JSON on its own), a schema not validated, streamed replies that differ, and a bad
    format not refused."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    c = _client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                  "strict": True}}
    ended = 0
    for seed in range(5):
        args = dict(model="tiny", messages=MSGS, max_tokens=60, temperature=1.0, seed=seed,
                    response_format=fmt)
        r = c.chat.completions.create(**args)
        if r.choices[0].finish_reason != "stop":
            continue
        ended += 1
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in
                           c.chat.completions.create(**args, stream=True) if ch.choices)
        assert streamed == r.choices[0].message.content
    assert ended >= 3
    done = 0                  # a completion's text holds no end token: it parses whole
    for seed in range(4):
        r = c.completions.create(model="tiny", prompt="x", max_tokens=60, temperature=1.0,
                                 seed=seed, extra_body={"response_format": SHORT_FORMAT})
        if r.choices[0].finish_reason == "stop":
            done += 1
            jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
            streamed = "".join(p.choices[0].text for p in c.completions.create(
                model="tiny", prompt="x", max_tokens=60, temperature=1.0, seed=seed,
                stream=True, extra_body={"response_format": SHORT_FORMAT}) if p.choices)
            assert streamed == r.choices[0].text
    assert done >= 2
    plain = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8)
    with pytest.raises(ValueError):                                          # control
        json.loads(plain.choices[0].message.content or "x")
    for bad in ({"type": "json_schema"}, {"type": "xml"}, "json"):
        status, err = _post(server, "/v1/chat/completions", json.dumps(
            {"model": "tiny", "messages": MSGS, "max_tokens": 1, "response_format": bad}).encode())
        assert status == 422 and err["error"]["param"] == "response_format", (bad, err)


def test_serve_reasoning_effort_maps_to_the_templates_thinking_switch(server, tiny_dir, tmp_path):
    """Catches reasoning_effort ignored (the prompt is the same as without it), mapped
    the wrong way round, overriding a keyword the request sets itself, accepted with a
    value OpenAI does not define, or accepted for a template with no switch at all."""
    from libk3.text.chat_request import ChatEncoder
    from libk3.text.chat_template import ChatInputError

    def ids(**extra):
        status, body = _post(server, "/v1/chat/completions", json.dumps(
            {"model": "tiny", "messages": MSGS, "max_tokens": 1, **extra}).encode())
        assert status == 200, body
        return body["k3"]["prompt_ids"]
    off = ids(chat_template_kwargs={"thinking": False})
    on = ids(chat_template_kwargs={"thinking": True})
    assert off != on                                                         # control
    assert ids(reasoning_effort="none") == off
    assert ids(reasoning_effort="high") == ids(reasoning_effort="low") == on
    assert ids(reasoning_effort="none", chat_template_kwargs={"thinking": True}) == on
    status, err = _post(server, "/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": MSGS, "reasoning_effort": "max"}).encode())
    assert status == 422 and err["error"]["param"] == "reasoning_effort"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}))
    enc = ChatEncoder(plain, K3Tokenizer.from_dir(tiny_dir))
    with pytest.raises(ChatInputError, match="no reasoning switch"):
        enc.reasoning_kwargs("high")


def test_batch_line_gives_the_servers_choices_and_logprobs(server, tiny_dir, tmp_path):
    """Catches a batch line with "n" and "logprobs" answered otherwise than the server
    answers the same request (other choices, seeds or log-probabilities, another shape):
    the same conversation and settings through /v1/chat/completions and a batch file."""
    msgs = [{"role": "user", "content": "Tell me about ships."}]
    ask = dict(n=3, temperature=1.0, seed=40, logprobs=True, top_logprobs=2)
    status, r = _post(server, "/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": msgs, "max_tokens": 4, **ask}).encode())
    assert status == 200, r
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"id": 1, "messages": msgs, "gen": 4, **ask}) + "\n")
    out = tmp_path / "r.jsonl"
    p = subprocess.run(["k3-run", str(tiny_dir), "--batch", str(batch), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    line = json.loads(out.read_text())
    assert [c["generated_ids"] for c in line["choices"]] == \
        [c["generated_ids"] for c in r["k3"]["choices"]]
    assert [c["logprobs"] for c in line["choices"]] == \
        [c["logprobs"] for c in r["choices"]]
    assert [c["message"]["content"] for c in line["choices"]] == \
        [c["message"]["content"] for c in r["choices"]]
