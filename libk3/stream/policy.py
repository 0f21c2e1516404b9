"""Online eviction policies for the expert cache, as k3-run drives them.

Owns: adapting the online policy objects of ``libk3.policies`` (each policy's module, the
same numba code the offline replay runs, so replayed hit rates are what k3-run gets) to the cache's
needs: ``access(keys)`` for one layer visit, refusing loudly if a policy ever evicted a
key the visit already placed. Does not own: the slots' bytes, the policies' names or the
default (``libk3.policies.registry``).

The policy never changes results, only which bytes are read again: k3-run's output is
the same for every policy (tested).
"""

from __future__ import annotations

import numpy as np

from ..policies.online import evicts_its_own_batch, make_cache_policy
from ..errors import UsageError
from ..policies.registry import ONLINE_OBJECT_POLICIES


class CachePolicy:
    def __init__(self, name: str, n_slots: int, n_layers: int, n_experts: int):
        if name not in ONLINE_OBJECT_POLICIES:
            raise UsageError(f"unknown cache policy {name!r}",
                             hint=f"choose one of {', '.join(ONLINE_OBJECT_POLICIES)}")
        self.name = name
        self._p = make_cache_policy(name, n_slots, n_layers=n_layers, n_experts=n_experts)

    def access(self, keys) -> list:
        """-> [[slot, evicted key or -1, hit 0/1]] per key of one layer visit, in order."""
        keys = np.asarray(keys, dtype=np.int64)
        out = self._p.access(keys)
        i = evicts_its_own_batch(keys, out)
        if i >= 0:
            # the policies guarantee this cannot happen for batches <= slots (tested);
            # if it did, two experts of one batch would share a slot: refuse loudly.
            raise RuntimeError(f"cache policy {self.name} evicted expert key {out[i, 1]} "
                               "that the current batch is using")
        return out.tolist()


def make_policy(name: str, n_slots: int, n_layers: int, n_experts: int) -> CachePolicy:
    return CachePolicy(name, n_slots, n_layers, n_experts)
