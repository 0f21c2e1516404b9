"""Reuse of earlier turns: states of conversations already run, found by their token ids.

Owns: keeping copies of sequence states keyed by the ids they hold, in RAM up to a byte
budget and then on disk (state files, formats/state.md) up to another, least recently
used first out; and finding, for a new prompt, the kept state whose ids are the longest
strict prefix of it (formats/chat.md "Reuse of earlier turns"). Does not own: when
states are offered or taken (the server's worker), or the forward.

Why results are identical to a fresh prefill: a state holds exactly what persists
between tokens (spec section 6), and the forward gives byte-identical logits whether a
sequence is fed at once, in chunks, or resumed from a saved state (invariant 2, tested).
Why a strict prefix: the last prompt token must be fed to give the logits of the first
generated token.
"""

from __future__ import annotations

import collections
import itertools
import os
import tempfile

from ..errors import K3Error


class TurnCache:
    """Kept states of the weights whose identity is ``weights_identity`` (what a spilled
    state file records and is checked against). ``ram_bytes`` bounds the copies held in
    memory, ``disk_bytes`` those written to ``disk_dir`` (a private temporary directory
    when None); 0 disables a tier. ``stats`` counts lookups, hits and the prompt tokens
    reused."""

    def __init__(self, cfg, weights_identity: str, ram_bytes: int, disk_bytes: int = 0,
                 disk_dir=None):
        self.cfg = cfg
        self.weights_identity = weights_identity
        self.ram_bytes, self.disk_bytes = ram_bytes, disk_bytes
        self._dir = disk_dir
        self._tmp = None
        self._names = itertools.count()
        # key (tuple of ids) -> ("ram", State, nbytes) | ("disk", path, nbytes); LRU first
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self.stats = {"lookups": 0, "hits": 0, "reused_tokens": 0}

    def _used(self, tier: str) -> int:
        return sum(e[2] for e in self._entries.values() if e[0] == tier)

    def take(self, prompt_ids):
        """(state, n): a fresh copy of the kept state whose ids are the longest strict
        prefix of ``prompt_ids`` and n its length; (None, 0) when none is."""
        self.stats["lookups"] += 1
        prompt = tuple(prompt_ids)
        best = max((k for k in self._entries
                    if len(k) < len(prompt) and prompt[:len(k)] == k), key=len, default=None)
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        tier, value, _ = self._entries[best]
        if tier == "ram":
            state = value.copy()
        else:
            from ..model.state import State
            try:
                state = State.load(self.cfg, value, self.weights_identity)
            except (K3Error, OSError):        # a spilled file gone bad: forget it
                self._drop(best)
                return None, 0
        self.stats["hits"] += 1
        self.stats["reused_tokens"] += len(best)
        return state, len(best)

    def offer(self, state) -> None:
        """Keep a copy of ``state`` (keyed by its ids), evicting as the budgets require."""
        key = tuple(state.ids)
        if not key or (self.ram_bytes <= 0 and self.disk_bytes <= 0):
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        copy = state.copy()
        self._entries[key] = ("ram", copy, copy.nbytes())
        self._fit()

    def _fit(self) -> None:
        """Spill least recently used RAM entries to disk, then drop what still overflows."""
        for key in list(self._entries):
            if self._used("ram") <= self.ram_bytes:
                break
            tier, state, size = self._entries[key]
            if tier != "ram":
                continue
            if size <= self.disk_bytes:
                path = os.path.join(self._disk(), f"turn-{next(self._names)}.k3state")
                try:
                    state.save(path, self.weights_identity)
                    self._entries[key] = ("disk", path, os.path.getsize(path))
                    continue
                except (K3Error, OSError):
                    pass
            del self._entries[key]
        for key in list(self._entries):
            if self._used("disk") <= self.disk_bytes:
                break
            if self._entries[key][0] == "disk":
                self._drop(key)

    def summary(self) -> dict:
        """``stats`` plus the entries and bytes kept in each tier."""
        tiers = [e[0] for e in self._entries.values()]
        return {**self.stats, "ram_entries": tiers.count("ram"),
                "disk_entries": tiers.count("disk"), "ram_bytes": self._used("ram"),
                "disk_bytes": self._used("disk")}

    def _drop(self, key) -> None:
        tier, value, _ = self._entries.pop(key)
        if tier == "disk":
            try:
                os.unlink(value)
            except OSError:
                pass

    def _disk(self) -> str:
        if self._dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="k3-turns-")
            self._dir = self._tmp.name
        return self._dir

    def close(self) -> None:
        for key in list(self._entries):
            self._drop(key)
        if self._tmp is not None:
            self._tmp.cleanup()
