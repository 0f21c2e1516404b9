"""Prefixes a batch file's prompts share: found, and prefilled once into the state store.

Owns: finding, among the prompts a batch run will start, the longest prefix each shares
with another (whole prefill chunks, never the whole prompt), and making sure the run's
state store (``libk3.store``) holds each such prefix before a prompt sharing it is
admitted: read from disk, or prefilled once (a prompt-only request through the engine
core, from the longest prefix the store holds) and kept there, nested prefixes another
prompt wants on the way. Does not own: the store, its tiers and the lookup a prompt
starts from (the core's admission), the snapshot files, the batch file, the scheduler.

Why whole chunks: the shared part of prompts that differ mid-chunk would be a new key for
every small edit; at chunk boundaries runs with edited tails still meet the same snapshots.
Why one state in RAM: a batch's lines usually share one preamble; the store holds one
(``budget.BATCH_SNAPSHOTS``, docs/memory.md), others come from disk or are rebuilt.
Exact: the forward gives the same bytes however a sequence is split into passes
(formats/model/numerics.md), so a prompt resumed from a snapshot yields the same tokens and
logits as one prefilled whole (tested).
"""

from __future__ import annotations

import time

from ..budget import BATCH_SNAPSHOTS
from ..engine.core import Request
from ..engine.generate import GenSettings, run_requests
from ..store import StateStore


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
    """The shared prefixes of a batch run. ``plan``: the (ids, shared length) of every
    prompt the run may start (``shared_lengths``); ``cache``: the run's StateStore, or
    a PrefixCache (or None) for a store of its own holding one state in RAM. ``stats``:
    prefixes built and their tokens, seconds spent building and reading (the prompts
    resumed from them are counted by the core's admission: a batch run counts its
    finished lines)."""

    def __init__(self, session, chunk: int, plan, cache=None, drafting=None,
                 should_stop=None):
        self.session, self.chunk = session, chunk
        self.store = cache if isinstance(cache, StateStore) else \
            StateStore(session.cfg, None, cache, ram_states=BATCH_SNAPSHOTS)
        self.drafting = drafting
        self.should_stop = should_stop
        # every shared prefix of the run, by length: a prefix built on the way to a longer
        # one is kept (on disk) when another prompt needs it
        self.wanted = {tuple(ids[:s]) for ids, s in plan if s}
        self.stats = {"prefixes_built": 0, "prefix_tokens_built": 0, "build_seconds": 0.0,
                      "load_seconds": 0.0}

    def prepare(self, ids, shared: int) -> None:
        """Make sure the store holds the first ``shared`` ids of ``ids`` (or a longer
        prefix of them), building them if no snapshot does. Raises Abandoned when
        ``should_stop`` says so while building."""
        if not shared:
            return
        ids = [int(i) for i in ids]
        t0 = time.perf_counter()
        n = self.store.hold(ids, len(ids) - 1, at_least=shared)
        self.stats["load_seconds"] += time.perf_counter() - t0
        if shared > n:
            self._build(ids, shared, n)

    def _build(self, ids, shared: int, n: int) -> None:
        """Prefill ids[:shared] as a prompt-only request resumed from the store's ``n``
        ids, kept in the store at each prefix another prompt wants and at ``shared``."""
        t0 = time.perf_counter()
        stops = sorted({len(w) for w in self.wanted
                        if n < len(w) < shared and tuple(ids[:len(w)]) == w}) + [shared]
        run_requests(self.session.forward, lambda k: self.session.new_state(),
                     [Request(None, ids[:shared], GenSettings(gen=0, prefill_chunk=self.chunk),
                              reuse=True, store_at=tuple(stops))], 1,
                     chunk=self.chunk, should_stop=self.should_stop, drafting=self.drafting,
                     store=self.store)
        self.stats["prefixes_built"] += 1
        self.stats["prefix_tokens_built"] += shared - n
        self.stats["build_seconds"] += time.perf_counter() - t0

    def summary(self) -> dict:
        out = {**self.stats, "build_seconds": round(self.stats["build_seconds"], 6),
               "load_seconds": round(self.stats["load_seconds"], 6)}
        if self.store.disk is not None:
            out["cache"] = self.store.disk.summary()
        return out
