"""A reply as the client sees it: generated ids to a final message or to stream deltas.

Owns: the assistant message of a chat reply (parsed from its channels when the model
has a template, its text otherwise), a completion's text, and the deltas a stream sends
as tokens arrive (what changed since the last delta), for the server's streams and the
chat REPL's printer alike. Does not own: the parsing rules (``libk3.text.chat_parse``),
where a stop sequence ends the text (``libk3.engine.stops``, the rule k3-run and batch
results follow too), HTTP or the terminal.
"""

from __future__ import annotations

from .stops import returned_pieces, returned_text
from ..text.chat_parse import Reply, parse_reply

REPLACEMENT = "\ufffd"          # a UTF-8 character whose last bytes have not arrived yet


class ReplyReader:
    """Reads one request's generated ids; ``templated`` False: the reply is plain text."""

    def __init__(self, tokenizer, templated: bool, stops=(), end_ids=()):
        self.tokenizer, self.templated, self.stops = tokenizer, templated, tuple(stops)
        self.end_ids = frozenset(end_ids)   # ids that end generation: not a completion's text
        self.sent = Reply()
        self.sent_calls = 0

    def read(self, ids, final: bool) -> Reply:
        if self.templated:
            return parse_reply(returned_pieces(self.tokenizer, ids, self.stops), final=final)
        return Reply(content=returned_text(self.tokenizer, ids, self.stops))

    def text(self, ids) -> str:
        """A completion's text (no parsing: /v1/completions continues text), without the
        token that ended it by a stop id (a turn's end, a grammar's end): OpenAI's text
        holds no stop."""
        return returned_text(self.tokenizer, ids, self.stops, self.end_ids)

    def delta(self, ids, final: bool = False, cut: bool = False) -> dict:
        """What a stream sends now: new reasoning and content text (``reasoning_content``,
        ``content``) and newly closed tool calls (``tool_calls`` with their index); {} when
        nothing is new. Text that would change what was already sent (an incomplete
        character, a stop sequence still being written) waits. ``cut``: the reply ends
        here as it stands (a display's last delta): nothing waits, a channel still open
        stays what it was streamed as, and a tag still being written is left out."""
        now = self.read(ids, final and not cut)
        final = final or cut
        out = {}
        for key, attr in (("reasoning_content", "reasoning"), ("content", "content")):
            grown = self._grown(getattr(self.sent, attr) or "", getattr(now, attr) or "", final)
            if grown is not None:
                out[key] = grown[len(getattr(self.sent, attr) or ""):]
                setattr(self.sent, attr, grown)
        calls = now.tool_calls[self.sent_calls:]
        if calls:
            out["tool_calls"] = [dict(c, index=self.sent_calls + i) for i, c in enumerate(calls)]
            self.sent_calls += len(calls)
        return out

    def text_delta(self, ids, final: bool = False) -> str:
        """The same for a completion's plain text."""
        old = self.sent.content
        grown = self._grown(old, self.text(ids), final)
        if grown is None:
            return ""
        self.sent.content = grown
        return grown[len(old):]

    def _grown(self, old: str, new: str, final: bool):
        """``new`` when it extends what was sent (held back while it may still change)."""
        if not final:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            new = new.rstrip(REPLACEMENT)
            new = new[:max(len(old), len(new) - hold)]
        return new if len(new) > len(old) and new.startswith(old) else None
