"""Belady / OPT with bypass: the offline optimum every policy is measured against.

Owns: next-use indices of a key stream and the Belady simulator. On a miss, of the
residents and the incoming key, the one requested furthest in the future is not kept
(an indexed max-heap over slots keyed by next use: O(log slots) per request). An upper
bound on every policy here (tested: belady >= all).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .registry import PolicyInfo

POLICY = PolicyInfo(name="belady", online=False, rank=20, needs=("next_use",), cost=2,
                    summary="optimal offline with bypass (upper bound)")


@njit(cache=True, nogil=True)
def next_use_indices(keys, n_keys):
    """(n,) int64: next_use[i] = smallest j > i with keys[j] == keys[i], else n."""
    n = keys.size
    out = np.empty(n, np.int64)
    last = np.full(n_keys, n, np.int64)
    for i in range(n - 1, -1, -1):
        k = keys[i]
        out[i] = last[k]
        last[k] = i
    return out


@njit(cache=True, nogil=True)
def _maxheap_up(heap, hpos, prio, p):
    s = heap[p]
    while p > 0:
        q = (p - 1) >> 1
        if prio[heap[q]] >= prio[s]:
            break
        heap[p] = heap[q]
        hpos[heap[p]] = p
        p = q
    heap[p] = s
    hpos[s] = p


@njit(cache=True, nogil=True)
def _maxheap_down(heap, hpos, prio, p, size):
    s = heap[p]
    while True:
        c = 2 * p + 1
        if c >= size:
            break
        if c + 1 < size and prio[heap[c + 1]] > prio[heap[c]]:
            c += 1
        if prio[heap[c]] <= prio[s]:
            break
        heap[p] = heap[c]
        hpos[heap[p]] = p
        p = c
    heap[p] = s
    hpos[s] = p


@njit(cache=True, nogil=True)
def simulate(keys, next_use, slots, n_keys):
    n = keys.size
    if slots <= 0:
        return 0
    heap = np.empty(slots, np.int64)          # slots, the furthest next use on top
    hpos = np.empty(slots, np.int64)
    nu = np.empty(slots, np.int64)            # next use of the key in each slot
    key_of_slot = np.empty(slots, np.int64)
    slot_of_key = np.full(n_keys, -1, np.int64)
    size = 0
    hits = 0
    for i in range(n):
        k = keys[i]
        s = slot_of_key[k]
        if s >= 0:
            hits += 1
            nu[s] = next_use[i]               # later than before: towards the top
            _maxheap_up(heap, hpos, nu, hpos[s])
            continue
        if next_use[i] >= n:
            continue                          # never requested again: bypass
        if size < slots:
            s = size
            heap[size] = s
            size += 1
            key_of_slot[s] = k
            slot_of_key[k] = s
            nu[s] = next_use[i]
            _maxheap_up(heap, hpos, nu, size - 1)
        else:
            s = heap[0]
            if nu[s] <= next_use[i]:
                continue                      # bypass: the incoming key is needed last
            slot_of_key[key_of_slot[s]] = -1
            key_of_slot[s] = k
            slot_of_key[k] = s
            nu[s] = next_use[i]
            _maxheap_down(heap, hpos, nu, 0, size)
    return hits


def replay(rk, slots):
    return simulate(rk.keys, rk.next_use, slots, rk.n_keys), {}
