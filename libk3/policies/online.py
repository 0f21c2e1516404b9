"""The online expert-cache policy object k3-run's cache drives, and its guards.

Owns: ``OnlinePolicy`` (one object per cache: the numba state of ``lru``, ``layer-lfu``
or ``adaptive`` and one call per layer visit) and ``evicts_its_own_batch``, the check that
a visit never evicted a key it already placed. Does not own: the step functions (one
module per policy here in ``libk3.policies``), replaying (``libk3.trace.replay``, which
drives the same object for ``adaptive``), or the cache's bytes (``libk3.stream.experts``).

The online policies never bypass (k3-run must hold every expert of the layer it
computes) and never evict a key requested in the current layer visit while another key
is resident.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..errors import UsageError
from . import adaptive, drive, layer_lfu, lru
from .registry import ONLINE_OBJECT_POLICIES

_ONLINE_MODULES = {"lru": lru, "layer-lfu": layer_lfu, "adaptive": adaptive}


class OnlinePolicy:
    """What k3-run's expert cache drives, one object per cache.

    ``access(keys)`` takes the keys of one layer visit (``layer * n_experts + expert``)
    and processes them in order, each looked up and, on a miss, admitted; it returns,
    per key, its slot, the key its admission evicted (-1 for none) and whether it hit.
    One numba call per visit: about 5 us of call overhead for adaptive's state, shared
    by the visit's top_k keys.
    A key already processed in the visit is never evicted while any other key is
    resident, so with at least top_k + 1 slots all of a layer's experts stay resident
    while the layer computes; a key of the visit not yet processed may be evicted, and
    then misses (the replay counts it the same way). The object never affects what the
    model computes, only which experts are read again.
    """

    def __init__(self, name: str, slots: int, *, n_layers: int, n_experts: int):
        if name not in ONLINE_OBJECT_POLICIES:
            raise UsageError(f"cache policy {name!r} cannot drive a live cache",
                             expected=", ".join(ONLINE_OBJECT_POLICIES), found=name)
        if slots < 1:
            raise ValueError(f"a live cache needs at least one slot, got {slots}")
        self.name, self.slots = name, int(slots)
        self.n_layers, self.n_experts = int(n_layers), int(n_experts)
        self.n_keys = self.n_layers * self.n_experts
        self._mod = _ONLINE_MODULES[name]
        # slots past one per key are never used (no eviction): the state is sized by both
        used = min(self.slots, self.n_keys)
        if name == "lru":
            self._state = lru.new(self.n_keys, used)
        elif name == "layer-lfu":
            self._state = layer_lfu.new(self.n_layers, self.n_experts, used, 1,
                                        layer_lfu.HALF_LIFE_VISITS)
        else:
            self._state = adaptive.new(self.n_layers, self.n_experts, used)

    def access(self, keys) -> np.ndarray:
        """-> (n, 3) int64 rows [slot, evicted key or -1, 1 if hit], one per key."""
        keys = np.asarray(keys, dtype=np.int64)
        if not _in_range(keys, self.n_keys):
            raise ValueError(f"keys outside 0..{self.n_keys - 1}: {keys.tolist()}")
        out = np.empty((keys.size, 3), np.int64)
        drive.access(self._state, keys, out)
        return out

    def resident(self) -> np.ndarray:
        """(min(slots, n_keys),) int64: the key held by each slot (slots past one per key
        are never used), -1 for a never-used slot."""
        return self._mod.resident(self._state, min(self.slots, self.n_keys))

    @property
    def leader(self):
        """adaptive: the candidate policy the cache follows now (else None)."""
        return adaptive.leader(self._state) if self.name == "adaptive" else None

    @property
    def shadow_misses(self):
        """adaptive: {candidate: its shadow's misses so far} (else None)."""
        return adaptive.shadow_misses(self._state) if self.name == "adaptive" else None

    @property
    def switches(self):
        """adaptive: how many times the leader changed (else None)."""
        return adaptive.switches(self._state) if self.name == "adaptive" else None


@njit(cache=True, nogil=True)
def _in_range(keys, n_keys):
    for i in range(keys.size):
        if keys[i] < 0 or keys[i] >= n_keys:
            return False
    return True


@njit(cache=True, nogil=True)
def evicts_its_own_batch(keys, out):
    """The first i whose admission evicted one of keys[:i] (a key the batch already
    placed), else -1. The policies guarantee -1 for batches of at most ``slots`` keys."""
    for i in range(keys.size):
        ev = out[i, 1]
        if ev >= 0:
            for j in range(i):
                if keys[j] == ev:
                    return i
    return -1


def make_cache_policy(name: str, slots: int, *, n_layers: int, n_experts: int) -> OnlinePolicy:
    """The online policy object for k3-run's expert cache (names: ONLINE_OBJECT_POLICIES)."""
    return OnlinePolicy(name, slots, n_layers=n_layers, n_experts=n_experts)
