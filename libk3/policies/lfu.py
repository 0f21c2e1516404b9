"""Full-history LFU: the perfect-frequency reference, replayed and run as a shadow.

Owns: the LFU state and steps. Every request of a key counts, from the start of the
trace (evicted keys keep their counts); on a miss with a full cache, evict the resident
key with the fewest requests, ties to the least recent. Under independent requests this
keeps the most popular keys, the best an online policy can do there. Like every online
policy here it never evicts a key requested in the current layer visit while another key
is resident (k3-run computes a layer from all of its experts at once): those keys leave
the heap when requested and return when the visit ends. O(log slots) per request.

state: (kv, hv, sc)
  kv (n_keys, 5) int64   per key: requests, time of the last request, heap position
                         (-1 outside the heap), visit id of the last request, slot
  hv (3, slots) int64    min-heap of evictable residents by (requests, last request);
                         the current visit's resident keys, oldest first; key per slot
  sc int64               heap size, visit keys, used slots, slots, clock, current
                         layer, visit id, n_experts
"""

from __future__ import annotations

import numpy as np
from numba import njit

_COUNT, _LAST, _HPOS, _VISIT, _SLOT = range(5)
_HEAP, _VIS, _KEY = range(3)
_HSIZE, _NVIS, _USED, _SLOTS, _CLOCK, _CUR, _VISIT_ID, _NE = range(8)


@njit(cache=True, nogil=True)
def new(n_layers, n_experts, slots):
    kv = np.full((n_layers * n_experts, 5), -1, np.int64)
    kv[:, _COUNT] = 0
    hv = np.full((3, max(slots, 1)), -1, np.int64)
    sc = np.zeros(8, np.int64)
    sc[_SLOTS] = max(slots, 0)
    sc[_CUR] = -1
    sc[_NE] = n_experts
    return kv, hv, sc


@njit(cache=True, nogil=True, inline='always')
def _less(kv, a, b):
    return kv[a, _COUNT] < kv[b, _COUNT] or (kv[a, _COUNT] == kv[b, _COUNT]
                                             and kv[a, _LAST] < kv[b, _LAST])


@njit(cache=True, nogil=True)
def _sift(kv, heap, p, size):
    """Move heap[p] up or down to its place."""
    k = heap[p]
    while p > 0:
        q = (p - 1) >> 1
        if not _less(kv, k, heap[q]):
            break
        heap[p] = heap[q]
        kv[heap[p], _HPOS] = p
        p = q
    while True:
        c = 2 * p + 1
        if c >= size:
            break
        if c + 1 < size and _less(kv, heap[c + 1], heap[c]):
            c += 1
        if not _less(kv, heap[c], k):
            break
        heap[p] = heap[c]
        kv[heap[p], _HPOS] = p
        p = c
    heap[p] = k
    kv[k, _HPOS] = p


@njit(cache=True, nogil=True, inline='always')
def _heap_push(kv, hv, sc, k):
    p = sc[_HSIZE]
    sc[_HSIZE] = p + 1
    hv[_HEAP, p] = k
    _sift(kv, hv[_HEAP], p, p + 1)


@njit(cache=True, nogil=True, inline='always')
def _heap_remove(kv, hv, sc, k):
    p = kv[k, _HPOS]
    kv[k, _HPOS] = -1
    last = sc[_HSIZE] - 1
    sc[_HSIZE] = last
    if p != last:
        hv[_HEAP, p] = hv[_HEAP, last]
        kv[hv[_HEAP, p], _HPOS] = p
        _sift(kv, hv[_HEAP], p, last)


@njit(cache=True, nogil=True)
def lookup(st, key):
    """Record a request: -> the key's slot or -1. A new layer ends the visit: its keys
    return to the heap."""
    kv, hv, sc = st
    L = key // sc[_NE]
    if L != sc[_CUR]:
        for i in range(sc[_NVIS]):
            _heap_push(kv, hv, sc, hv[_VIS, i])
        sc[_NVIS] = 0
        sc[_CUR] = L
        sc[_VISIT_ID] += 1
    kv[key, _COUNT] += 1
    kv[key, _LAST] = sc[_CLOCK]
    sc[_CLOCK] += 1
    s = kv[key, _SLOT]
    if s >= 0 and kv[key, _VISIT] != sc[_VISIT_ID]:
        _heap_remove(kv, hv, sc, key)
        hv[_VIS, sc[_NVIS]] = key
        sc[_NVIS] += 1
    kv[key, _VISIT] = sc[_VISIT_ID]
    return s


@njit(cache=True, nogil=True, inline='always')
def holds(st, key):
    return st[0][key, _SLOT] >= 0


@njit(cache=True, nogil=True)
def admit(st, key):
    """Place a missing key (call lookup first): a free slot, else evict the evictable
    key with the fewest requests (ties: least recent); the oldest key of the current
    visit only when every resident belongs to it. -> (slot, evicted key or -1)."""
    kv, hv, sc = st
    if sc[_SLOTS] == 0:
        return -1, -1
    evicted = -1
    if sc[_USED] < sc[_SLOTS]:
        s = sc[_USED]
        sc[_USED] += 1
    else:
        if sc[_HSIZE] > 0:
            evicted = hv[_HEAP, 0]
            _heap_remove(kv, hv, sc, evicted)
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


@njit(cache=True, nogil=True)
def simulate(keys, n_layers, n_experts, slots):
    """Replay keys: -> hits."""
    st = new(n_layers, n_experts, slots)
    hits = 0
    for i in range(keys.size):
        if lookup(st, keys[i]) >= 0:
            hits += 1
        else:
            admit(st, keys[i])
    return hits
