"""The routed-expert cache: packed MXFP4 experts read on demand into fixed slots.

Owns: the slot arena sized by the cache budget, batched fetches of one layer's selected
experts (hits served from slots, misses read in parallel by a thread pool in (shard,
offset) order into page-aligned windows, O_DIRECT where possible), and the counters.
Does not own: which expert to evict (a policy object, ``libk3.stream.policy``) or any
arithmetic: experts stay packed and the kernels multiply from the nibbles.

Slot size = the aligned window any expert run can need (run + up to 2 pages), so one
read lands an expert whatever its offset. A fetch never hands out a slot that another
expert of the same batch is using: batches are at most ``slots`` experts and the policy
never evicts a key its visit already placed (``libk3.stream.policy`` checks).
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


class ExpertCache:
    def __init__(self, cfg, table, budget: int, files: FileSet, io_threads: int,
                 policy: str = DEFAULT_POLICY):
        self.cfg = cfg
        self.table = table                         # libk3.io.checkpoint.ExpertTable
        self.files = files
        self.expert_bytes = cfg.expert_bytes
        self.slot_bytes = window_bytes(self.expert_bytes)
        self.n_slots = budget // self.slot_bytes
        need = cfg.num_experts_per_token + 1
        if self.n_slots < need:
            raise BudgetError("expert cache budget holds fewer than top_k + 1 experts",
                              expected=f">= {need * self.slot_bytes} bytes ({need} slots)",
                              found=f"{budget} bytes",
                              hint="raise --cache-gb to at least "
                                   + gb_option(need * self.slot_bytes))
        self.arena = aligned_empty(self.n_slots * self.slot_bytes)
        self.base = np.zeros(self.n_slots, np.int64)      # payload offset inside the slot
        self.slot_key = np.full(self.n_slots, -1, np.int64)
        self.policy = make_policy(policy, self.n_slots, cfg.num_hidden_layers, cfg.num_experts)
        self.pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="k3-expert-io")
        self.io_threads = io_threads
        self.broken = None
        all_shapes = inventory.expert_shapes(cfg)
        self.part_shapes = [all_shapes[k] for k in names.EXPERT_PARTS]
        self.stats = {"requests": 0, "hits": 0, "misses": 0, "evictions": 0, "bytes_read": 0,
                      "read_seconds": 0.0, "max_in_flight": 0}

    @property
    def max_batch(self) -> int:
        return self.n_slots

    def key(self, L: int, e: int) -> int:
        return L * self.cfg.num_experts + e

    def _views(self, L: int, e: int, slot: int) -> tuple:
        start = slot * self.slot_bytes + int(self.base[slot])
        out = []
        for k in range(6):
            sub = int(self.table.part_offset[L, e, k])
            nb = int(self.table.part_nbytes[L, e, k])
            out.append(self.arena[start + sub: start + sub + nb].reshape(self.part_shapes[k]))
        return tuple(out)

    def _read_into(self, L: int, e: int, slot: int) -> int:
        path = self.table.paths[int(self.table.shard[L, e])]
        buf = self.arena[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]
        f = self.files.get(path)
        with self.files.gate.urgent(f.drives):   # the layer waits for these: they go first
            return f.read_window(int(self.table.offset[L, e]), int(self.table.nbytes[L, e]),
                                 buf, what=f"layer {L} expert {e}")

    def start(self, L: int, ids):
        """Begin fetching the distinct experts ``ids`` (at most max_batch): hits are
        resolved now, misses get their slots reserved and their reads submitted to the
        I/O pool in (shard, offset) order. Returns a handle for ``finish``; the caller
        computes meanwhile (the shared expert, the latent down-projection)."""
        if self.broken is not None:
            raise self.broken
        ids = [int(e) for e in ids]
        assert len(ids) <= self.n_slots
        keys = [self.key(L, e) for e in ids]
        where, misses = {}, []
        for e, k, (s, evicted, hit) in zip(ids, keys, self.policy.access(keys)):
            self.stats["requests"] += 1
            where[e] = s
            if hit:
                self.stats["hits"] += 1
                continue
            if evicted >= 0:
                self.stats["evictions"] += 1
            self.slot_key[s] = k
            misses.append((e, k))
        order = sorted(misses, key=lambda ek: (int(self.table.shard[L, ek[0]]),
                                               int(self.table.offset[L, ek[0]])))
        t0 = time.perf_counter()
        futs = [(where[e], self.pool.submit(self._read_into, L, e, where[e])) for e, _ in order]
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"],
                                          min(len(futs), self.io_threads))
        return (L, ids, where, futs, t0)

    def finish(self, handle) -> dict:
        """Wait for a ``start``'s reads; {e: six packed arrays}. A failed read invalidates
        its slot and is raised after every read has landed."""
        L, ids, where, futs, t0 = handle
        failed = None
        for s, f in futs:
            try:
                self.base[s] = f.result()
            except BaseException as exc:
                failed = failed or exc
        if failed is not None:
            # the policy believes the expert is resident: the cache can no longer be
            # trusted, so every later fetch refuses (k3-run exits on the first failure)
            self.broken = failed
            raise failed
        if futs:
            self.stats["read_seconds"] += time.perf_counter() - t0
            self.stats["misses"] += len(futs)
            self.stats["bytes_read"] += len(futs) * self.expert_bytes
        return {e: self._views(L, e, where[e]) for e in ids}

    def fetch(self, L: int, ids) -> dict:
        """{e: six packed arrays} for the distinct experts ``ids`` (at most max_batch)."""
        return self.finish(self.start(L, ids))

    def close(self) -> None:
        self.pool.shutdown(wait=True)
