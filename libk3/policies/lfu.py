"""Full-history LFU: the perfect-frequency reference, replayed and run as a shadow.

Owns: the LFU state and steps. Every request of a key counts, from the start of the
trace (evicted keys keep their counts); on a miss with a full cache, evict the resident
key with the fewest requests, ties to the one whose last request is oldest (by layer
visit, then the smaller key). Under independent requests this
keeps the most popular keys, the best an online policy can do there. Like every online
policy here it never evicts a key requested in the current layer visit while another key
is resident (k3-run computes a layer from all of its experts at once): those keys leave
the heap when requested and return when the visit ends. O(log slots) per request.

state: (kv, hv, hp, sc)
  kv (n_keys, 4) int32   per key: requests, visit id of the last request, heap
                         position (-1 outside the heap), slot (-1 not resident)
  hv (2, slots) int32    the current visit's resident keys, oldest first; key per slot
  hp (slots, 2) int64    min-heap of the evictable residents: [requests << 31 | last
                         visit, key] (the order is read from the heap rows alone)
  sc int64               heap size, visit keys, used slots, slots, current layer, visit
                         id, n_experts
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import drive
from .registry import PolicyInfo

POLICY = PolicyInfo(name="lfu", online=True, rank=50, state_parts=4, cost=3,
                    summary="full-history request counts (perfect-frequency reference)")

_COUNT, _VISIT, _HPOS, _SLOT = range(4)
_VIS, _KEY = range(2)
_HSIZE, _NVIS, _USED, _SLOTS, _CUR, _VISIT_ID, _NE = range(7)


KEY_COLUMNS = 4


@njit(cache=True, nogil=True)
def new_on(kv, n_experts, slots):
    """A state over the per-key array kv (n_keys, KEY_COLUMNS) int32, which may be a view
    into a block shared with other policies (``libk3.policies.adaptive``)."""
    kv[:, :] = -1
    kv[:, _COUNT] = 0
    hv = np.full((2, max(slots, 1)), -1, np.int32)
    hp = np.zeros((max(slots, 1), 2), np.int64)
    sc = np.zeros(7, np.int64)
    sc[_SLOTS] = max(slots, 0)
    sc[_CUR] = -1
    sc[_NE] = n_experts
    return kv, hv, hp, sc


@njit(cache=True, nogil=True)
def new(n_layers, n_experts, slots):
    return new_on(np.empty((n_layers * n_experts, KEY_COLUMNS), np.int32), n_experts, slots)


@njit(cache=True, nogil=True, inline='always')
def _before(hp, p, prio, key):
    """Is heap entry p less valuable than (prio, key)?"""
    return hp[p, 0] < prio or (hp[p, 0] == prio and hp[p, 1] < key)


@njit(cache=True, nogil=True)
def _place(kv, hp, p, size, prio, key):
    """Put (prio, key) at heap position p's place: up or down."""
    while p > 0:
        q = (p - 1) >> 1
        if not (prio < hp[q, 0] or (prio == hp[q, 0] and key < hp[q, 1])):
            break
        hp[p, 0], hp[p, 1] = hp[q, 0], hp[q, 1]
        kv[hp[p, 1], _HPOS] = p
        p = q
    while True:
        c = 2 * p + 1
        if c >= size:
            break
        if c + 1 < size and _before(hp, c + 1, hp[c, 0], hp[c, 1]):
            c += 1
        if not _before(hp, c, prio, key):
            break
        hp[p, 0], hp[p, 1] = hp[c, 0], hp[c, 1]
        kv[hp[p, 1], _HPOS] = p
        p = c
    hp[p, 0], hp[p, 1] = prio, key
    kv[key, _HPOS] = p


@njit(cache=True, nogil=True, inline='always')
def _heap_push(kv, hp, sc, k):
    p = sc[_HSIZE]
    sc[_HSIZE] = p + 1
    _place(kv, hp, p, p + 1, (np.int64(kv[k, _COUNT]) << 31) | kv[k, _VISIT], k)


@njit(cache=True, nogil=True, inline='always')
def _heap_remove(kv, hp, sc, k):
    p = kv[k, _HPOS]
    kv[k, _HPOS] = -1
    last = sc[_HSIZE] - 1
    sc[_HSIZE] = last
    if p != last:
        _place(kv, hp, p, last, hp[last, 0], hp[last, 1])


@njit(cache=True, nogil=True, inline='always')
def lookup(st, key):
    """Record a request: -> the key's slot or -1. A new layer ends the visit: its keys
    return to the heap."""
    kv, hv, hp, sc = st
    L = key // sc[_NE]
    if L != sc[_CUR]:
        for i in range(sc[_NVIS]):
            _heap_push(kv, hp, sc, hv[_VIS, i])
        sc[_NVIS] = 0
        sc[_CUR] = L
        sc[_VISIT_ID] = (sc[_VISIT_ID] + 1) & 0x7FFFFFFF     # kv holds int32
    kv[key, _COUNT] += 1
    s = kv[key, _SLOT]
    if s >= 0 and kv[key, _VISIT] != sc[_VISIT_ID]:
        _heap_remove(kv, hp, sc, key)
        hv[_VIS, sc[_NVIS]] = key
        sc[_NVIS] += 1
    kv[key, _VISIT] = sc[_VISIT_ID]
    return s


@njit(cache=True, nogil=True, inline='always')
def holds(st, key):
    return st[0][key, _SLOT] >= 0


@njit(cache=True, nogil=True, inline='always')
def admit(st, key):
    """Place a missing key (call lookup first): a free slot, else evict the evictable
    key with the fewest requests (ties: oldest last visit, smaller key); the oldest key of the current
    visit only when every resident belongs to it. -> (slot, evicted key or -1)."""
    kv, hv, hp, sc = st
    if sc[_SLOTS] == 0:
        return -1, -1
    evicted = -1
    if sc[_USED] < sc[_SLOTS]:
        s = sc[_USED]
        sc[_USED] += 1
    else:
        if sc[_HSIZE] > 0:
            evicted = hp[0, 1]
            _heap_remove(kv, hp, sc, evicted)
        else:
            evicted = hv[_VIS, 0]
            sc[_NVIS] -= 1
            hv[_VIS, :sc[_NVIS]] = hv[_VIS, 1:sc[_NVIS] + 1].copy()
        s = kv[evicted, _SLOT]
        kv[evicted, _SLOT] = -1
    kv[key, _SLOT] = s
    hv[_KEY, s] = key
    hv[_VIS, sc[_NVIS]] = key
    sc[_NVIS] += 1
    return s, evicted



def replay(rk, slots):
    return drive.hits(new(rk.n_layers, rk.n_experts, slots), rk.keys), {}
