"""Parsing an assistant turn's XTML channels into reasoning, content and tool calls."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from libk3.text.chat_parse import Reply, parse_reply, pieces, pieces_of_text

USER = [{"role": "user", "content": "q"}]


def _written(template, tok, message) -> list:
    """The ids of ``message`` as the template writes an assistant turn (what a model
    trained on it would generate after the generation prompt)."""
    before = template.render(USER, add_generation_prompt=True)
    after = template.render(USER + [message], add_generation_prompt=False)
    assert after.startswith(before)
    return tok.encode(after[len(before):], allow_special=True)


plain = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30).filter(
    lambda s: "<|" not in s and "[EOS]" not in s and "[BOS]" not in s)


@settings(max_examples=60, deadline=None)
@given(reasoning=st.one_of(st.none(), plain.filter(bool)), content=plain,
       calls=st.lists(st.tuples(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), plain),
                      max_size=2))
def test_chat_parse_reads_back_what_the_template_writes(tok, template, reasoning, content,
                                                        calls):
    """Catches a parser that loses a channel, mixes reasoning into content, or rewrites
    tool-call arguments: template-written turn -> ids -> parse is the message again."""
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                  "function": {"name": n, "arguments": a}}
                                 for i, (n, a) in enumerate(calls)]
    reply = parse_reply(pieces(tok, _written(template, tok, message)))
    assert reply.message() == message


def test_chat_parse_spelled_markup_is_text(tok):
    """Catches parsing decoded text: markup the model spelled with ordinary tokens is
    text, only special ids are markup."""
    text = "<|open|>think<|sep|>x<|close|>think<|sep|>"
    assert parse_reply(pieces(tok, tok.encode(text))) == Reply(content=text)
    assert parse_reply(pieces(tok, tok.encode(text, allow_special=True))) == \
        Reply(reasoning="x")                                                  # control


@pytest.mark.parametrize("text,content", [
    ("a<|open|>weird<|sep|>b<|close|>weird<|sep|>c", None),
    ("<|close|>think<|sep|>stray", None),
    ("x<|sep|>y", None),
    ("<|open|>think<|sep|>never closed", None),
    # a tools channel left open is calls cut by the length limit: never content
    ("<|open|>response<|sep|>ok<|close|>response<|sep|>tail <|open|>tools<|sep|>",
     "oktail "),
    ("<|open|>tools<|sep|><|open|>call<|sep|>{}<|close|>call<|sep|><|close|>tools<|sep|>",
     "<|open|>call<|sep|>{}<|close|>call<|sep|>"),
])
def test_chat_parse_unknown_or_unclosed_markup_is_kept_as_text(text, content):
    """Catches markup dropped: an unknown tag, a stray close or separator, an unclosed
    channel, a call without a name all stay in the content as written (but for a tools
    channel left open: calls the length limit cut, test_stream_markup)."""
    reply = parse_reply(pieces_of_text(text))
    assert reply.content == (text if content is None else content)
    assert reply.reasoning is None and reply.tool_calls == []


def test_chat_parse_turn_end_is_not_content():
    """Catches the template's closing and the stop token leaking into the content."""
    text = "<|open|>response<|sep|>hi<|close|>response<|sep|><|close|>assistant<|sep|>"
    assert parse_reply(pieces_of_text(text + "<|end_of_msg|>")) == Reply(content="hi")
    assert parse_reply(pieces_of_text("hi[EOS]")) == Reply(content="hi")
    assert parse_reply(pieces_of_text("hi[EOS]more")).content == "hi[EOS]more"  # control


def test_chat_parse_streaming_counts_an_open_channel_as_open():
    """Catches streamed reasoning shown as content while the think channel is open, and
    a half-written call emitted before its close."""
    items = pieces_of_text("<|open|>think<|sep|>still thinking")
    assert parse_reply(items, final=False) == Reply(reasoning="still thinking")
    assert parse_reply(items, final=True) == Reply(content="<|open|>think<|sep|>still thinking")
    half = pieces_of_text('<|open|>tools<|sep|><|open|>call name="f"<|sep|>{"a"')
    assert parse_reply(half, final=False).tool_calls == []
    done = pieces_of_text('<|open|>tools<|sep|><|open|>call name="f"<|sep|>{}<|close|>call<|sep|>')
    assert [c["function"]["name"] for c in parse_reply(done, final=False).tool_calls] == ["f"]
