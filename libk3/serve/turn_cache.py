"""Reuse of earlier turns: states of conversations already run, found by their token ids.

Owns: keeping copies of sequence states keyed by the ids they hold, in RAM up to a byte
budget, least recently used first out (spilled to the prefix cache on disk when the
server has one), and finding, for a new prompt, the kept state whose ids are the longest
strict prefix of it, in RAM first, then on disk (formats/chat.md "Reuse of earlier
turns"). Does not own: when states are offered or taken (the server's worker), the
snapshot files (``libk3.engine.prefix_cache``), or the forward.

Why results are identical to a fresh prefill: a state holds exactly what persists
between tokens (spec section 6), and the forward gives byte-identical logits whether a
sequence is fed at once, in chunks, or resumed from a saved state (invariant 2, tested).
Why a strict prefix: the last prompt token must be fed to give the logits of the first
generated token.
"""

from __future__ import annotations

import collections


class TurnCache:
    """Kept states: ``ram_bytes`` bounds the copies held in memory (0: none);
    ``prefix_cache`` (a PrefixCache, or None) is the disk tier: what RAM lets go is
    written there, ``keep`` writes there at once, and a lookup that RAM cannot answer
    well is asked there. ``stats`` counts lookups, hits and the prompt tokens reused."""

    def __init__(self, cfg, ram_bytes: int, prefix_cache=None):
        self.cfg = cfg
        self.ram_bytes = ram_bytes
        self.disk = prefix_cache
        # key (tuple of ids) -> (State, nbytes); least recently used first
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self.stats = {"lookups": 0, "hits": 0, "disk_hits": 0, "reused_tokens": 0}

    def _used(self) -> int:
        return sum(e[1] for e in self._entries.values())

    def take(self, prompt_ids):
        """(state, n): a fresh copy of the kept state whose ids are the longest strict
        prefix of ``prompt_ids`` and n its length; (None, 0) when none is."""
        self.stats["lookups"] += 1
        prompt = tuple(int(i) for i in prompt_ids)
        best = max((k for k in self._entries
                    if len(k) < len(prompt) and prompt[:len(k)] == k), key=len, default=())
        state, n = None, 0
        if self.disk is not None and len(prompt) - 1 > len(best):
            state, n = self.disk.lookup(prompt, limit=len(prompt) - 1, above=len(best))
            if state is not None:
                self.stats["disk_hits"] += 1
        if state is None and best:
            self._entries.move_to_end(best)
            state, n = self._entries[best][0].copy(), len(best)
        if state is None:
            return None, 0
        self.stats["hits"] += 1
        self.stats["reused_tokens"] += n
        return state, n

    def offer(self, state) -> None:
        """Keep a copy of ``state`` (keyed by its ids) in RAM, spilling the least recently
        used to disk as the budget requires."""
        key = tuple(state.ids)
        if not key:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if self.ram_bytes <= 0:
            if self.disk is not None:
                self.disk.store(state)
            return
        copy = state.copy()
        self._entries[key] = (copy, copy.nbytes())
        while self._used() > self.ram_bytes:
            _, (old, _) = self._entries.popitem(last=False)
            if self.disk is not None:
                self.disk.store(old)

    def keep(self, state) -> None:
        """Keep ``state`` in RAM and at once on disk: a prefix worth surviving a restart
        (a conversation's preamble)."""
        self.offer(state)
        if self.disk is not None:
            self.disk.store(state)

    def summary(self) -> dict:
        """``stats`` plus the entries and bytes kept in RAM, and the prefix cache's."""
        return {**self.stats, "ram_entries": len(self._entries), "ram_bytes": self._used(),
                "prefix_cache": None if self.disk is None else self.disk.summary()}

    def close(self) -> None:
        self._entries.clear()
