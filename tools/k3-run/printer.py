"""k3-run's text on stdout as it is generated.

Owns: writing each token as it becomes final under the stop rule (``Printer``: a prompt's
raw text, markup included, as scripts read it), and a chat turn's reply as the reader of
the server's streams sees it (``ReplyPrinter``). Does not own: the stop rule itself
(``libk3.engine.stops``), reading the reply's channels (``libk3.engine.replies`` over
``libk3.text.chat_parse``) or the run report.
"""

from __future__ import annotations

import sys

THINKING = "thinking: "      # opens a run of reasoning on stderr


class Printer:
    """Writes each token to stdout as it is produced: its text as it becomes final under
    the stop rule (``libk3.engine.stops``: a UTF-8 character is never split, a stop
    string or the token that ends it by its id never shown), or ids when there is no
    tokenizer."""

    def __init__(self, tokenizer, stop_strings=(), end_ids=()):
        from libk3.engine.stops import StopText
        self.text = StopText(tokenizer, stop_strings, end_ids) if tokenizer is not None \
            else None

    def __call__(self, tok):
        if self.text is None:
            sys.stdout.write(f"{tok} ")
        elif not self.text.stopped:
            self.text.feed(tok)
            sys.stdout.write(self.text.take())
        sys.stdout.flush()

    def finish(self):
        if self.text is not None:
            sys.stdout.write(self.text.finish())
        sys.stdout.write("\n")
        sys.stdout.flush()


class ReplyPrinter:
    """A chat turn's reply as it is generated, read from its channels by the server's
    stream reader (``ReplyReader``: a tag still being written waits, markup is never
    text): the content on stdout, the reasoning on stderr after ``thinking: `` (stdout
    keeps only the answer, as for every note), each tool call on stdout as a line
    ``tool call NAME(ARGUMENTS)``, the arguments as the model wrote them."""

    def __init__(self, tokenizer, stop_strings=()):
        from libk3.engine.replies import ReplyReader
        self.reader = ReplyReader(tokenizer, True, stop_strings)
        self.ids: list = []
        self.thinking = False           # a run of reasoning is open on stderr
        self.line_start = True          # stdout's cursor is at the start of a line
        self.wrote = False              # anything on stdout yet (every reply ends a line)

    def __call__(self, tok):
        self.ids.append(int(tok))
        self._show(self.reader.delta(self.ids))

    def finish(self):
        self._show(self.reader.delta(self.ids, cut=True))
        self._end_thinking()
        if not self.line_start or not self.wrote:
            sys.stdout.write("\n")
        sys.stdout.flush()

    def _show(self, delta: dict) -> None:
        if delta.get("reasoning_content"):
            if not self.thinking:
                sys.stderr.write(THINKING)
                self.thinking = True
            sys.stderr.write(delta["reasoning_content"])
            sys.stderr.flush()
        if delta.get("content"):
            self._end_thinking()
            self._out(delta["content"])
        for call in delta.get("tool_calls", ()):
            self._end_thinking()
            if not self.line_start:
                self._out("\n")
            fn = call["function"]
            self._out(f"tool call {fn['name']}({fn['arguments']})\n")
        sys.stdout.flush()

    def _end_thinking(self) -> None:
        if self.thinking:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.thinking = False

    def _out(self, text: str) -> None:
        sys.stdout.write(text)
        self.wrote = True
        self.line_start = text.endswith("\n")
