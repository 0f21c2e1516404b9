"""What the model writes back: an assistant turn's XTML channels as a message.

Owns: splitting generated ids into markup (special tokens) and text, and reading the
channels ``think`` (reasoning), ``response`` (content) and ``tools`` (calls with their
arguments) into ``Reply`` (formats/chat.md "Parsing"). Does not own: rendering
(``chat_template``) or generation.

Why from ids, not from decoded text: a special token and the same characters written as
ordinary text decode alike; only the id says which one the model produced, so text
that merely spells ``<|open|>`` stays text. Why unknown or unclosed markup is kept as
text: dropping it would hide what the model wrote; a reader can still see it.
"""

from __future__ import annotations

import dataclasses
import re

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
# Markup the assistant turn may end with (the template's closing and K3's turn ends).
TURN_ENDS = ("<|end_of_msg|>", "[EOS]")
_HEAD = re.compile(r'\s*([A-Za-z_][\w.-]*)((?:\s+[A-Za-z_][\w.-]*="[^"]*")*)\s*')
_ATTR = re.compile(r'([A-Za-z_][\w.-]*)="([^"]*)"')
# text that a tag's head may still grow from (``_HEAD``, cut anywhere)
_HEAD_START = re.compile(r'\s*(?:[A-Za-z_][\w.-]*(?:\s+(?:[A-Za-z_][\w.-]*(?:="[^"]*"?|=)?)?)*)?')


@dataclasses.dataclass
class Reply:
    """An assistant message: ``reasoning`` (None when the model wrote no think channel),
    ``content`` and ``tool_calls`` (OpenAI form: id, type "function", function name and
    arguments, the arguments exactly as written)."""
    reasoning: str | None = None
    content: str = ""
    tool_calls: list = dataclasses.field(default_factory=list)

    def message(self) -> dict:
        """The OpenAI-style assistant message (keys absent when empty)."""
        msg = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def pieces(tokenizer, ids) -> list:
    """``ids`` as a list of ("mark", special-token text) and ("text", str) pieces, runs
    of ordinary tokens decoded together (a UTF-8 character is never split)."""
    specials = {i: t for t, i in tokenizer.special_ids.items()}
    out, run = [], []
    for i in ids:
        if i in specials:
            if run:
                out.append(("text", tokenizer.decode(run)))
                run = []
            out.append(("mark", specials[i]))
        else:
            run.append(i)
    if run:
        out.append(("text", tokenizer.decode(run)))
    return out


def pieces_of_text(text: str, marks=(OPEN, CLOSE, SEP) + TURN_ENDS) -> list:
    """The same split for text whose markup is known to be markup (a rendered template)."""
    pattern = "(" + "|".join(map(re.escape, sorted(marks, key=len, reverse=True))) + ")"
    return [("mark" if k % 2 else "text", p) for k, p in enumerate(re.split(pattern, text))
            if p]


def _tags(items):
    """Group pieces into ("open", name, attrs, raw), ("close", name, raw), ("end", raw) or
    ("text", raw): OPEN head SEP and CLOSE name SEP become tags; anything else is text."""
    out, k = [], 0
    while k < len(items):
        kind, value = items[k]
        if kind == "mark" and value in (OPEN, CLOSE) and k + 2 < len(items) \
                and items[k + 1][0] == "text" and items[k + 2] == ("mark", SEP):
            m = _HEAD.fullmatch(items[k + 1][1])
            raw = value + items[k + 1][1] + SEP
            if m and value == OPEN:
                out.append(("open", m.group(1), dict(_ATTR.findall(m.group(2))), raw))
                k += 3
                continue
            if m and value == CLOSE and not m.group(2):
                out.append(("close", m.group(1), raw))
                k += 3
                continue
        out.append(("end", value) if kind == "mark" and value in TURN_ENDS else ("text", value))
        k += 1
    return out


def parse_reply(items, final: bool = True) -> Reply:
    """Read an assistant turn (the pieces after the generation prompt). Top level: think,
    response and tools channels; text outside them is content; a closing ``assistant``
    tag and trailing turn ends are the turn's end. Inside tools, each ``call name=...``
    is a call whose body is its arguments. Anything else (an unknown tag, a tag closing
    what is not open, markup inside a channel) is kept as text where it stands. With
    ``final`` False (streaming), a channel still open at the end counts as open; with
    True it was never closed and is kept as text, but for a tools channel cut short
    (the length limit): its complete calls are calls, the call it was writing is dropped,
    never content. Streaming, markup at the end that may still become a tag (``<|open|>``
    and the start of a head, no ``<|sep|>`` yet) waits (``settled``)."""
    tags = _tags(items if final else settled(items))
    reply = Reply()
    k = 0
    while k < len(tags):
        tag = tags[k]
        if tag[0] == "open" and tag[1] in ("think", "response", "tools"):
            end = next((j for j in range(k + 1, len(tags))
                        if tags[j][0] == "close" and tags[j][1] == tag[1]), None)
            if end is None and final and tag[1] != "tools":
                reply.content += "".join(_raw(t) for t in tags[k:])
                break
            body = tags[k + 1:len(tags) if end is None else end]
            if tag[1] == "tools":
                reply.content += _read_calls(body, reply.tool_calls, complete=end is not None)
            else:
                text = "".join(_raw(t) for t in body)
                if tag[1] == "think":
                    reply.reasoning = (reply.reasoning or "") + text
                else:
                    reply.content += text
            k = len(tags) if end is None else end + 1
        elif tag[0] == "close" and tag[1] == "assistant" \
                and all(t[0] == "end" for t in tags[k + 1:]):
            break
        elif tag[0] == "end" and all(t[0] == "end" for t in tags[k:]):
            break
        else:
            reply.content += _raw(tag)
            k += 1
    return reply


def settled(items) -> list:
    """``items`` without the markup at their end that may still open or close a channel:
    a last ``<|open|>`` or ``<|close|>``, or one followed by text a tag's head may still
    grow from (the ``<|sep|>`` ending the tag has not come)."""
    items = list(items)
    if items and items[-1][0] == "mark" and items[-1][1] in (OPEN, CLOSE):
        return items[:-1]
    if len(items) >= 2 and items[-2][0] == "mark" and items[-2][1] in (OPEN, CLOSE) \
            and items[-1][0] == "text" and _HEAD_START.fullmatch(items[-1][1]):
        return items[:-2]
    return items


def _raw(tag) -> str:
    return tag[-1] if tag[0] != "text" else tag[1]


def _read_calls(body, calls: list, complete: bool) -> str:
    """Append the tools channel's calls to ``calls``; returns what is not a call (text)."""
    stray, k = "", 0
    while k < len(body):
        tag = body[k]
        if tag[0] == "open" and tag[1] == "call" and "name" in tag[2]:
            end = next((j for j in range(k + 1, len(body))
                        if body[j][0] == "close" and body[j][1] == "call"), None)
            if end is None:
                if complete:                         # a call the channel closed over
                    stray += "".join(_raw(t) for t in body[k:])
                break                                # still being written (streaming)
            n = len(calls)
            calls.append({"id": tag[2].get("id", f"call_{n}"), "type": "function",
                          "function": {"name": tag[2]["name"],
                                       "arguments": "".join(_raw(t) for t in body[k + 1:end])}})
            k = end + 1
        else:
            stray += _raw(tag)
            k += 1
    return stray
