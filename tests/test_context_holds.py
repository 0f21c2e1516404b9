"""The context holds everywhere: prompt plus generation never passes the model's context
(a generation that reaches it stops with "length"; a prompt or --gen that cannot fit is
refused before work with the sizes), and the chat REPL refuses a line that does not fit,
or is not UTF-8, and goes on, its state saved at any exit. The tiny model with a
48-position context."""

from __future__ import annotations

import json

import pytest

from libk3.engine.generate import GenSettings, generate
from libk3.model.state import State

from .scripts import k3_here
from .test_chat_repl import _state_ids

CONTEXT = 48


@pytest.fixture(scope="module")
def short(tiny_dir, tmp_path_factory):
    """The tiny model with max_position_embeddings 48 (its other files linked)."""
    d = tmp_path_factory.mktemp("short") / "m"
    d.mkdir()
    for f in tiny_dir.iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f)
    doc = json.loads((tiny_dir / "config.json").read_text())
    doc["text_config"]["max_position_embeddings"] = CONTEXT
    (d / "config.json").write_text(json.dumps(doc))
    return d


def test_gen_settings_limit_caps_an_explicit_gen_at_the_context():
    """Catches an explicit gen (the server's max_tokens, a batch line's, -n N) run past
    the context: only -1 stopped there (a 48-token context returned 76 tokens)."""
    s = GenSettings(gen=100, context=CONTEXT)
    assert s.limit(40) == 8 and s.limit(CONTEXT) == 0 and s.limit(60) == 0
    assert GenSettings(gen=5, context=CONTEXT).limit(40) == 5           # control: fits
    assert GenSettings(gen=-1, context=CONTEXT).limit(40) == 8


def test_generate_reaching_the_context_stops_with_length(tiny_dir):
    """Catches a generation with an explicit gen that goes on past the context."""
    from libk3.engine.session import open_session
    sess = open_session(tiny_dir)
    try:
        state = State(sess.cfg, capacity=CONTEXT)
        res = generate(sess.forward, state, list(range(1, 41)),
                       GenSettings(gen=100, context=CONTEXT))
        assert res.stop_reason == "length" and len(res.generated_ids) == CONTEXT - 40
    finally:
        sess.weights.close()


def test_cli_prompt_or_gen_past_the_context_is_refused_with_the_sizes(short, tmp_path):
    """Catches -p/--ids prompts longer than the context, or -n N running past it, or a
    full state continued, getting work (and tokens past the context) instead of a
    one-line refusal naming the sizes, exit 2; fitting runs go on (control)."""
    ids = ",".join(str(i) for i in range(1, CONTEXT + 2))
    r = k3_here(short, "--ids", ids, "-n", "1")
    assert r.returncode == 2 and f"{CONTEXT + 1:,} tokens" in r.stderr and str(CONTEXT) in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = k3_here(short, "-p", "word " * 200, "-n", "1")
    assert r.returncode == 2 and str(CONTEXT) in r.stderr, r.stderr
    r = k3_here(short, "--ids", "1,2,3", "-n", "100")
    assert r.returncode == 2 and "--gen 45 fits" in r.stderr, r.stderr
    st = tmp_path / "full.k3state"
    fill = ",".join(str(i) for i in range(1, CONTEXT))
    r = k3_here(short, "--ids", fill, "-n", "1", "--save-state", st, "--json", "-q")
    assert r.returncode == 0, r.stderr                                   # control: fits
    r = k3_here(short, "--load-state", st, "-n", "1")
    assert r.returncode == 2 and "fill the model's context" in r.stderr, r.stderr
    r = k3_here(short, "--ids", "1,2,3", "-n", "45", "--json", "-q")
    assert r.returncode == 0 and len(json.loads(r.stdout)["generated_ids"]) == 45


def test_chat_line_past_the_context_is_refused_and_the_chat_goes_on(short, tmp_path):
    """Catches a chat line (or /system) too long for the context prefilled for minutes or
    run past it: refused with its size, nothing sent, and the next line gets its reply;
    the state saved is that of the turns said."""
    st = tmp_path / "s.k3state"
    big = "word " * 40_000                         # over 47 tokens x the longest token
    talk = f"{big}\n/system {big}\nHi\n"
    r = k3_here(short, "--chat", "--gen", "2", "--save-state", st, input=talk)
    assert r.returncode == 0, r.stderr
    assert "the message is 200,000 bytes" in r.stderr and "not sent" in r.stderr
    assert "the system message is 199,999 bytes" in r.stderr     # the argument stripped
    assert 0 < len(_state_ids(short, st)) <= CONTEXT


def test_chat_line_not_utf8_is_refused_and_the_conversation_kept(short, tmp_path):
    """Catches a typed line holding a byte that is not UTF-8 ending the chat (exit 2,
    --save-state not written): the line is refused with its reason, the next one is a
    turn, and the state is saved at the end with that turn (control: the same chat
    without the bad line gives the same state)."""
    states, said = [], []
    for talk in (b"bad \xff line\nHi\n", b"Hi\n"):
        st = tmp_path / f"s{len(states)}.k3state"
        r = k3_here(short, "--chat", "--gen", "2", "--save-state", st, input=talk)
        assert r.returncode == 0, r.stderr
        states.append(_state_ids(short, st))
        said.append(r.stderr)
    assert "byte 0xFF at character 5" in said[0] and "not sent" in said[0]
    assert "0xFF" not in said[1]
    assert states[0] == states[1] and states[0]


def test_serve_explicit_max_tokens_stops_at_the_context(short, tmp_path):
    """Catches a request's explicit max_tokens run past the context (a 48-token context
    returned 76 tokens), on completions (whole, streamed with max_tokens 2^20, n > 1) and
    Anthropic's messages: each stops with "length" (max_tokens) at the context; a
    max_tokens that fits is kept (control)."""
    pytest.importorskip("aiohttp")
    openai = pytest.importorskip("openai")
    from .test_serve import KEY, _post, _start, _stop
    srv = _start(short, tmp_path / "serve.log")
    try:
        c = openai.OpenAI(base_url=srv["url"] + "/v1", api_key=KEY, max_retries=0)
        whole = c.completions.create(model="m", prompt="x", max_tokens=100, n=2,
                                     temperature=1.0, seed=3)
        assert [ch.finish_reason for ch in whole.choices] == ["length", "length"]
        assert whole.usage.prompt_tokens + whole.usage.completion_tokens / 2 == CONTEXT
        parts = [p for p in c.completions.create(model="m", prompt="x", max_tokens=2 ** 20,
                                                 stream=True) if p.choices]
        assert parts[-1].choices[0].finish_reason == "length"
        assert len("".join(p.choices[0].text for p in parts)) > 0
        fits = c.completions.create(model="m", prompt="x", max_tokens=5)
        assert fits.usage.completion_tokens == 5                       # control
        status, msg = _post(srv, "/v1/messages", json.dumps(
            {"model": "m", "max_tokens": 100, "messages": [
                {"role": "user", "content": "Hi"}]}).encode())
        assert status == 200, msg
        u = msg["usage"]
        assert u["input_tokens"] + u["output_tokens"] <= CONTEXT
        assert msg["stop_reason"] in ("max_tokens", "end_turn")
    finally:
        _stop(srv)


def test_chat_ended_by_an_error_still_saves_its_state(short, tmp_path, monkeypatch):
    """Catches --save-state written only when the chat ends by /exit or end of input: a
    turn that fails (exit 3) leaves the state of the turns before it saved."""
    from libk3.errors import FormatError
    from libk3.run import chat_session
    real, calls = chat_session.Chat.turn, []

    def turn(self, text, *a, **kw):
        calls.append(text)
        if len(calls) == 2:
            raise FormatError("the template failed on this message", path="t.jinja")
        return real(self, text, *a, **kw)
    monkeypatch.setattr(chat_session.Chat, "turn", turn)
    st = tmp_path / "s.k3state"
    r = k3_here(short, "--chat", "--gen", "2", "--save-state", st, input="Hi\nAgain\n")
    assert r.returncode == 3 and "t.jinja" in r.stderr, r.stderr
    first = _state_ids(short, st)
    monkeypatch.setattr(chat_session.Chat, "turn", real)
    ok = tmp_path / "ok.k3state"                                # control: Hi alone
    assert k3_here(short, "--chat", "--gen", "2", "--save-state", ok, input="Hi\n").returncode == 0
    assert first == _state_ids(short, ok)


def test_chat_system_option_too_long_for_the_context_is_refused_at_start(short, tmp_path):
    """Catches a --system text that cannot fit the context accepted, every turn then
    refused for it: one line naming --system and its size, exit 2; one that fits starts
    the chat (control)."""
    big = tmp_path / "system.txt"
    big.write_text("word " * 40_000)
    r = k3_here(short, "--chat", "--gen", "2", "--system", f"@{big}", input="Hi\n")
    assert r.returncode == 2 and "--system" in r.stderr and "bytes" in r.stderr, r.stderr
    r = k3_here(short, "--chat", "--gen", "2", "--system", "Be brief.", input="Hi\n")
    assert r.returncode == 0, r.stderr


def test_ctx_size_counts_the_positions_a_loaded_state_holds(tiny_dir, tmp_path):
    """Catches --ctx-size checked against the prompt alone after --load-state: a state of
    31 tokens, 10 more and --gen 10 do not fit --ctx-size 40 (refused, exit 2, naming it
    and the state's tokens); the same under --ctx-size 60 runs (control)."""
    st = tmp_path / "s.k3state"
    ids = ",".join(str(i) for i in range(1, 31))
    r = k3_here(tiny_dir, "--ids", ids, "-n", "1", "--save-state", st, "--json", "-q")
    assert r.returncode == 0, r.stderr
    more = ",".join(str(i) for i in range(1, 11))
    r = k3_here(tiny_dir, "--load-state", st, "--ids", more, "-n", "10", "--ctx-size", "40")
    assert r.returncode == 2, r.stderr
    assert "the context set by --ctx-size of 40" in r.stderr and "31" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = k3_here(tiny_dir, "--load-state", st, "--ids", more, "-n", "10", "--ctx-size", "60",
                "--json", "-q")
    assert r.returncode == 0 and len(json.loads(r.stdout)["generated_ids"]) == 10, r.stderr


def test_serve_prompt_over_ctx_size_is_refused_naming_ctx_size(tiny_dir):
    """Catches the server's refusal of a prompt over --ctx-size saying "the model's
    context" (the model's is far larger): it names --ctx-size; without --ctx-size it
    names the model's context (control)."""
    from libk3.serve.protocol import ApiError
    from libk3.serve.reader import Reader
    from .test_serve_reader import _spec
    import dataclasses
    spec = dataclasses.replace(_spec(tiny_dir), context=8, ctx_size=8)
    body = json.dumps({"model": "tiny", "prompt": "word " * 40}).encode()
    with pytest.raises(ApiError, match=r"over the context set by --ctx-size of 8 tokens") as e:
        Reader(spec).completion(body)
    assert e.value.status == 413
    model = dataclasses.replace(spec, ctx_size=None)
    with pytest.raises(ApiError, match=r"the model's context of 8 tokens"):
        Reader(model).completion(body)


def test_serve_live_refusal_names_ctx_size(tiny_dir, tmp_path):
    """Catches a server started with --ctx-size whose reader is not told (the refusal
    naming the model's context): a prompt over 8 tokens gets 413 naming --ctx-size; a
    prompt that fits is answered (control)."""
    pytest.importorskip("aiohttp")
    from .test_serve import _post, _start, _stop
    srv = _start(tiny_dir, tmp_path / "serve.log", "--ctx-size", 8)
    try:
        status, body = _post(srv, "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": "word " * 40, "max_tokens": 1}).encode())
        assert status == 413, body
        assert "the context set by --ctx-size of 8 tokens" in body["error"]["message"]
        status, body = _post(srv, "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": [1, 2], "max_tokens": 1}).encode())
        assert status == 200, body
    finally:
        _stop(srv)
