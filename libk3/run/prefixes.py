"""Prefixes a batch file's prompts share: found, prefilled once, each prompt started from one.

Owns: finding, among the prompts a batch run will start, the longest prefix each shares
with another (whole prefill chunks, never the whole prompt), prefilling each such prefix
once (from the longest snapshot already at hand), and handing every prompt the state it
starts from; with a prefix cache (``libk3.engine.prefix_cache``) snapshots also come from
and go to disk, so the next run (another shard, the next cron tick) starts from them too.
Does not own: the snapshot files, the batch file, the scheduler.

Why whole chunks: the shared part of prompts that differ mid-chunk would be a new key for
every small edit; at chunk boundaries runs with edited tails still meet the same snapshots.
Why one snapshot in RAM: a batch's lines usually share one preamble; holding one is the
fixed overhead (docs/memory.md), others come from disk or are rebuilt.
Exact: the forward gives the same bytes however a sequence is split into passes
(formats/model/numerics.md), so a prompt resumed from a snapshot yields the same tokens and
logits as one prefilled whole (tested).
"""

from __future__ import annotations

import time

from ..engine.generate import Abandoned, prefill


def shared_lengths(prompts: list, chunk: int) -> list:
    """For each prompt (a list of ids) the longest prefix it shares with another, rounded
    down to whole ``chunk``s and kept short of the prompt's last id; 0 when that is less
    than one chunk. Sorting puts the prompt sharing most with each next to it."""
    n = len(prompts)
    order = sorted(range(n), key=lambda i: prompts[i])
    best = [0] * n
    for a, b in zip(order, order[1:]):
        common = _common(prompts[a], prompts[b])
        best[a], best[b] = max(best[a], common), max(best[b], common)
    out = []
    for p, s in zip(prompts, best):
        s = min(s, len(p) - 1) // chunk * chunk
        out.append(s if s >= chunk else 0)
    return out


def _common(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixStarts:
    """Where each prompt of a batch run starts. ``plan``: the (ids, shared length) of
    every prompt the run may start (``shared_lengths``); ``cache``: a PrefixCache or None.
    ``stats``: prefixes built and their tokens, prompts started from a snapshot and the
    prompt tokens not prefilled, seconds spent building."""

    def __init__(self, session, chunk: int, plan, cache=None, drafting=None,
                 should_stop=None, on_prefix=None):
        self.session, self.chunk, self.cache = session, chunk, cache
        self.drafting = drafting
        self.should_stop = should_stop
        self.on_prefix = on_prefix            # called (n tokens) before a prefix is built
        # every shared prefix of the run, by length: a prefix built on the way to a longer
        # one is kept (on disk) when another prompt needs it
        self.wanted = {tuple(ids[:s]) for ids, s in plan if s}
        self.held = None                      # the one snapshot kept in RAM
        self.stats = {"prefixes_built": 0, "prefix_tokens_built": 0, "prompts_resumed": 0,
                      "tokens_reused": 0, "build_seconds": 0.0, "load_seconds": 0.0}

    def start(self, ids, shared: int):
        """(state, n): a fresh state holding the first n ids of ``ids`` (n = 0: a new
        state), building the shared prefix of ``shared`` ids first if no snapshot holds
        it. Raises Abandoned when ``should_stop`` says so while building."""
        ids = [int(i) for i in ids]
        state, n = self._nearest(ids, len(ids) - 1)
        if shared > n:
            state, n = self._build(ids, shared, state, n), shared
        elif state is not None and state is self.held:
            state = state.copy()
        if n:
            self.stats["prompts_resumed"] += 1
            self.stats["tokens_reused"] += n
        return (state if state is not None else self.session.new_state()), n

    def _nearest(self, ids, limit: int):
        """The longest snapshot at hand of a prefix of ``ids`` at most ``limit`` long: the
        one in RAM or one on disk."""
        held = self.held
        n_held = held.pos if held is not None and held.pos <= limit and \
            held.ids == ids[:held.pos] else 0
        if self.cache is not None and limit > n_held:
            t0 = time.perf_counter()
            state, n = self.cache.lookup(ids, limit=limit, above=n_held)
            self.stats["load_seconds"] += time.perf_counter() - t0
            if n:                  # held from now on: the next line sharing it reads no disk
                self.held = state
                return state, n
        return (held, n_held) if n_held else (None, 0)

    def _build(self, ids, shared: int, start, n: int):
        """Prefill ids[n:shared] onto ``start`` (a copy of it, or a new state), stopping
        at each prefix another prompt wants to store it; keep the result in RAM."""
        t0 = time.perf_counter()
        if self.on_prefix is not None:
            self.on_prefix(shared - n)
        state = self.session.new_state() if start is None else \
            (start.copy() if start is self.held else start)
        stops = sorted({len(w) for w in self.wanted
                        if n < len(w) < shared and tuple(ids[:len(w)]) == w}) + [shared]
        spec = self.drafting.speculator() if self.drafting is not None else None
        for b in stops:
            for i in range(state.pos, b, self.chunk):
                if self.should_stop is not None and self.should_stop():
                    raise Abandoned()
                prefill(self.session.forward, state, ids[i:min(i + self.chunk, b)],
                        self.chunk, keep_logits=False,
                        observe=spec.observe if spec is not None else None)
            if self.cache is not None:
                self.cache.store(state)
        self.held = state
        self.stats["prefixes_built"] += 1
        self.stats["prefix_tokens_built"] += shared - n
        self.stats["build_seconds"] += time.perf_counter() - t0
        return state.copy()

    def summary(self) -> dict:
        out = {**self.stats, "build_seconds": round(self.stats["build_seconds"], 6),
               "load_seconds": round(self.stats["load_seconds"], 6)}
        if self.cache is not None:
            out["cache"] = self.cache.summary()
        return out
