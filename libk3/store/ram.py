"""The store's RAM tier: copies of states keyed by the ids they hold, least recently used
first out.

Owns: the copies, their bytes, the limit (a byte budget, a count of states, or both) and
which prefix of a prompt the tier holds longest. Does not own: where what it lets go
goes (``tiers``), or the states' contents (``libk3.model.state``).
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class Held:
    """One state in RAM: the copy, its bytes, and whether the disk tier has it already
    (then letting it go writes nothing)."""
    state: object
    nbytes: int
    on_disk: bool = False


class RamTier:
    """States in RAM within ``limit_bytes`` (None: no byte limit) and ``limit_states``
    (None: no count limit); a limit of 0 holds nothing."""

    def __init__(self, limit_bytes: int | None = None, limit_states: int | None = None):
        self.limit_bytes, self.limit_states = limit_bytes, limit_states
        self._held: collections.OrderedDict = collections.OrderedDict()   # LRU first

    @property
    def holds_any(self) -> bool:
        """Whether the tier can hold a state at all."""
        return self.limit_bytes != 0 and self.limit_states != 0

    def used(self) -> int:
        return sum(h.nbytes for h in self._held.values())

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key) -> bool:
        return key in self._held

    def longest(self, prompt: tuple, limit: int) -> tuple:
        """The key of the longest held state whose ids are a prefix of ``prompt`` at most
        ``limit`` long; () when none is."""
        return max((k for k in self._held if len(k) <= limit and prompt[:len(k)] == k),
                   key=len, default=())

    def get(self, key):
        """The held state of ``key``, marked as just used."""
        self._held.move_to_end(key)
        return self._held[key].state

    def mark_on_disk(self, key, on_disk: bool = True) -> None:
        self._held[key].on_disk = on_disk

    def last(self):
        """The state used last, or None."""
        return next(reversed(self._held.values())).state if self._held else None

    def put(self, state, on_disk: bool = False) -> list:
        """Hold ``state`` (the caller's copy, not changed after this); -> the Held let go
        to stay within the limits, least recently used first (never ``state`` itself
        unless it alone is over the limits)."""
        key = tuple(state.ids)
        self._held[key] = Held(state, state.nbytes(), on_disk)
        self._held.move_to_end(key)
        out = []
        while self._held and self._over():
            _, old = self._held.popitem(last=False)
            out.append(old)
        return out

    def _over(self) -> bool:
        return (self.limit_bytes is not None and self.used() > self.limit_bytes) or \
            (self.limit_states is not None and len(self._held) > self.limit_states)

    def clear(self) -> None:
        self._held.clear()
