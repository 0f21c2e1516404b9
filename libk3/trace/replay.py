"""Replaying expert-cache policies offline over a key stream.

Owns: replaying a stream of expert keys (``layer * n_experts + expert``, int64, dense,
< n_layers * n_experts) against a cache of ``slots`` equal slots and counting hits, for
every policy declared in ``POLICIES`` (one at a time or a policy x capacity grid in threads). Does
not own: the policies themselves (``libk3.policies``, one module each, and
``libk3.policies.online``, the object k3-run drives), their names and the default
(``libk3.policies.registry``), reading traces (``libk3.trace.format``), the capacity ladder
and reports (``libk3.trace.report``), the cache's memory and I/O (``libk3.stream``).

Policies (hit = the key is resident when requested; every miss reads the expert once):
``lru``, ``s3fifo``, ``lfu`` (full history), ``layer-lfu`` and ``adaptive`` (which follows
the best of those four) are online; ``belady`` (the optimum) and ``pin+lru`` (the p most
requested keys of the whole trace pinned, p the best of a few fractions of the slots;
pinned keys' first requests are misses, fraction 0 is plain LRU) use the future and are bounds.

Why the replay is what k3-run sees: k3-run hands the cache one layer's experts at a time
and the online object processes them in order exactly as the replay does (lookup, and
admit on a miss; ``OnlinePolicy.access``), with the same numba step functions, so a
decode trace replays to the live cache's hits (tested).

Why numba, dense arrays and threads: a 10-million-request trace must replay every policy
at every ladder capacity in about a minute on a 2-core laptop. Simulators are
deterministic and single-threaded; independent (policy, capacity) replays run in
parallel threads (``nogil``), so results never depend on the thread count.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from ..policies import belady
from ..policies.registry import POLICIES, check_policy_names, load


class ReplayKeys:
    """A key stream plus what several replays share (next-use indices, hottest keys),
    computed once on first use."""

    def __init__(self, keys, *, n_layers: int, n_experts: int):
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if keys.ndim != 1:
            raise ValueError(f"keys must be 1-D, got shape {keys.shape}")
        self.n_layers, self.n_experts = int(n_layers), int(n_experts)
        self.n_keys = self.n_layers * self.n_experts
        if keys.size and (keys.min() < 0 or keys.max() >= self.n_keys):
            raise ValueError(f"keys outside 0..{self.n_keys - 1} "
                             f"(n_layers {n_layers} x n_experts {n_experts})")
        self.keys = keys
        self._next_use = None
        self._hot = None

    @property
    def next_use(self) -> np.ndarray:
        if self._next_use is None:
            self._next_use = belady.next_use_indices(self.keys, self.n_keys)
        return self._next_use

    @property
    def hottest(self) -> np.ndarray:
        """Requested keys, most requested first (ties: smaller key first)."""
        if self._hot is None:
            counts = np.bincount(self.keys, minlength=self.n_keys)
            order = np.argsort(-counts, kind="stable")
            self._hot = order[:int(np.count_nonzero(counts))]
        return self._hot

    def prepare(self, policies) -> None:
        """Compute the shared data the policies need (before replays run in threads)."""
        for need in sorted({n for p in policies for n in POLICIES[p].needs}):
            getattr(self, need)


def _row(policy: str, slots: int, n: int, hits: int, **extra) -> dict:
    return {"policy": policy, "slots": int(slots), "requests": n, "hits": hits,
            "misses": n - hits, "hit_rate": hits / n if n else 0.0, **extra}


def _run(rk: ReplayKeys, requested_slots: int, policy: str) -> dict:
    keys, n_keys = rk.keys, rk.n_keys
    # A cache with a slot for every key never evicts, under every policy here: simulating
    # n_keys slots gives exactly the hits of any larger count (10^12 slots, say) without
    # arrays sized by it. (pin+lru: every pin count ties, so the reported pin count is 0
    # either way.)
    slots = min(requested_slots, n_keys)
    check_policy_names([policy])
    hits, extra = load(policy).replay(rk, slots) if slots > 0 else (0, {})
    return _row(policy, requested_slots, int(keys.size), int(hits), **extra)


def replay(keys, slots: int, policy: str, *, n_layers: int, n_experts: int) -> dict:
    """Replay keys (layer * n_experts + expert) through one policy with ``slots`` slots.
    -> {policy, slots, requests, hits, misses, hit_rate (0..1)[, pinned][, followed,
    switches]}."""
    check_policy_names([policy])
    if slots < 0:
        raise ValueError(f"slots must be >= 0, got {slots}")
    rk = keys if isinstance(keys, ReplayKeys) else ReplayKeys(keys, n_layers=n_layers,
                                                               n_experts=n_experts)
    return _run(rk, int(slots), policy)


def replay_grid(keys, slots_list, policies, *, n_layers: int, n_experts: int,
                workers: int = 1) -> list:
    """Every policy at every slot count: a list of replay() dicts (policy-major, in the
    given orders) each with ``seconds`` (wall) and ``cpu_seconds`` (its thread's CPU) of
    replay time. ``workers`` threads run independent replays in parallel; results do not
    depend on it."""
    policies = check_policy_names(policies)
    rk = keys if isinstance(keys, ReplayKeys) else ReplayKeys(keys, n_layers=n_layers,
                                                               n_experts=n_experts)
    rk.prepare(policies)
    # a policy's shadows (adaptive's) are those policies replayed exactly: take their rows
    # from its rows
    shadow_of = {s: p for p in policies for s in POLICIES[p].shadows if s in policies}
    derived = set(shadow_of)
    jobs = [(p, int(s)) for p in policies if p not in derived for s in slots_list]

    def one(job):
        t0, c0 = time.perf_counter(), time.thread_time()
        row = _run(rk, job[1], job[0])
        row["seconds"] = time.perf_counter() - t0
        row["cpu_seconds"] = time.thread_time() - c0
        return row

    if workers <= 1:
        rows = [one(j) for j in jobs]
    else:
        # longest jobs first keeps both threads busy to the end
        order = sorted(range(len(jobs)), key=lambda i: -POLICIES[jobs[i][0]].cost)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            done = dict(zip(order, pool.map(one, [jobs[i] for i in order])))
        rows = [done[i] for i in range(len(jobs))]
    by = {(r["policy"], r["slots"]): r for r in rows}
    for p in derived:
        for s in slots_list:
            a = by[(shadow_of[p], int(s))]
            misses = a["shadow_misses"][p] if s > 0 else a["requests"]
            by[(p, int(s))] = _row(p, s, a["requests"], a["requests"] - misses,
                                   seconds=0.0, cpu_seconds=0.0, shadow_of=shadow_of[p])
    return [by[(p, int(s))] for p in policies for s in slots_list]
