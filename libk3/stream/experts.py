"""The routed-expert cache: packed MXFP4 experts read on demand into fixed slots, and
predicted experts read ahead into staging slots.

Owns: the slot arena sized by the cache budget, batched fetches of one layer's selected
experts (hits served from slots, misses read in parallel by a thread pool in (shard,
offset) order into page-aligned windows, O_DIRECT where possible), the read-ahead of a
layer's predicted experts (``prefetch``) and the counters. Does not own: which expert to
evict (a policy object, ``libk3.stream.policy``), what is predicted (``libk3.model.predict``)
or any arithmetic: experts stay packed and the kernels multiply from the nibbles.

Slot size = the aligned window any expert run can need (run + up to 2 pages), so one
read lands an expert whatever its offset. A fetch never hands out a slot that another
expert of the same batch is using: batches are at most ``slots`` experts and the policy
never evicts a key its visit already placed (``libk3.stream.policy`` checks).

Read-ahead (formats/trace.md, "Predictions", has its offline twin): ``prefetch_slots`` of the
budget's slots are staging slots outside the policy's reach, so a guess never evicts
anything the cache holds. A policy slot names a physical slot (``phys``); when the real
router asks for a predicted expert the policy misses as it would have, and the staging
slot holding the guess is swapped in for the policy's slot instead of reading (no copy).
A guess the router did not take is cancelled if its read has not started, else its bytes
are wasted; it never changes which bytes a layer computes with.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import names
from ..errors import BudgetError
from ..io import inventory
from ..policies.registry import DEFAULT_POLICY
from ..io.direct import FileSet, aligned_empty, window_bytes
from ..units import gb_option
from .policy import make_policy

PREFETCH_STATS = ("prefetch_predictions", "prefetch_predicted", "prefetch_hits",
                  "prefetch_reads", "prefetch_used", "prefetch_cancelled",
                  "prefetch_bytes_wasted")


class ExpertCache:
    def __init__(self, cfg, table, budget: int, files: FileSet, io_threads: int,
                 policy: str = DEFAULT_POLICY, prefetch: int = 0):
        self.cfg = cfg
        self.table = table                         # libk3.io.checkpoint.ExpertTable
        self.files = files
        self.expert_bytes = cfg.expert_bytes
        self.slot_bytes = window_bytes(self.expert_bytes)
        total = budget // self.slot_bytes
        need = cfg.num_experts_per_token + 1
        if total < need:
            raise BudgetError("expert cache budget holds fewer than top_k + 1 experts",
                              expected=f">= {need * self.slot_bytes} bytes ({need} slots)",
                              found=f"{budget} bytes",
                              hint="raise --cache-gb to at least "
                                   + gb_option(need * self.slot_bytes))
        # staging slots come out of the budget, never below what a layer needs to compute
        self.prefetch_slots = max(0, min(int(prefetch), total - need))
        self.n_slots = total - self.prefetch_slots
        self.arena = aligned_empty(total * self.slot_bytes)
        self.base = np.zeros(total, np.int64)            # payload offset inside each slot
        self.phys = np.arange(self.n_slots, dtype=np.int64)   # policy slot -> arena slot
        self.slot_key = np.full(self.n_slots, -1, np.int64)
        self.key_slot = np.full(cfg.num_hidden_layers * cfg.num_experts, -1, np.int64)
        self._spare = [(p, None) for p in range(self.n_slots, total)]  # (slot, last read)
        self._ahead_layer, self._ahead = None, {}   # the pending guess: e -> (slot, read)|None
        self.policy = make_policy(policy, self.n_slots, cfg.num_hidden_layers, cfg.num_experts)
        self.pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="k3-expert-io")
        self.io_threads = io_threads
        self.broken = None
        all_shapes = inventory.expert_shapes(cfg)
        self.part_shapes = [all_shapes[k] for k in names.EXPERT_PARTS]
        self.stats = {"requests": 0, "hits": 0, "misses": 0, "evictions": 0, "bytes_read": 0,
                      "read_seconds": 0.0, "wait_seconds": 0.0, "max_in_flight": 0,
                      "prefetch_slots": self.prefetch_slots, **dict.fromkeys(PREFETCH_STATS, 0)}

    @property
    def max_batch(self) -> int:
        return self.n_slots

    def key(self, L: int, e: int) -> int:
        return L * self.cfg.num_experts + e

    def _views(self, L: int, e: int, slot: int) -> tuple:
        p = int(self.phys[slot])
        start = p * self.slot_bytes + int(self.base[p])
        out = []
        for k in range(6):
            sub = int(self.table.part_offset[L, e, k])
            nb = int(self.table.part_nbytes[L, e, k])
            out.append(self.arena[start + sub: start + sub + nb].reshape(self.part_shapes[k]))
        return tuple(out)

    def _read_into(self, L: int, e: int, p: int, urgent: bool = True) -> int:
        """Read expert (L, e) into arena slot ``p``; -> where its run starts in the slot."""
        path = self.table.paths[int(self.table.shard[L, e])]
        buf = self.arena[p * self.slot_bytes:(p + 1) * self.slot_bytes]
        f = self.files.get(path)
        if not urgent:                       # a guess: the trunk read-ahead need not yield
            return f.read_window(int(self.table.offset[L, e]), int(self.table.nbytes[L, e]),
                                 buf, what=f"layer {L} expert {e}")
        with self.files.gate.urgent(f.drives):   # the layer waits for these: they go first
            return f.read_window(int(self.table.offset[L, e]), int(self.table.nbytes[L, e]),
                                 buf, what=f"layer {L} expert {e}")

    def _in_order(self, L: int, ids) -> list:
        return sorted(ids, key=lambda e: (int(self.table.shard[L, e]),
                                          int(self.table.offset[L, e])))

    # ---- read-ahead of predicted experts ---------------------------------------------
    def prefetch(self, L: int, ids) -> None:
        """Begin reading the predicted experts ``ids`` of layer L (best first; at most
        ``prefetch_slots`` are taken) into staging slots, in the background. Experts the
        cache holds are only counted. An earlier guess not yet routed is given up."""
        self._retire()
        if self.prefetch_slots == 0 or self.broken is not None:
            return
        ids = list(dict.fromkeys(int(e) for e in ids))[:self.prefetch_slots]
        self.stats["prefetch_predictions"] += 1
        self.stats["prefetch_predicted"] += len(ids)
        self._ahead_layer = L
        self._ahead = {e: None for e in ids}
        for e in self._in_order(L, [e for e in ids if self.key_slot[self.key(L, e)] < 0]):
            p = self._take_spare()
            self._ahead[e] = (p, self.pool.submit(self._read_into, L, e, p, False))
            self.stats["prefetch_reads"] += 1

    def _take_spare(self) -> int:
        """A staging slot no read is landing in; failing that (every spare slot holds a
        given-up guess still in flight), the oldest, once its read is over."""
        for i, (p, last) in enumerate(self._spare):
            if last is None or last.done():
                return self._spare.pop(i)[0]
        p, last = self._spare.pop(0)
        _settle(last)
        return p

    def _retire(self) -> None:
        """Give up what is left of the pending guess: unstarted reads are
        cancelled, started ones count as wasted bytes; their slots become spare."""
        for e in list(self._ahead):
            got = self._ahead.pop(e)
            if got is None:
                continue
            p, fut = got
            if fut.cancel():
                self.stats["prefetch_cancelled"] += 1
                self._spare.append((p, None))
            else:
                self.stats["prefetch_bytes_wasted"] += self.expert_bytes
                self.stats["bytes_read"] += self.expert_bytes
                self._spare.append((p, fut))
        self._ahead_layer = None

    # ---- fetching what the router chose ----------------------------------------------
    def start(self, L: int, ids):
        """Begin fetching the distinct experts ``ids`` (at most max_batch): hits are
        resolved now, misses get their slots reserved and their reads submitted to the
        I/O pool in (shard, offset) order (or take over the staging slot their predicted
        read lands in). A guess for a later layer is kept for it. Returns a handle for ``finish``; the caller computes meanwhile
        (the shared expert, the latent down-projection)."""
        if self.broken is not None:
            raise self.broken
        ids = [int(e) for e in ids]
        assert len(ids) <= self.n_slots
        if self._ahead_layer is not None and self._ahead_layer < L:
            self._retire()                   # a stale guess (a pass that stopped early)
        ahead = self._ahead if self._ahead_layer == L else {}
        keys = [self.key(L, e) for e in ids]
        where, misses, futs = {}, [], []
        for e, k, (s, evicted, hit) in zip(ids, keys, self.policy.access(keys)):
            self.stats["requests"] += 1
            where[e] = s
            guess = ahead.pop(e, None) if e in ahead else False
            if guess is not False:
                self.stats["prefetch_hits"] += 1
            if hit:
                self.stats["hits"] += 1
                if guess:                    # cannot happen (a guess is never resident)
                    self._spare.append(guess)
                continue
            if evicted >= 0:
                self.stats["evictions"] += 1
                self.key_slot[evicted] = -1
            self.slot_key[s] = k
            self.key_slot[k] = s
            if guess:                        # the guess's slot becomes the policy's slot
                self._spare.append((int(self.phys[s]), None))
                self.phys[s] = guess[0]
                futs.append(guess)
                self.stats["prefetch_used"] += 1
            else:
                misses.append(e)
        if self._ahead_layer == L and len(ids) < self.n_slots:
            self._retire()                   # the layer's last batch: the rest was wrong
        t0 = time.perf_counter()
        futs += [(int(self.phys[where[e]]), self.pool.submit(
            self._read_into, L, e, int(self.phys[where[e]]))) for e in self._in_order(L, misses)]
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"],
                                          min(len(futs), self.io_threads))
        return (L, ids, where, futs, t0)

    def finish(self, handle) -> dict:
        """Wait for a ``start``'s reads; {e: six packed arrays}. A failed read invalidates
        its slot and is raised after every read has landed."""
        L, ids, where, futs, t0 = handle
        failed = None
        t_wait = time.perf_counter()
        for p, f in futs:
            try:
                self.base[p] = f.result()
            except BaseException as exc:
                failed = failed or exc
        if failed is not None:
            # the policy believes the expert is resident: the cache can no longer be
            # trusted, so every later fetch refuses (k3-run exits on the first failure)
            self.broken = failed
            raise failed
        if futs:
            now = time.perf_counter()
            self.stats["wait_seconds"] += now - t_wait
            self.stats["read_seconds"] += now - t0
            self.stats["misses"] += len(futs)
            self.stats["bytes_read"] += len(futs) * self.expert_bytes
        return {e: self._views(L, e, where[e]) for e in ids}

    def fetch(self, L: int, ids) -> dict:
        """{e: six packed arrays} for the distinct experts ``ids`` (at most max_batch)."""
        return self.finish(self.start(L, ids))

    def close(self) -> None:
        self._retire()
        self.pool.shutdown(wait=True)


def _settle(fut) -> None:
    """Wait for a given-up read (its error, if any, concerns bytes nobody uses)."""
    try:
        fut.result()
    except Exception:
        pass
