"""Reuse of earlier turns: states of conversations already run, found by their token ids.

Owns: keeping copies of sequence states keyed by the ids they hold, in RAM up to a byte
budget, least recently used first out (spilled to the prefix cache on disk when the
server has one), and finding, for a new prompt, the kept state whose ids are the longest
strict prefix of it, in RAM first, then on disk (formats/chat.md "Reuse of earlier
turns"). Does not own: when states are offered or taken (the server's worker), the
snapshot files (``libk3.engine.prefix_cache``), or the forward.

Why results are identical to a fresh prefill: a state holds exactly what persists
between tokens (model.md §6), and the forward gives byte-identical logits whether a
sequence is fed at once, in chunks, or resumed from a saved state (invariant 2, tested).
Why a strict prefix: the last prompt token must be fed to give the logits of the first
generated token.
Why disk writes go to a thread of their own: a snapshot of a long K3 prefix is GBs, seconds
to write (bench/README.md "Prefix cache"); written on the engine thread it would stall
every request in flight. At most ``WRITES_QUEUED`` wait (each holds a state's memory);
one more is dropped, which costs only a later prefill.
"""

from __future__ import annotations

import collections
import queue
import threading

from ..budget import SERVER_SNAPSHOTS

WRITES_QUEUED = SERVER_SNAPSHOTS - 1     # and the one being written: what admission counts


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
        self.stats = {"lookups": 0, "hits": 0, "disk_hits": 0, "reused_tokens": 0,
                      "writes_dropped": 0}
        self._writes: queue.Queue = queue.Queue(WRITES_QUEUED)
        self._writer = None
        if prefix_cache is not None:
            self._writer = threading.Thread(target=self._write_loop, name="k3-snapshots",
                                            daemon=True)
            self._writer.start()

    def _used(self) -> int:
        return sum(e[1] for e in self._entries.values())

    def take(self, prompt_ids, limit: int | None = None):
        """(state, n): a fresh copy of the kept state whose ids are the longest strict
        prefix of ``prompt_ids`` (at most ``limit`` of them: a prompt's first image) and n
        its length; (None, 0) when none is."""
        self.stats["lookups"] += 1
        prompt = tuple(int(i) for i in prompt_ids)
        most = len(prompt) - 1 if limit is None else min(len(prompt) - 1, limit)
        best = max((k for k in self._entries
                    if len(k) <= most and prompt[:len(k)] == k), key=len, default=())
        state, n = None, 0
        if self.disk is not None and most > len(best):
            state, n = self.disk.lookup(prompt, limit=most, above=len(best))
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
        used to disk as the budget requires. A state holding an image's rows is not kept:
        its ids (pads) do not tell one image from another (formats/model/vision.md §8.3)."""
        key = tuple(state.ids)
        if not key or state.media:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if self.ram_bytes <= 0:
            self._store(state.copy())
            return
        copy = state.copy()
        self._entries[key] = (copy, copy.nbytes())
        while self._used() > self.ram_bytes:
            _, (old, _) = self._entries.popitem(last=False)
            self._store(old)

    def keep(self, state) -> None:
        """Keep ``state`` in RAM and at once on disk: a prefix worth surviving a restart
        (a conversation's preamble); not one holding an image's rows (``offer``)."""
        if state.media:
            return
        self.offer(state)
        key = tuple(state.ids)
        self._store(self._entries[key][0] if key in self._entries else state.copy())

    def _store(self, state) -> None:
        """Queue ``state`` (not changed after this) for the prefix cache's writer."""
        if self.disk is None:
            return
        try:
            self._writes.put_nowait(state)
        except queue.Full:
            self.stats["writes_dropped"] += 1

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            if isinstance(item, threading.Event):     # ``flush``: all before it written
                item.set()
                continue
            self.disk.store(item)

    def flush(self) -> None:
        """Wait until every snapshot queued so far is written."""
        if self._writer is not None:
            done = threading.Event()
            self._writes.put(done)
            done.wait()

    def summary(self) -> dict:
        """``stats`` plus the entries and bytes kept in RAM, and the prefix cache's."""
        return {**self.stats, "ram_entries": len(self._entries), "ram_bytes": self._used(),
                "prefix_cache": None if self.disk is None else self.disk.summary()}

    def close(self) -> None:
        """Finish the queued writes, then forget the RAM copies."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None
        self._entries.clear()
