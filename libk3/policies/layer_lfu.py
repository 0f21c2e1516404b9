"""layer-lfu: decayed per-visit frequency plus the distance to the key's layer's next visit.

Owns: the layer-lfu state and steps. p = a key's decayed share of its layer's visits
(half life ``HALF_LIFE_VISITS`` visits of that layer) estimates the chance that a visit
of its layer requests it. Layers are visited 0..n_layers-1 and around again, which is
known without seeing the future, so a resident key of layer L' cannot be requested
before dist(L') = ((L' - L - 1) mod n_layers) + 1 layer visits from the current layer L.
Evict the key with the largest expected number of layer visits to its next request,
dist(L') + n_layers * (1/p - 1) (geometric waiting after its first chance).

Why the distance term (measured with ``bench/replay.py``): LRU evicts exactly the keys
the cycle is about to revisit, so it is flat below one cycle of distinct keys. When every
step re-requests the same keys (full-recompute traces) every resident is "frequent" and
the distance term recovers most of the LRU-Belady gap; without it (plain decayed LFU,
``alpha=0``, kept for the tests' ablation) that trace replays like LRU.

Cost: O(log n_experts) per request (a min-heap per layer) plus a scan of n_layers
per-layer scores per miss. The current visit's keys are kept out of the heaps, so no key
requested in the current visit is evicted while any other key is resident.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import drive
from .lists import KEY, NEXT, PREV, push_front, unlink
from .registry import PolicyInfo

POLICY = PolicyInfo(name="layer-lfu", online=True, live=True, rank=60, state_parts=6, cost=10,
                    summary="decayed per-visit frequency + distance to the layer's "
                            "next visit in the cyclic layer order")

HALF_LIFE_VISITS = 4.0          # count half life in visits of a layer; 2, 4, 8 and 16 were
                                # tried on the first bench traces, 4 was never more than a
                                # few points below the best of them
_RESCALE = 2.0 ** 400           # rescale a layer's counts past this (exact)
_MIN_COUNT = 1e-300             # a count this small scores "never again"


# ======================================================================================
# Decayed count of key k at time t, the number of visits of its layer so far, counting
# each visit that requests k once:  C_k(t) = sum over those visits t_i of beta^(t - t_i),
# beta = 2^(-1/half life); p_k = (1 - beta) C_k(t) lies in (0, 1]. Stored scaled by the
# layer's clock, g_k = C_k(t) * scale_L with scale_L = 2^(t / half life), so a request
# adds scale_L to g_k (no exp or log per request: a log/exp form cost about a quarter of
# the replay time) and the order of a layer's keys never changes while they sit in its
# heap (the LRFU trick). When scale_L passes 2^400 the layer's scale and counts are
# divided by 2^400, exactly, keeping every order and every p.
#
# state (6 arrays, see the package docstring for why so few):
#   kk (n_keys, 4) int32   per key: [slot, heap position, last visit id, layer]
#   sl (slots, 3) int32    per slot: [prev, next, key]; prev/next link the current
#                          visit's resident keys, most recent first
#   si int64               [0:_SI_N] scalars, then hsize[n_layers]
#   ka (n_keys,) float64   g_k, the scaled decayed count of each key
#   fl float64             [2^(1/half life), 1 - beta], then scale[n_layers], then
#                          score[n_layers]: each layer's least valuable heap key's
#                          n_layers * (1/p - 1) + alpha * L (-inf for an empty heap); the
#                          alpha * L part becomes dist() in the victim scan. A linear scan
#                          of 93 contiguous scores per miss measured faster than a segment
#                          tree's two range queries.
#   hh (n_keys, 2) float64 layer L's min-heap of its evictable residents in rows
#                          L*n_experts .. L*n_experts + heap size - 1: [g_k, k] (a key's
#                          count does not change while it is in the heap)
# ======================================================================================

_K_SLOT, _K_HPOS, _K_VISIT, _K_LAYER = 0, 1, 2, 3
# si scalars: visit id, current layer, used slots, visit list head, visit list tail, ...
_S_VISIT, _S_CUR, _S_USED, _S_HEAD, _S_TAIL = 0, 1, 2, 3, 4
_S_NL, _S_NE, _S_SLOTS, _S_ALPHA = 5, 6, 7, 8
_SI_N = 9
_F_STEP, _F_OMB = 0, 1
_FL_N = 2


KEY_COLUMNS = 4


@njit(cache=True, nogil=True)
def new_on(kk, n_layers, n_experts, slots, alpha, half_life_visits):
    """A state over the per-key array kk (n_keys, KEY_COLUMNS) int32, which may be a view
    into a block shared with other policies (``libk3.policies.adaptive``)."""
    n_keys = n_layers * n_experts
    kk[:, :] = -1
    kk[:, _K_LAYER] = np.arange(n_keys) // n_experts
    sl = np.full((max(slots, 1), 3), -1, np.int32)
    si = np.zeros(_SI_N + n_layers, np.int64)
    si[_S_VISIT] = -1
    si[_S_CUR] = -1
    si[_S_HEAD] = -1
    si[_S_TAIL] = -1
    si[_S_NL] = n_layers
    si[_S_NE] = n_experts
    si[_S_SLOTS] = max(slots, 0)
    si[_S_ALPHA] = alpha
    ka = np.zeros(n_keys, np.float64)
    fl = np.full(_FL_N + 2 * n_layers, -np.inf, np.float64)
    fl[_F_STEP] = 2.0 ** (1.0 / half_life_visits)
    fl[_F_OMB] = 1.0 - 1.0 / fl[_F_STEP]
    fl[_FL_N:_FL_N + n_layers] = 1.0
    hh = np.zeros((n_keys, 2), np.float64)
    return kk, sl, si, ka, fl, hh


@njit(cache=True, nogil=True)
def new(n_layers, n_experts, slots, alpha, half_life_visits):
    return new_on(np.empty((n_layers * n_experts, KEY_COLUMNS), np.int32), n_layers,
                  n_experts, slots, alpha, half_life_visits)


@njit(cache=True, nogil=True)
def _place(kk, hh, base, p, size, val, key):
    """Put (val, key) at position p's place in the heap at rows base.. of hh: up or
    down. The heap rows hold their keys' counts, so ordering reads no other array."""
    while p > 0:
        q = (p - 1) >> 1
        if not (val < hh[base + q, 0] or (val == hh[base + q, 0] and key < hh[base + q, 1])):
            break
        hh[base + p, 0], hh[base + p, 1] = hh[base + q, 0], hh[base + q, 1]
        kk[int(hh[base + p, 1]), _K_HPOS] = p
        p = q
    while True:
        c = 2 * p + 1
        if c >= size:
            break
        if c + 1 < size and (hh[base + c + 1, 0] < hh[base + c, 0] or (
                hh[base + c + 1, 0] == hh[base + c, 0] and hh[base + c + 1, 1] < hh[base + c, 1])):
            c += 1
        if not (hh[base + c, 0] < val or (hh[base + c, 0] == val and hh[base + c, 1] < key)):
            break
        hh[base + p, 0], hh[base + p, 1] = hh[base + c, 0], hh[base + c, 1]
        kk[int(hh[base + p, 1]), _K_HPOS] = p
        p = c
    hh[base + p, 0], hh[base + p, 1] = val, key
    kk[int(key), _K_HPOS] = p


@njit(cache=True, nogil=True, inline='always')
def _heap_push(kk, si, ka, hh, key):
    L = kk[key, _K_LAYER]
    size = si[_SI_N + L]
    si[_SI_N + L] = size + 1
    _place(kk, hh, L * si[_S_NE], size, size + 1, ka[key], float(key))


@njit(cache=True, nogil=True, inline='always')
def _heap_remove(kk, si, hh, key):
    L = kk[key, _K_LAYER]
    base = L * si[_S_NE]
    p = kk[key, _K_HPOS]
    kk[key, _K_HPOS] = -1
    last = si[_SI_N + L] - 1
    si[_SI_N + L] = last
    if p != last:
        _place(kk, hh, base, p, last, hh[base + last, 0], hh[base + last, 1])


@njit(cache=True, nogil=True, inline='always')
def _score_set(si, hh, fl, L):
    """Refresh layer L's eviction score from its least valuable heap key."""
    n_layers, n_experts = si[_S_NL], si[_S_NE]
    if si[_SI_N + L] == 0:
        fl[_FL_N + n_layers + L] = -np.inf
    else:
        g = max(hh[L * n_experts, 0], _MIN_COUNT)         # 1/p = scale/(omb g)
        fl[_FL_N + n_layers + L] = (n_layers * (fl[_FL_N + L] / (fl[_F_OMB] * g) - 1.0)
                                    + si[_S_ALPHA] * L)


@njit(cache=True, nogil=True, inline='always')
def _victim_layer(si, fl):
    """The layer whose least valuable key has the largest expected number of visits to
    its next request, -1 if every heap is empty. With alpha = 1 the distance term is
    dist(L) = L - cur for L > cur and L - cur + n_layers for L <= cur (the score already
    holds + L; the common - cur is dropped); ties go to the first layer after cur."""
    n_layers, cur, alpha = si[_S_NL], si[_S_CUR], si[_S_ALPHA]
    base = _FL_N + n_layers
    best = -np.inf
    arg = -1
    for L in range(cur + 1, n_layers):
        if fl[base + L] > best:
            best = fl[base + L]
            arg = L
    wrap = alpha * n_layers
    for L in range(0, cur + 1):
        if fl[base + L] + wrap > best:
            best = fl[base + L] + wrap
            arg = L
    return arg


@njit(cache=True, nogil=True)
def _new_visit(st, L):
    """Layer L starts a visit: the previous visit's keys return to their heap."""
    kk, sl, si, ka, fl, hh = st
    old = si[_S_CUR]
    s = si[_S_HEAD]
    while s >= 0:
        nxt = sl[s, NEXT]
        _heap_push(kk, si, ka, hh, sl[s, KEY])
        sl[s, PREV] = -1
        sl[s, NEXT] = -1
        s = nxt
    si[_S_HEAD] = -1
    si[_S_TAIL] = -1
    if old >= 0:
        _score_set(si, hh, fl, old)
    si[_S_VISIT] = (si[_S_VISIT] + 1) & 0x7FFFFFFF      # kk holds int32
    si[_S_CUR] = L
    fl[_FL_N + L] *= fl[_F_STEP]              # the layer's clock ticks: older counts decay
    if fl[_FL_N + L] > _RESCALE:
        fl[_FL_N + L] /= _RESCALE
        base = L * si[_S_NE]
        for k in range(base, base + si[_S_NE]):
            ka[k] /= _RESCALE
        for p in range(si[_SI_N + L]):
            hh[base + p, 0] /= _RESCALE


@njit(cache=True, nogil=True, inline='always')
def lookup(st, key):
    """Record a request: -> the key's slot or -1. Counts the key once per visit of its
    layer and protects it (out of its heap) until the visit ends."""
    kk, sl, si, ka, fl, hh = st
    L = kk[key, _K_LAYER]
    if L != si[_S_CUR]:
        _new_visit(st, L)
    s = kk[key, _K_SLOT]
    if kk[key, _K_VISIT] != si[_S_VISIT]:
        kk[key, _K_VISIT] = si[_S_VISIT]
        ka[key] += fl[_FL_N + L]
        if s >= 0:                              # the current layer's tree leaf is
            _heap_remove(kk, si, hh, key)       # refreshed when admit needs it
            push_front(sl, si, _S_HEAD, s)
    elif s >= 0:
        unlink(sl, si, _S_HEAD, s)
        push_front(sl, si, _S_HEAD, s)
    return s


@njit(cache=True, nogil=True, inline='always')
def holds(st, key):
    return st[0][key, _K_SLOT] >= 0


@njit(cache=True, nogil=True, inline='always')
def admit(st, key):
    """Place a missing key (call lookup first): a free slot, else evict the unprotected key
    with the largest expected number of layer visits to its next request; a key of the
    current visit (the least recent) only when no other key is resident.
    -> (slot, evicted key or -1); (-1, -1) when there are no slots."""
    kk, sl, si, ka, fl, hh = st
    if si[_S_SLOTS] == 0:
        return -1, -1
    if kk[key, _K_LAYER] != si[_S_CUR] or kk[key, _K_VISIT] != si[_S_VISIT]:
        lookup(st, key)
    evicted = -1
    if si[_S_USED] < si[_S_SLOTS]:
        s = si[_S_USED]
        si[_S_USED] += 1
    else:
        _score_set(si, hh, fl, si[_S_CUR])
        Lv = _victim_layer(si, fl)
        if Lv >= 0:
            evicted = int(hh[Lv * si[_S_NE], 1])
            _heap_remove(kk, si, hh, evicted)
            _score_set(si, hh, fl, Lv)
            s = kk[evicted, _K_SLOT]
        else:
            s = si[_S_TAIL]
            evicted = sl[s, KEY]
            unlink(sl, si, _S_HEAD, s)
        kk[evicted, _K_SLOT] = -1
    sl[s, KEY] = key
    kk[key, _K_SLOT] = s
    push_front(sl, si, _S_HEAD, s)
    return s, evicted




def resident(st, slots):
    """(slots,) int64: the key held by each slot, -1 for a never-used slot."""
    return st[1][:slots, KEY].astype(np.int64)


def live_state(n_layers, n_experts, slots):
    return new(n_layers, n_experts, slots, 1, HALF_LIFE_VISITS)


def replay(rk, slots):
    return drive.hits(live_state(rk.n_layers, rk.n_experts, slots), rk.keys), {}
