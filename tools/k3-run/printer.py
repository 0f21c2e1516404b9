"""k3-run's text on stdout as it is generated.

Owns: writing each token as it becomes final under the stop rule. Does not own: the stop
rule itself (``libk3.engine.stops``) or the run report.
"""

from __future__ import annotations

import sys


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
