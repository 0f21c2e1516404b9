"""When generation stops, and where the text it returns ends: the one stop rule of
k3-run, batch results and the server (docs/run.md "Stop strings").

Owns: ``Stops`` (after each generated token: stop at a stop id or a stop string?, the
loop's question in ``core``) and ``StopText`` (the stop-string rule
itself, token by token, and the returned text: whole, or streamed as it becomes final),
with ``returned_text`` and ``returned_pieces`` for a finished id list. Does not own:
tokenizing, the length limit (the loop's), or parsing a reply into channels
(``libk3.text.chat_parse``).

The rule. A stop string matches in the bytes of ordinary tokens only: a special token
(``<|im_end|>``, a template's markup) is never matched by its text and ends the run of
bytes a match may span. Generation ends with the token that completes the first match;
the returned text ends where that match starts (the stop string and whatever followed it
in the same token are left out), while the ids keep every generated token. A token that
ends generation by its id (a turn's end, a stop id) is left out of the text too. Why bytes: a
token may end inside a UTF-8 character, and a stop string's bytes then still match
across the boundary; decoded text would show U+FFFD there until the next token.
"""

from __future__ import annotations

import codecs


class StopText:
    """One sequence's text under the stop rule. ``feed(id)`` after each generated token
    says whether a stop string has just completed (then the text ends at its start; feed
    no more); ``take()`` gives the text no later token can change (a streaming printer);
    ``finish()`` the rest of the returned text. Also ``pieces()``: the returned text so
    far as ("mark", special token text) and ("text", str) pieces (``chat_parse``'s form)."""

    def __init__(self, tokenizer, strings=(), end_ids=()):
        self.tokenizer = tokenizer
        self.end_ids = frozenset(int(i) for i in end_ids)   # end the text, not part of it
        # an empty string matches nothing here (the front ends refuse it:
        # ``settings.stop_strings_problem``)
        self.strings = tuple(s.encode("utf-8") for s in strings if s)
        # bytes a stop string could still be starting in: never released early
        self.hold = max((len(s) for s in self.strings), default=1) - 1
        # id -> text, read at the first token (a lazy tokenizer stays unread when none is)
        self.specials = None
        self.done: list = []          # finished pieces: ("mark", text) | ("text", str)
        self.run = bytearray()        # bytes of the ordinary tokens since the last special
        self.sent = 0                 # of them, passed through ``utf8`` to the stream
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.ready: list = []         # final text not yet handed out by ``take``
        self.stopped = False

    def feed(self, tok: int) -> bool:
        """Add a generated token; True when it completes a stop string or is an end id
        (then it adds no text)."""
        if self.stopped:
            raise ValueError("a stop string already ended this text")
        if int(tok) in self.end_ids:
            self._end_run()
            self.stopped = True
            return True
        if self.specials is None:
            self.specials = {i: t for t, i in self.tokenizer.special_ids.items()}
        name = self.specials.get(int(tok))
        if name is not None:
            self._end_run()
            self.done.append(("mark", name))
            self.ready.append(name)
            return False
        old = len(self.run)
        self.run += self.tokenizer.token_bytes(tok)
        # only a match ending in the new bytes can be new (an earlier one would have
        # stopped the text already); the earliest start among them ends the text
        starts = [i for s in self.strings
                  if (i := self.run.find(s, max(0, old - len(s) + 1))) >= 0]
        if starts:
            del self.run[min(starts):]
            self.stopped = True
        return self.stopped

    def _end_run(self) -> None:
        """A special token ends the run: its text is final."""
        if self.run:
            self.done.append(("text", bytes(self.run).decode("utf-8", "replace")))
        self.ready.append(self.utf8.decode(bytes(self.run[self.sent:]), final=True))
        self.run = bytearray()
        self.sent = 0

    def take(self) -> str:
        """The text that became final since the last call: all but the run's last
        ``hold`` bytes (a stop string may still start there; none held once stopped),
        never half a UTF-8 character."""
        end = len(self.run) if self.stopped else max(self.sent, len(self.run) - self.hold)
        self.ready.append(self.utf8.decode(bytes(self.run[self.sent:end]), final=False))
        self.sent = end
        out, self.ready = "".join(self.ready), []
        return out

    def finish(self) -> str:
        """The rest of the returned text (generation has ended)."""
        self.ready.append(self.utf8.decode(bytes(self.run[self.sent:]), final=True))
        self.sent = len(self.run)
        out, self.ready = "".join(self.ready), []
        return out

    def pieces(self) -> list:
        """The returned text so far as pieces: finished ones, then the current run."""
        tail = [("text", bytes(self.run).decode("utf-8", "replace"))] if self.run else []
        return self.done + tail


def returned_text(tokenizer, ids, strings, end_ids=()) -> str:
    """The text a finished generation of ``ids`` returns under stop ``strings`` (the
    module's rule): the decoded ids, ending where the first stop string starts or at an
    id of ``end_ids`` (left out)."""
    return "".join(text for _, text in returned_pieces(tokenizer, ids, strings, end_ids))


def returned_pieces(tokenizer, ids, strings, end_ids=()) -> list:
    """The same as ("mark", special token text) and ("text", str) pieces, runs of
    ordinary tokens decoded together: what ``chat_parse.parse_reply`` reads."""
    st = StopText(tokenizer, strings, end_ids)
    for tok in ids:
        if st.feed(tok):
            break
    return st.pieces()


class Stops:
    """One sequence's stop rules, applied after each generated token (``generate``, the
    lockstep): ``see(token)`` gives why to stop, "stop_id" or "stop_string", else None.
    The length limit is the caller's. With a grammar matcher (structured output), its end
    tokens are stop ids too (the mask allows them only once the output is complete)."""

    def __init__(self, settings, tokenizer, grammar=None):
        self.ids = settings.stop_ids if grammar is None else \
            tuple(dict.fromkeys(tuple(settings.stop_ids) + tuple(grammar.end_ids)))
        self.text = StopText(tokenizer, settings.stop_strings) if settings.stop_strings \
            else None

    def see(self, tok: int):
        if tok in self.ids:
            return "stop_id"
        if self.text is not None and self.text.feed(tok):
            return "stop_string"
        return None
