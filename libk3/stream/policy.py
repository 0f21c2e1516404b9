"""Online eviction policies for the expert cache, as k3-run drives them.

Owns: adapting the online policy objects of ``libk3.cache_policy`` (the same numba code
the offline replay runs, so replayed hit rates are what k3-run gets) to the cache's
needs: ``lookup(key) -> slot or -1``, ``admit(key, protected) -> (slot, evicted or -1)``
that never evicts an expert of the batch being fetched. Does not own: the slots' bytes.

The policy never changes results, only which bytes are read again: k3-run's output is
the same for every policy (tested).
"""

from __future__ import annotations

from ..cache_policy import ONLINE_OBJECT_POLICIES, make_cache_policy
from ..errors import UsageError

# layer-lfu beat LRU on every capacity of traces recorded from k3-run (bench/perf.py
# policy: e.g. 49.9 % vs 47.0 % live hit rate on `medium`, 50.3 vs 53.2 MB/token read);
# LRU stays selectable with --cache-policy lru.
DEFAULT_POLICY = "layer-lfu"


class CachePolicy:
    def __init__(self, name: str, n_slots: int, n_layers: int, n_experts: int):
        if name not in ONLINE_OBJECT_POLICIES:
            raise UsageError(f"unknown cache policy {name!r}",
                             hint=f"choose one of {', '.join(ONLINE_OBJECT_POLICIES)}")
        self.name = name
        self._p = make_cache_policy(name, n_slots, n_layers=n_layers, n_experts=n_experts)

    def lookup(self, key: int) -> int:
        return self._p.lookup(key)

    def admit(self, key: int, protected=()) -> tuple:
        slot, evicted = self._p.admit(key)
        if evicted >= 0 and evicted in protected:
            # the policies guarantee this cannot happen for batches <= slots (tested);
            # if it did, two experts of one batch would share a slot: refuse loudly.
            raise RuntimeError(f"cache policy {self.name} evicted expert key {evicted} "
                               "that the current batch is using")
        return slot, evicted


def make_policy(name: str, n_slots: int, n_layers: int, n_experts: int) -> CachePolicy:
    return CachePolicy(name, n_slots, n_layers, n_experts)
