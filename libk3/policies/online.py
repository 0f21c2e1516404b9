"""The online expert-cache policy object k3-run's cache drives, and its guards.

Owns: ``OnlinePolicy`` (one object per cache: the numba state of a policy declared
``live`` in ``libk3.policies.registry`` and one call per layer visit) and ``evicts_its_own_batch``, the check that
a visit never evicted a key it already placed. Does not own: the step functions (one
module per policy here in ``libk3.policies``), replaying (``libk3.trace.replay``, which
drives the same step functions), or the cache's bytes (``libk3.stream.experts``).

The online policies never bypass (k3-run must hold every expert of the layer it
computes) and never evict a key requested in the current layer visit while another key
is resident.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..errors import UsageError
from . import drive
from .registry import ONLINE_OBJECT_POLICIES, load


class OnlinePolicy:
    """What k3-run's expert cache drives, one object per cache.

    ``access(keys)`` takes the keys of one layer visit (``layer * n_experts + expert``)
    and processes them in order, each looked up and, on a miss, admitted; it returns,
    per key, its slot, the key its admission evicted (-1 for none) and whether it hit.
    One numba call per visit, its call overhead shared by the visit's top_k keys.
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
        self._mod = load(name)
        # slots past one per key are never used (no eviction): the state is sized by both
        used = min(self.slots, self.n_keys)
        self._state = self._mod.live_state(self.n_layers, self.n_experts, used)

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

    def _shadowed(self, what):
        f = getattr(self._mod, what, None) if self._mod.POLICY.shadows else None
        return None if f is None else f(self._state)

    @property
    def leader(self):
        """A policy with shadows (adaptive): the one the cache follows now (else None)."""
        return self._shadowed("leader")

    @property
    def shadow_misses(self):
        """A policy with shadows: {shadow: its misses so far} (else None)."""
        return self._shadowed("shadow_misses")

    @property
    def switches(self):
        """A policy with shadows: how many times the leader changed (else None)."""
        return self._shadowed("switches")


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
