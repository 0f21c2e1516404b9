"""libk3.serve.reader: the process that reads the server's request bodies answers as the
reading would in the server's own process, refuses the same way, and is started again
when it dies or stalls, the request that met it a clear error and the next one read."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal

import pytest

from libk3.config import context_length, load_config
from libk3.errors import K3Error
from libk3.serve import reader as reader_mod
from libk3.serve.protocol import ApiError, refusal_of
from libk3.serve.reader import Reader, ReaderDefect, ReaderProcess, ReaderSpec
from libk3.text.chat_template import DEFAULT_LIMITS

MSGS = [{"role": "system", "content": "Be brief. " * 40}, {"role": "user", "content": "Hi"}]


def _spec(model_dir, min_preamble=16) -> ReaderSpec:
    vocab = load_config(model_dir).vocab_size
    return ReaderSpec(str(model_dir), True, None, DEFAULT_LIMITS, vocab,
                      context_length(model_dir), "tiny", min_preamble, None)


@pytest.fixture
def process(tiny_dir):
    proc = ReaderProcess(_spec(tiny_dir))
    proc.ready()
    yield proc
    proc.close()


def _chunks(body: dict, size: int = 7) -> list:
    raw = json.dumps(body).encode()
    return [raw[i:i + size] for i in range(0, len(raw), size)]


def test_the_process_reads_as_the_reading_does_here(process, tiny_dir):
    """Catches a body's chunks joined out of order or cut, a request, its ids or its
    preamble changed on the way back, or a refusal coming back as another status or
    body."""
    here = Reader(_spec(tiny_dir))
    body = {"messages": MSGS, "max_tokens": 3, "stop": ["x"]}
    (req, ids, pre), heard = process.call("chat", _chunks(body))
    req_here, ids_here, pre_here = here.chat(json.dumps(body).encode())
    assert ids.tolist() == ids_here.tolist() and len(ids) > 40 and heard == []
    assert pre == pre_here > 0 and req == req_here and req.messages is None
    for bad in ({"messages": MSGS, "model": "other"}, {"messages": MSGS, "n": "2"},
                {"messages": [{"role": "wizard", "content": "x"}]}):
        with pytest.raises(ApiError) as there:
            process.call("chat", _chunks(bad))
        with pytest.raises(Exception) as local:
            here.chat(json.dumps(bad).encode())
        assert (there.value.status, there.value.body) == refusal_of(local.value)[:2]
    assert json.loads(process.call("tokenize", _chunks({"prompt": "hi there"}))[0]) == {
        "count": len(here.prompts.encode("hi there")), "max_model_len": context_length(tiny_dir),
        "tokens": here.prompts.encode("hi there")}


def test_a_reader_that_died_is_started_again_before_the_next_request(process):
    """Catches a dead reader failing every request after it (the server would answer 500
    for ever) or the next request blamed for it."""
    body = _chunks({"prompt": "hello", "max_tokens": 1})
    first = process.call("completion", body)[0][1].tolist()
    os.kill(process._proc.pid, signal.SIGKILL)
    process._proc.wait()
    assert process.call("completion", body)[0][1].tolist() == first


def test_a_stalled_reader_is_a_clear_error_and_replaced(process, monkeypatch):
    """Catches a reader that stops answering holding the server's CPU thread (every later
    request waiting behind it) instead of being replaced after READ_SECONDS."""
    monkeypatch.setattr(reader_mod, "READ_SECONDS", 0.5)
    body = _chunks({"prompt": "hello", "max_tokens": 1})
    stalled = process._proc
    os.kill(stalled.pid, signal.SIGSTOP)
    try:
        with pytest.raises(K3Error, match="took over 0.5 s"):
            process.call("completion", body)
    finally:
        with contextlib.suppress(ProcessLookupError):     # replaced: it was killed
            os.kill(stalled.pid, signal.SIGCONT)
    assert stalled.poll() is not None and process._proc is not stalled
    monkeypatch.undo()                      # the replacement answers at its own pace
    assert len(process.call("completion", body)[0][1]) > 0


def test_a_defect_in_the_reader_is_told_apart_from_a_refusal(process, monkeypatch):
    """Catches a defect (an exception that is not a refusal) sent back as a 4xx the client
    is blamed for, or a refusal sent back as a defect."""
    with pytest.raises(ReaderDefect, match="no route"):
        process.call("nowhere", [b"{}"])
    with pytest.raises(ApiError) as e:
        process.call("chat", [b"{not json"])
    assert e.value.status == 400
    assert process.call("count_tokens", _chunks({"messages": MSGS[1:]}))[0] > 0   # still up


def test_a_reader_that_cannot_start_says_why(tiny_dir, tmp_path):
    """Catches a reader whose start failed (its tokenizer unreadable) found only by the
    first request, or told as a traceback."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_dir, model)
    (model / "tiktoken.model").write_text("not base64 ranks\n")
    proc = ReaderProcess(_spec(model))
    try:
        with pytest.raises(K3Error, match="request reader could not start: .*tiktoken.model"):
            proc.ready()
    finally:
        proc.close()
    assert proc._proc.poll() is not None
    bad = dataclasses.replace(_spec(tiny_dir), tokenizer_cache=[1])        # not a path
    proc = ReaderProcess(bad)
    try:
        with pytest.raises(K3Error, match="request reader could not start: TypeError"):
            proc.ready()
    finally:
        proc.close()


def test_a_template_that_builds_a_huge_string_is_that_request_s_422(tiny_dir, tmp_path):
    """Catches a template allocating a huge string in one filter call (which its output
    limit cannot see before it is made) taking memory from the server, or failing other
    requests: the reader's address space is bounded, so the string cannot be made and it
    is that request's 422, and the next request is read."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_dir, model)
    (model / "chat_template.jinja").write_text(
        '{% if messages[0].content == "boom" %}{{ "x" | center(10 ** 10) }}{% endif %}'
        "{% for m in messages %}{{ m.content }}{% endfor %}")
    proc = ReaderProcess(_spec(model))
    try:
        proc.ready()
        with pytest.raises(ApiError) as e:
            proc.call("chat", _chunks({"messages": [{"role": "user", "content": "boom"}]}))
        message = e.value.body["error"]["message"]      # the template named, as it failed
        assert e.value.status == 422 and "chat_template.jinja" in message, message
        assert "MemoryError" in message, message    # not made whole, then found too long
        (_, ids, _), _ = proc.call("chat", _chunks({"messages": [{"role": "user",
                                                                  "content": "fine"}]}))
        assert len(ids) > 0
    finally:
        proc.close()
