"""How much of a buffer being filled holds its final bytes: a read marks its units (pieces
that landed, runs of blocks that were decoded) as they complete, in any order, and a
consumer waits until the bytes it needs are in.

Owns: the ready prefix and waiting on it. Does not own: the reads (``piece_reader``) or
what the bytes mean (``trunk``).

Why a prefix: a layer run is stored in computation order (formats/pack.md), so the forward
asks for its tensors in about the order they land; waiting for the prefix that covers a
tensor lets it compute on the first tensors while the later ones are still being read.
"""

from __future__ import annotations

import math
import threading


class Landing:
    """Units ``0..n-1`` cover the buffer up to ``ends[k]`` (increasing); ``ready`` is
    where the longest prefix of completed units ends."""

    def __init__(self):
        self._cond = threading.Condition()
        self._ends: list = []
        self._done: list = []
        self._next = 0            # the first unit not yet done
        self.ready = 0
        self._error = None

    def plan(self, ends) -> None:
        """The units' ends in buffer order (before any is marked)."""
        with self._cond:
            self._ends, self._done = [int(e) for e in ends], [False] * len(ends)

    def mark(self, k: int) -> None:
        """Unit k's bytes are final."""
        with self._cond:
            self._done[k] = True
            while self._next < len(self._done) and self._done[self._next]:
                self.ready = self._ends[self._next]
                self._next += 1
            self._cond.notify_all()

    def finish(self) -> None:
        """Every byte is final (the read ended, including any check of the whole)."""
        with self._cond:
            self.ready = math.inf
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The read failed: waiters for bytes not yet ready raise ``error``."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def wait(self, end: int) -> None:
        """Return once the bytes before ``end`` are final; raise the read's error if it
        failed first."""
        with self._cond:
            while self.ready < end:
                if self._error is not None:
                    raise self._error
                self._cond.wait()
