"""Hostile input to k3-run --serve: text k3 cannot encode, the HTTP library's own limits,
and an exception no route expected. Each must be a documented status with an OpenAI
error body and an ``x-request-id``, no traceback in the log, the request decoding beside
it untouched, and the server healthy afterwards (docs/serve.md "Errors"; tests/hostile.py
has the categories).

One live server (the tiny model, an API key) for what goes through aiohttp's parser and
the engine; the error middleware's catch-all in-process, on a route that raises and an
engine that fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("openai")

from libk3.config import load_config  # noqa: E402
from libk3.run.runner import settings_from  # noqa: E402

from .hostile import fail  # noqa: E402
from .test_serve import KEY, _health, _post, _start, _stop  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    srv = _start(tiny_dir, tmp_path_factory.mktemp("hostile_serve") / "stderr.log", "--gen", 3)
    yield srv
    _stop(srv)


def _exchange(server, head: bytes, body: bytes = b"", timeout: float = 120) -> tuple:
    """(status, headers {lower-case name: value}, body bytes) of one raw request: ``head``
    is its request line and headers (Host and Connection: close added), ``body`` sent
    after them with its Content-Length. A server that answers before reading all of a
    large body may close the socket while it is still being sent: the answer is read as
    it arrives, beside the sending, so the reset that follows cannot drop it."""
    s = socket.create_connection(("127.0.0.1", server["port"]), timeout=timeout)
    got = []

    def receive():              # as the answer comes: a server that closes on bytes it
        try:                    # did not read resets the connection, losing what is unread
            while chunk := s.recv(65536):
                got.append(chunk)
        except ConnectionResetError:
            pass
    reader = threading.Thread(target=receive)
    reader.start()
    try:
        try:
            s.sendall(head + b"\r\nHost: x\r\nConnection: close\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode())
            view = memoryview(body)
            for i in range(0, len(body), 1 << 20):
                s.sendall(view[i:i + (1 << 20)])
        except OSError:                   # refused mid-request: the answer is already read
            pass
        reader.join(timeout)
    finally:
        s.close()
    got = b"".join(got)
    head_text, _, rest = got.partition(b"\r\n\r\n")
    lines = head_text.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in
                   (line.partition(":") for line in lines[1:]))
    return int(lines[0].split()[1]), headers, rest


def _openai_error(status, headers, body, want: int, code=None) -> dict:
    """The error object of an answer that must be ``want`` with an OpenAI error body and a
    request id."""
    if status != want:
        fail("wrong-exit", f"HTTP {status}, documented {want}: {body[:200]!r}")
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        fail("message", f"HTTP {status} without an OpenAI error body: {body[:200]!r}")
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert code is None or err["code"] == code, err
    assert headers.get("x-request-id", "").startswith("req_"), headers
    return err


def _post_raw(server, path: str, body: bytes, key: bytes = KEY.encode()) -> tuple:
    return _exchange(server, b"POST " + path.encode() + b" HTTP/1.1\r\nAuthorization: Bearer "
                     + key + b"\r\nContent-Type: application/json", body)


def _no_traceback(server) -> None:
    log = server["log"].read_text()
    if "Traceback" in log:
        fail("traceback", log[-600:])


SURROGATES = [   # (path, body, the field the error names)
    ("/v1/completions", b'{"prompt": [5, 6], "stop": "\\ud800"}', "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                             b'"stop": ["ok", "\\udfff"]}', "stop"),
    ("/v1/completions", b'{"prompt": [5, 6], "model": "k3\\ud800"}', "model"),
    ("/v1/completions", b'{"prompt": "hi \\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["\\udc80"]}', "prompt"),
    ("/v1/completions", b'{"prompt": "raw \xed\xa0\x80 bytes"}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
     "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", '
                             b'"text": "\\ude00"}]}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user\\ud800"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": '
                             b'[{"type": "function", "function": {"name": "f\\ud800"}}]}',
     "tools"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                             b'"chat_template_kwargs": {"x\\ud800": true}}',
     "chat_template_kwargs"),
    ("/v1/completions", b'{"prompt": [5], "user\\ud800": 1}', "user\ud800"),
]


def test_serve_lone_surrogates_are_400_naming_the_field_and_spare_the_neighbours(server):
    """Catches text UTF-8 cannot encode let in (a stop string of "\\ud800" failed the
    lockstep pass: a 500 with a traceback for it and for the request decoding beside
    it; a model name broke the streamed reply): each is a 400 naming the field, and a
    completion decoding meanwhile gets the ids it gets alone."""
    neighbour = json.dumps({"prompt": [5, 6, 7], "max_tokens": 200}).encode()
    status, alone = _post(server, "/v1/completions", neighbour)
    assert status == 200, alone
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(_post, server, "/v1/completions", neighbour)
        while not _health(server)["busy"] and not beside.done():
            pass
        for path, body, field in SURROGATES:
            err = _openai_error(*_post_raw(server, path, body), 400, "invalid_text")
            assert err["param"] == field and "lone surrogate" in err["message"], (body, err)
        overlapped = not beside.done()
        status, got = beside.result()
    assert status == 200 and overlapped, got
    assert got["k3"]["generated_ids"] == alone["k3"]["generated_ids"]
    pair = b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}'     # control: a pair is text
    assert _post_raw(server, "/v1/completions", pair)[0] == 200
    assert _health(server)["status"] == "ok"
    _no_traceback(server)


@pytest.mark.parametrize("key", [b"\xed\xa0\x80", b"\xff\xfe", KEY.encode() + b"\xff",
                                 b"\xc3(" + KEY.encode()])
def test_serve_authorization_that_is_not_text_is_401(server, key):
    """Catches an Authorization header of bytes that are not UTF-8 failing the key check
    with a 500 and a traceback (aiohttp hands such bytes over as lone surrogates)."""
    head = b"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer " + key
    _openai_error(*_exchange(server, head), 401, "invalid_api_key")
    ok = b"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer " + KEY.encode()
    assert _exchange(server, ok)[0] == 200                                       # control
    _no_traceback(server)


def test_serve_http_limits_are_openai_errors_and_the_parsers_own_is_one_log_line(server):
    """Catches the HTTP library's limits answered as plain text with a traceback in the
    log: a 100 KB header is 431, a 100 KB request target 414, a 100 MiB body 413, each
    an OpenAI error with a request id; past what aiohttp's parser reads at all, its own
    400 is logged as one line, never a traceback; the server serves on."""
    post = b"POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer " + KEY.encode()
    big = b"\r\nX-Big: " + b"a" * 100_000
    _openai_error(*_exchange(server, post + big, b'{"prompt": [1]}'), 431, "header_too_large")
    target = b"GET /health?" + b"q" * 100_000 + b" HTTP/1.1\r\nAuthorization: Bearer " \
        + KEY.encode()
    _openai_error(*_exchange(server, target), 414, "uri_too_long")
    body = b'{"prompt": "' + b"a" * (100 * 2 ** 20) + b'"}'
    _openai_error(*_exchange(server, post, body), 413, "request_too_large")
    before = server["log"].read_text().count("\n")
    status, _, _ = _exchange(server, post + b"\r\nX-Huge: " + b"a" * 300_000, b"{}")
    assert status == 400
    new = server["log"].read_text().splitlines()[before:]
    assert len(new) == 1 and new[0].startswith("aiohttp: ") and "400" in new[0], new
    ok = _exchange(server, post, b'{"prompt": [1], "max_tokens": 1}')             # control
    assert ok[0] == 200 and ok[1]["x-request-id"].startswith("req_")
    assert _health(server)["status"] == "ok"
    _no_traceback(server)


# ---- the catch-all, in-process ---------------------------------------------------------------

class _FailingWorker:
    """An engine whose every job fails with an exception that is not k3's (a defect)."""

    def submit(self, job) -> None:
        job._send(("error", RuntimeError("the engine broke")))


class _ReaderHere:
    """The reader process's reading done in this process (``Reader``), as the server
    calls it."""

    def __init__(self, tiny_dir):
        import dataclasses

        from libk3.serve.reader import Reader
        from .test_serve_reader import _spec
        # as the stub run: no tokenizer, no preambles kept
        self.reader = Reader(dataclasses.replace(_spec(tiny_dir, 0), tokenizer=False))

    def call(self, route, chunks):
        return getattr(self.reader, route)(b"".join(chunks)), []


def _stub_server(tiny_dir, worker, log=None):
    """A Server over ``worker`` and a run that has only what the routes read."""
    from libk3.serve.app import Server
    run = SimpleNamespace(opts=SimpleNamespace(model=tiny_dir), cfg=load_config(tiny_dir),
                          session=SimpleNamespace(tokenizer=None),
                          until_end=lambda settings: settings,
                          structured=lambda settings: settings)
    return Server(run, worker, _ReaderHere(tiny_dir), settings_from(2, 0.0, 1.0, 0),
                  model_name="tiny", log=log)


def _serve_in_process(tiny_dir, requests) -> tuple:
    """(answers, log lines) of ``requests`` [(method, path, JSON body or None)] sent to a
    Server over ``_FailingWorker`` and an extra route, /boom, that raises ValueError."""
    from aiohttp.test_utils import TestClient, TestServer

    log = []
    server = _stub_server(tiny_dir, _FailingWorker(), log=log.append)

    async def boom(request):
        raise ValueError("a defect")

    async def go():
        app = server.app()
        app.router.add_get("/boom", boom)
        answers = []
        async with TestClient(TestServer(app)) as client:
            for method, path, body in requests:
                r = await client.request(method, path, json=body)
                answers.append((r.status, {k.lower(): v for k, v in r.headers.items()},
                                await r.read()))
        return answers
    return asyncio.run(go()), log


def test_serve_an_unexpected_exception_is_a_500_body_logged_once_with_its_id(tiny_dir):
    """Catches an exception escaping to aiohttp (its bare text/plain 500 page and a
    traceback in the log) and a 5xx logged twice, or never, or without the id the client
    was given: each 5xx, whole or streamed, is one log line naming the request's id."""
    answers, log = _serve_in_process(tiny_dir, [
        ("GET", "/boom", None),
        ("POST", "/v1/completions", {"prompt": [1, 2]}),
        ("POST", "/v1/completions", {"prompt": [1, 2], "stream": True}),
        ("GET", "/v1/models", None)])
    ids = []
    for status, headers, body in answers[:2]:
        err = _openai_error(status, headers, body, 500)
        assert err["type"] == "server_error", err
        ids.append(headers["x-request-id"])
    assert ids[0] in json.loads(answers[0][2])["error"]["message"]     # the client can cite it
    status, headers, body = answers[2]
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]", body[:300]
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    ids.append(headers["x-request-id"])
    failures = [line for line in log if " failed (" in line]      # the rest: access lines
    assert len(failures) == 3 and len(log) == 3 + len(answers), log
    for rid, line, why in zip(ids, failures, ("ValueError: a defect", "the engine broke",
                                              "the engine broke")):
        assert rid in line and why in line and "Traceback" not in line, (rid, line)
    assert answers[3][0] == 200 and answers[3][1]["x-request-id"].startswith("req_")  # control


class _SlowWorker:
    """An engine whose jobs take 0.5 s before their one token (a long prefill)."""

    def submit(self, job) -> None:
        import threading

        def later():
            job._send(7)
            job._send(("done", SimpleNamespace(prompt_ids=job.prompt_ids, generated_ids=[7],
                                               stop_reason="length")))
        threading.Timer(0.5, later).start()


def test_serve_stream_sends_keepalive_comments_while_nothing_comes(tiny_dir):
    """Catches a stream silent through a long prefill (clients and proxies drop idle
    connections): SSE comments go out meanwhile, and the events around them are whole."""
    from aiohttp.test_utils import TestClient, TestServer

    server = _stub_server(tiny_dir, _SlowWorker())
    server.keepalive_seconds = 0.1

    async def go():
        async with TestClient(TestServer(server.app())) as client:
            r = await client.post("/v1/completions", json={"prompt": [1, 2], "stream": True})
            return r.status, (await r.read()).decode()
    status, body = asyncio.run(go())
    lines = [ln for ln in body.split("\n\n") if ln]
    assert status == 200 and lines[-1] == "data: [DONE]"
    assert lines.count(": keep-alive") >= 2
    assert all(ln == ": keep-alive" or ln.startswith("data: ") for ln in lines)


def test_serve_a_body_that_never_finishes_arriving_is_408_and_spares_the_rest(tiny_dir):
    """Catches a slow client holding a handler for ever (a body sent a few bytes at a time,
    or never finished): after the server's body deadline it is a 408 OpenAI error, and
    other requests are answered meanwhile. Control: a body that arrives in pieces within
    the deadline is read and answered (here by the failing engine's 500). The responses are read as
    they come, not to the end of the connection: a request whose body never came whole
    leaves aiohttp waiting for the rest of it, with the handler done."""
    from aiohttp.test_utils import TestServer

    server = _stub_server(tiny_dir, _FailingWorker())
    server.body_seconds = 0.5
    body = b'{"prompt": [1, 2]}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: k3\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))

    async def send(ts, pieces, pause):
        reader, writer = await asyncio.open_connection(ts.host, ts.port)
        writer.write(head)
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(pause)
        answer = await asyncio.wait_for(reader.read(1 << 16), 10)
        writer.close()
        status = int(answer.split(b" ", 2)[1])
        return status, answer.split(b"\r\n\r\n", 1)[1]

    async def models(ts):
        reader, writer = await asyncio.open_connection(ts.host, ts.port)
        t0 = time.monotonic()
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: k3\r\nConnection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return int(answer.split(b" ", 2)[1]), time.monotonic() - t0

    async def go():
        ts = TestServer(server.app())
        await ts.start_server()
        try:
            stalled = asyncio.ensure_future(send(ts, [body[:5]], 0))
            await asyncio.sleep(0.1)
            alive = await models(ts)
            dribbled = await send(ts, [body[i:i + 4] for i in range(0, len(body), 4)], 0.05)
            return await stalled, alive, dribbled
        finally:
            await ts.close()

    (status, raw), alive, dribbled = asyncio.run(go())
    err = json.loads(raw)["error"]
    assert status == 408 and err["code"] == "request_timeout", (status, raw)
    assert alive[0] == 200 and alive[1] < 0.4, alive
    assert dribbled[0] == 500 and json.loads(dribbled[1])["error"]["type"] == "server_error"
