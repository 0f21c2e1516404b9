"""The state store: states kept in RAM, then on disk, and the one lookup for a prompt.

Owns: tier 1, states in RAM (``ram``), least recently used out within the run's budget
for them (``libk3.budget.store``); tier 2, the prefix cache on disk (a ``PrefixCache``,
formats/prefix-cache.md, shared between processes), which what RAM lets go spills to,
written inline or by the writer thread (``writer``); and ``take``, the one lookup: the
kept state whose ids are the longest strict prefix of a prompt, RAM first, then disk
when disk may hold a longer one. Does not own: when states are offered, kept or taken
(the engine core at admission, as each ``core.Request`` asks), the snapshot files
(``libk3.engine.prefix_cache``), or the forward.

Why results are identical to a fresh prefill: a state holds exactly what persists
between tokens (model.md §6), and the forward gives byte-identical logits whether a
sequence is fed at once, in chunks, or resumed from a saved state (invariant 2, tested).
Why a strict prefix: the last prompt token must be fed to give the logits of the first
generated token.
Why a state holding image rows is never kept: its ids do not say which image it holds
(formats/model/vision.md §8.3); a prompt with images is resumed only from text before
the first (``take``'s ``limit``).
Why a disk hit is held in RAM too: the next prompt sharing it (a batch's lines after
their shared prefix, a conversation's next turn) then reads no disk.
"""

from __future__ import annotations

from .ram import RamTier
from .writer import Writer


class StateStore:
    """Kept states of one model: ``ram_bytes`` bounds the copies in RAM (0: none; None:
    no byte bound) and ``ram_states`` their count (None: no count bound); ``disk`` (a
    PrefixCache, or None) is tier 2. ``background``: disk writes go to the writer thread
    (a server; each queued state is a copy), else they are made inline. ``stats`` counts
    lookups, hits (and those from disk), the prompt tokens reused, writes dropped (the
    writer's queue full) and states refused for holding image rows."""

    def __init__(self, cfg, ram_bytes: int | None = 0, disk=None, *,
                 ram_states: int | None = None, background: bool = False):
        self.cfg = cfg
        self.disk = disk
        self.ram = RamTier(ram_bytes, ram_states)
        self.stats = {"lookups": 0, "hits": 0, "disk_hits": 0, "reused_tokens": 0,
                      "writes_dropped": 0, "image_states_refused": 0}
        self._writer = Writer(disk) if disk is not None and background else None

    def take(self, prompt_ids, limit: int | None = None):
        """(state, n): a fresh copy of the kept state whose ids are the longest strict
        prefix of ``prompt_ids`` at most ``limit`` long (a prompt's first image: only the
        text before it) and n its length; (None, 0) when none is. RAM wins a tie."""
        self.stats["lookups"] += 1
        prompt = tuple(int(i) for i in prompt_ids)
        cap = len(prompt) - 1 if limit is None else min(limit, len(prompt) - 1)
        best = self.ram.longest(prompt, cap)
        state, n = None, 0
        if self.disk is not None and cap > len(best):
            state, n = self.disk.lookup(prompt, limit=cap, above=len(best))
            if state is not None:
                self.stats["disk_hits"] += 1
                if self.ram.holds_any:
                    self._put(state, on_disk=True)
                    state = state.copy()
        if state is None and best:
            state, n = self.ram.get(best).copy(), len(best)
        if state is None:
            return None, 0
        self.stats["hits"] += 1
        self.stats["reused_tokens"] += n
        return state, n

    def hold(self, prompt_ids, limit: int, at_least: int = 0) -> int:
        """The length of the longest kept prefix of ``prompt_ids`` at most ``limit`` long,
        read into RAM when disk holds a longer one than RAM (not asked when RAM holds one
        of ``at_least``); nothing is copied (a batch's shared prefix, before its lines
        are admitted)."""
        prompt = tuple(int(i) for i in prompt_ids)
        n = len(self.ram.longest(prompt, limit))
        if self.disk is not None and self.ram.holds_any and n < min(at_least, limit):
            state, m = self.disk.lookup(prompt, limit=limit, above=n)
            if state is not None:
                self.stats["disk_hits"] += 1
                self._put(state, on_disk=True)
                n = m
        return n

    def offer(self, state) -> None:
        """Keep a copy of ``state`` (keyed by its ids) in RAM, spilling the least recently
        used to disk as the budget requires; with no RAM tier, straight to disk."""
        key = tuple(state.ids)
        if not key or self._refused(state):
            return
        if key in self.ram:
            self.ram.get(key)
            return
        if not self.ram.holds_any:
            self._write(state, own=False)
            return
        self._put(state.copy())

    def keep(self, state, copy: bool = True) -> None:
        """Keep ``state`` in RAM and at once on disk: a prefix worth surviving this
        process (a conversation's preamble, a batch's shared prefix, ``--save-prefix``).
        ``copy`` False: nothing changes ``state`` after this (a prompt-only request's
        last), so RAM holds it, not a copy."""
        key = tuple(state.ids)
        if not key or self._refused(state):
            return
        if self.ram.holds_any and key not in self.ram:
            self._put(state.copy() if copy else state)
        if key in self.ram:                  # the store's own copy, never changed
            self.ram.mark_on_disk(key, self._write(self.ram.get(key), own=True))
        else:
            self._write(state, own=False)

    def held(self):
        """The state in RAM used last, or None."""
        return self.ram.last()

    def _refused(self, state) -> bool:
        if state.media:
            self.stats["image_states_refused"] += 1
            return True
        return False

    def _put(self, state, on_disk: bool = False) -> None:
        """Put ``state`` (the store's own copy) in RAM; what RAM lets go goes to disk."""
        for old in self.ram.put(state, on_disk):
            if not old.on_disk:
                self._write(old.state, own=True)

    def _write(self, state, own: bool) -> bool:
        """``state`` to the disk tier: written now, or queued for the writer (a copy
        unless ``own``: the store's, which nothing changes); whether it went (False: no
        disk tier, or the writer's queue full)."""
        if self.disk is None:
            return False
        if self._writer is None:
            self.disk.store(state)
        elif not self._writer.put(state if own else state.copy()):
            self.stats["writes_dropped"] += 1
            return False
        return True

    def flush(self) -> None:
        """Wait until every snapshot queued so far is written."""
        if self._writer is not None:
            self._writer.flush()

    def summary(self) -> dict:
        """``stats`` plus the states and bytes held in RAM, and the disk tier's."""
        return {**self.stats, "ram_entries": len(self.ram), "ram_bytes": self.ram.used(),
                "prefix_cache": None if self.disk is None else self.disk.summary()}

    def close(self) -> None:
        """Finish the queued writes, then forget the RAM copies."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.ram.clear()
