"""LRU (least recently used), and the pinned-hottest + LRU offline bound.

Owns: the LRU state and steps (an intrusive list over slots, head = most recent, and a
key -> slot map) and the pin+LRU simulator. With more slots than one layer visit's
experts, LRU never evicts a key requested in the current visit (they are the most
recent), which k3-run needs.

state: (sl, kv, sc); sl[s] = [prev, next, key] int32; kv (n_keys, KEY_COLUMNS) int32
holds each key's slot (-1: not resident); sc = [head, tail, used, slots] int64
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .lists import KEY, push_front, unlink
from .registry import PolicyInfo

POLICY = PolicyInfo(name="lru", online=True, live=True, rank=10, state_parts=3, cost=1,
                    summary="least recently used (the C engine's v1.0 policy)")


KEY_COLUMNS = 1


@njit(cache=True, nogil=True)
def new_on(kv, slots):
    """A state over the per-key array kv (n_keys, KEY_COLUMNS) int32, which may be a view
    into a block shared with other policies (``libk3.policies.adaptive``)."""
    kv[:, 0] = -1
    sl = np.full((max(slots, 1), 3), -1, np.int32)
    sc = np.array([-1, -1, 0, max(slots, 0)], np.int64)
    return sl, kv, sc


@njit(cache=True, nogil=True)
def new(n_keys, slots):
    return new_on(np.empty((n_keys, KEY_COLUMNS), np.int32), slots)


@njit(cache=True, nogil=True, inline='always')
def lookup(st, key):
    """Record a request: -> the key's slot (now most recent) or -1."""
    sl, kv, sc = st
    s = kv[key, 0]
    if s >= 0 and sc[0] != s:
        unlink(sl, sc, 0, s)
        push_front(sl, sc, 0, s)
    return s


@njit(cache=True, nogil=True, inline='always')
def holds(st, key):
    return st[1][key, 0] >= 0


@njit(cache=True, nogil=True, inline='always')
def admit(st, key):
    """Place a missing key in a free slot, else the least recent one. -> (slot, evicted
    key or -1); (-1, -1) when there are no slots."""
    sl, kv, sc = st
    if sc[3] == 0:
        return -1, -1
    evicted = -1
    if sc[2] < sc[3]:
        s = sc[2]
        sc[2] += 1
    else:
        s = sc[1]
        unlink(sl, sc, 0, s)
        evicted = sl[s, KEY]
        kv[evicted, 0] = -1
    sl[s, KEY] = key
    kv[key, 0] = s
    push_front(sl, sc, 0, s)
    return s, evicted



def resident(st, slots):
    """(slots,) int64: the key held by each slot, -1 for a never-used slot."""
    return st[0][:slots, KEY].astype(np.int64)


@njit(cache=True, nogil=True)
def simulate_pin_lru(keys, slots, n_keys, pinned, n_pinned):
    """pinned: (n_keys,) bool with n_pinned <= slots True. A pinned key is read on its
    first request (a miss) and then stays; the others share slots - n_pinned under LRU.
    Nothing pinned is plain LRU (same speed: 10M requests in 0.24 s either way)."""
    st = new(n_keys, slots - n_pinned)
    seen = np.zeros(n_keys, np.bool_)
    hits = 0
    for i in range(keys.size):
        k = keys[i]
        if pinned[k]:
            if seen[k]:
                hits += 1
            else:
                seen[k] = True
        elif lookup(st, k) >= 0:
            hits += 1
        else:
            admit(st, k)
    return hits


def replay(rk, slots):
    """-> (hits, {}): plain LRU is pin+lru with nothing pinned."""
    return simulate_pin_lru(rk.keys, slots, rk.n_keys, np.zeros(rk.n_keys, np.bool_), 0), {}


def live_state(n_layers, n_experts, slots):
    return new(n_layers * n_experts, slots)
