"""Streams carry no markup: a streamed reply holds back text that may still open or close
a channel until it can tell, so a streamed tool call sends no "<|open|>", "t", "o", ...
as content on either API; a call cut off by the token limit is never content."""

from __future__ import annotations

from libk3.serve.anthropic import Blocks
from libk3.engine.replies import ReplyReader
from libk3.text.chat_parse import parse_reply, pieces


def _ids(tok, *parts):
    """Ids of ``parts``: a markup name ("<|open|>") as its special id, else text, each
    character of a text its own ids (so a tag is written in as many steps as it can)."""
    out = []
    for p in parts:
        if p.startswith("<|"):
            out.append(tok.id_of(p))
        else:
            out += [i for ch in p for i in tok.encode(ch)]
    return out


CALL = ("<|open|>", "tools", "<|sep|>", "<|open|>", 'call name="add" id="c1"', "<|sep|>",
        '{"a":1}', "<|close|>", "call", "<|sep|>", "<|close|>", "tools", "<|sep|>")
THINK = ("<|open|>", "think", "<|sep|>", "let me see", "<|close|>", "think", "<|sep|>")


def _stream(tok, ids) -> list:
    """Every delta a streamed reply sends, token by token, then the final one."""
    reader = ReplyReader(tok, True)
    out = [reader.delta(ids[:n]) for n in range(1, len(ids) + 1)]
    return [d for d in out + [reader.delta(ids, final=True)] if d]


def test_stream_tool_call_sends_no_markup_as_content(tok):
    """Catches a streamed tool call that first leaks its tag as content ("<|open|>", "t",
    "o", "o", "l", "s"): no delta carries content or reasoning markup, and the call goes
    out once; the same reply unstreamed agrees (control)."""
    ids = _ids(tok, *THINK, *CALL)
    deltas = _stream(tok, ids)
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    whole = parse_reply(pieces(tok, ids))
    assert content == whole.content == "" and reasoning == whole.reasoning == "let me see"
    assert [c["function"]["arguments"] for c in calls] == ['{"a":1}']
    events = b"".join(Blocks().events(d) for d in deltas).decode()
    assert "<|open|>" not in events and "text_delta" not in events and "tool_use" in events, events


def test_stream_plain_text_still_streams_as_it_comes(tok):
    """Catches a hold-back that delays ordinary text (control of the test above): text
    without markup goes out before the reply ends; markup that opens nothing is sent as
    text once it cannot be a tag."""
    ids = _ids(tok, "hello there")
    deltas = _stream(tok, ids)
    assert len(deltas) > 1 and "".join(d["content"] for d in deltas) == "hello there"
    odd = _ids(tok, "a ", "<|open|>", " not, a tag")
    assert "".join(d.get("content", "") for d in _stream(tok, odd)) == \
        parse_reply(pieces(tok, odd)).content


def test_reply_cut_in_a_tool_call_keeps_no_half_call_in_content(tok):
    """Catches a call cut short by max_tokens coming back as raw markup in content: the
    half call is dropped (a complete call before it stays a call)."""
    cut = _ids(tok, *CALL[:7])
    reply = parse_reply(pieces(tok, cut))
    assert reply.content == "" and reply.tool_calls == []
    two = _ids(tok, *CALL[:10], "<|open|>", 'call name="add"', "<|sep|>", '{"a"')
    reply = parse_reply(pieces(tok, two))
    assert reply.content == "" and len(reply.tool_calls) == 1
    assert "<|open|>" not in "".join(d.get("content", "") for d in _stream(tok, cut))


def _chat_replying(monkeypatch, tiny_dir, tok, reply, *args):
    """A --chat turn in this process whose model writes ``reply`` (ids), token by token
    through the printer as generation would."""
    from libk3.engine.generate import GenResult
    from libk3.run import chat_session
    from .scripts import k3_here

    def scripted(forward, state, ids, settings, *, hooks, **kw):
        for t in reply:
            hooks.on_token(t)
        return GenResult(list(ids), list(reply), "stop_id", 0.0, 0.0)
    monkeypatch.setattr(chat_session, "generate", scripted)
    return k3_here(tiny_dir, "--chat", *args, input="Hi there\n\n")


def test_chat_repl_reply_prints_no_markup(tiny_dir, tok, monkeypatch):
    """Catches the REPL printing the model's raw tokens (``<|open|>think``, the tools
    channel, the turn's end): stdout holds the answer and the call, the reasoning goes to
    stderr after "thinking:"; the same ids printed raw hold the markup (control)."""
    end = tok.id_of("<|end_of_msg|>")
    reply = _ids(tok, *THINK, "The sum", *CALL) + [end]
    p = _chat_replying(monkeypatch, tiny_dir, tok, reply)
    assert p.returncode == 0, p.stderr
    assert p.stdout == 'The sum\ntool call add({"a":1})\n', p.stdout
    assert "thinking: let me see\n" in p.stderr and "<|" not in p.stderr
    from libk3.engine.stops import returned_text
    assert "<|open|>think<|sep|>" in returned_text(tok, reply, ())       # control: raw


def test_chat_repl_reply_cut_in_its_reasoning_prints_no_markup(tiny_dir, tok, monkeypatch):
    """Catches a reply cut by --gen inside its think channel ending with the channel's
    raw markup as the answer (the parser keeps an unclosed channel as text at the end):
    the reasoning stays reasoning, and a tag half written at the cut is left out."""
    reply = _ids(tok, *THINK[:4], "<|open|>", "res")
    p = _chat_replying(monkeypatch, tiny_dir, tok, reply)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "\n" and "thinking: let me see\n" in p.stderr, (p.stdout, p.stderr)
    assert "<|" not in p.stderr
    whole = parse_reply(pieces(tok, reply))
    assert whole.content.startswith("<|open|>think")                     # control
