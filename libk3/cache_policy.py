"""Expert-cache replacement policies: offline replay simulators and online policy objects.

Owns: replaying a stream of expert keys (``layer * n_experts + expert``, int64, dense,
< n_layers * n_experts) against a cache of ``slots`` equal slots and counting hits, for
every policy in ``POLICIES``; and the online policy objects k3-run's expert cache drives
(``make_cache_policy``). Does not own: reading traces (``libk3.trace``), the capacity
ladder and reports (``libk3.trace_report``), the cache's memory and I/O (k3-run).

Policies (hit = the key is resident when requested; every miss reads the expert once):

* ``lru``       least recently used; the public C engine's v1.0 policy (PRIOR-ART.md 4).
* ``belady``    optimal offline (OPT/MIN with bypass): on a miss, of the residents and the
                incoming key, the one requested furthest in the future is not kept. An
                upper bound on every policy here (tested: belady >= all).
* ``pin+lru``   the p most requested keys of the WHOLE trace pinned (future knowledge: a
                bound, not a policy), LRU on the other slots. Honest: a pinned key's first
                request is a miss. p = the best of ``PIN_FRACTIONS`` x slots per capacity
                (fraction 0 is plain LRU, so pin+lru >= lru).
* ``s3fifo``    online: small FIFO (10 % of slots), main FIFO with a 2-bit frequency
                (CLOCK-like reinsertion), ghost FIFO of keys that left the small queue
                unrequested (Yang et al., SOSP 2023; the C engine's later default).
* ``layer-lfu`` online, layer-aware. p = a key's decayed share of its layer's visits
                (half life ``LFU_HALF_LIFE_VISITS`` visits of that layer) estimates the
                chance that a visit of its layer requests it. Layers are visited
                0..n_layers-1 and around again, which is known without seeing the future,
                so a resident key of layer L' cannot be requested before
                dist(L') = ((L' - L - 1) mod n_layers) + 1 layer visits from the current
                layer L. Evict the key with the largest expected number of layer visits
                to its next request, dist(L') + n_layers * (1/p - 1) (geometric waiting
                after its first chance).

Why layer-lfu (measured with ``bench/replay.py`` on synthetic traces): LRU evicts exactly
the keys the cycle is about to revisit, so it is flat below one cycle of distinct keys.
When every step re-requests the same keys (the C engine's full-recompute traces, whose
published LRU is flat from 8 to 64 GB), every resident is "frequent" and the distance term
recovers 85-98 % of the LRU-Belady gap from 32 to 128 GB on the bench's recompute trace;
without it (plain decayed LFU, ``alpha=0`` in the kernel) that trace replays exactly as
LRU up to 128 GB. In incremental decoding with skewed popularity the frequency term
recovers about half of the gap below one cycle, where LRU hits nothing. Where consecutive
tokens share many experts and the cache holds just over one cycle, LRU can still be
ahead: see the bench table.

Why the online policies never bypass and protect the current visit: k3-run must hold all
experts of a layer while it computes that layer, so every admitted key gets a slot, and no
key requested in the current layer visit is evicted while any other key is resident (LRU
gives this for free when slots > top_k; layer-lfu keeps the visit's keys out of its
eviction heaps, falling back to the least recent of them only when nothing else is
resident). The simulators run the very numba step functions the objects call, so replayed
numbers are what k3-run sees with the same policy.

Why numba, dense arrays and few of them: a 10-million-request trace must replay every
policy at every ladder capacity in under a minute on 2 cores (issue 7). Structures are
arrays indexed by key or slot (keys are dense): O(1) per request for LRU, S3-FIFO and the
pinned bound; O(log slots) for Belady (an indexed max-heap of at most ``slots`` entries
keyed by next use); for layer-lfu O(log n_experts) per request (a min-heap per layer) plus
a scan of n_layers per-layer scores per miss. Each policy's state is packed into a few
arrays because a non-inlined numba call increfs and decrefs every array it unpacks
(measured: ~85 ns for a call passing a 14-array state, ~30 ns for 3 arrays). Simulators
are deterministic and single-threaded; independent (policy, capacity) replays run in
parallel threads (``nogil``), so results never depend on the thread count.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

from .errors import UsageError

PIN_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
S3FIFO_SMALL_FRACTION = 0.1     # S3-FIFO paper: the small queue holds 10 % of the cache
S3FIFO_MAX_FREQ = 3             # 2-bit frequency counter
LFU_HALF_LIFE_VISITS = 4.0      # layer-lfu count half life in visits of a layer; 2, 4, 8
                                # and 16 were tried on the bench traces, 4 was never more
                                # than a few points below the best of them
_RESCALE = 2.0 ** 400           # layer-lfu: rescale a layer's counts past this (exact)
_MIN_COUNT = 1e-300             # a count this small scores "never again"


# ======================================================================================
# LRU: intrusive doubly-linked list over slots (head = most recent), key -> slot map.
# state: (sl, slot_of_key, sc); sl[s] = [prev, next, key]; sc = [head, tail, used, slots]
# ======================================================================================

_PREV, _NEXT, _KEY = 0, 1, 2


@njit(cache=True, nogil=True)
def _lru_new(n_keys, slots):
    sl = np.full((max(slots, 1), 3), -1, np.int64)
    slot_of_key = np.full(n_keys, -1, np.int64)
    sc = np.array([-1, -1, 0, max(slots, 0)], np.int64)
    return sl, slot_of_key, sc


@njit(cache=True, nogil=True, inline='always')
def _list_unlink(sl, sc, h, s):
    """Unlink slot s from the list whose head and tail are sc[h] and sc[h + 1]."""
    p, n = sl[s, _PREV], sl[s, _NEXT]
    if p >= 0:
        sl[p, _NEXT] = n
    else:
        sc[h] = n
    if n >= 0:
        sl[n, _PREV] = p
    else:
        sc[h + 1] = p
    sl[s, _PREV] = -1
    sl[s, _NEXT] = -1


@njit(cache=True, nogil=True, inline='always')
def _list_push_front(sl, sc, h, s):
    first = sc[h]
    sl[s, _PREV] = -1
    sl[s, _NEXT] = first
    if first >= 0:
        sl[first, _PREV] = s
    else:
        sc[h + 1] = s
    sc[h] = s


@njit(cache=True, nogil=True)
def _lru_lookup(st, key):
    """Record a request: -> the key's slot (now most recent) or -1."""
    sl, slot_of_key, sc = st
    s = slot_of_key[key]
    if s >= 0 and sc[0] != s:
        _list_unlink(sl, sc, 0, s)
        _list_push_front(sl, sc, 0, s)
    return s


@njit(cache=True, nogil=True)
def _lru_admit(st, key):
    """Place a missing key in a free slot, else the least recent one. -> (slot, evicted
    key or -1); (-1, -1) when there are no slots."""
    sl, slot_of_key, sc = st
    if sc[3] == 0:
        return -1, -1
    evicted = -1
    if sc[2] < sc[3]:
        s = sc[2]
        sc[2] += 1
    else:
        s = sc[1]
        _list_unlink(sl, sc, 0, s)
        evicted = sl[s, _KEY]
        slot_of_key[evicted] = -1
    sl[s, _KEY] = key
    slot_of_key[key] = s
    _list_push_front(sl, sc, 0, s)
    return s, evicted


# ======================================================================================
# Pinned hottest + LRU (offline bound).
# ======================================================================================

@njit(cache=True, nogil=True)
def _simulate_pin_lru(keys, slots, n_keys, pinned, n_pinned):
    """pinned: (n_keys,) bool with n_pinned <= slots True. A pinned key is read on its
    first request (a miss) and then stays; the others share slots - n_pinned under LRU.
    Nothing pinned is plain LRU (same speed: 10M requests in 0.24 s either way)."""
    st = _lru_new(n_keys, slots - n_pinned)
    seen = np.zeros(n_keys, np.bool_)
    hits = 0
    for i in range(keys.size):
        k = keys[i]
        if pinned[k]:
            if seen[k]:
                hits += 1
            else:
                seen[k] = True
        elif _lru_lookup(st, k) >= 0:
            hits += 1
        else:
            _lru_admit(st, k)
    return hits


# ======================================================================================
# Belady / OPT with bypass: indexed max-heap over slots keyed by next-use index.
# ======================================================================================

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
def _simulate_belady(keys, next_use, slots, n_keys):
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


# ======================================================================================
# S3-FIFO (simulation only). The small FIFO S and main FIFO M share the slots; the ghost
# FIFO G remembers up to |M|'s share of keys that left S unrequested.
# ======================================================================================

@njit(cache=True, nogil=True)
def _simulate_s3fifo(keys, slots, n_keys, small_target, ghost_cap, max_freq):
    """Hit: frequency + 1 (capped at max_freq). Miss: a key found in G goes to M, else to
    S, with frequency 0, after freeing one slot: while none is free, if |S| >= small_target
    (or M is empty) take S's oldest: requested while in S -> moved to M with frequency 0,
    else evicted into G; otherwise take M's oldest: frequency > 0 -> reinserted with
    frequency - 1, else evicted."""
    if slots <= 0:
        return 0
    cap = slots + 1
    sq = np.empty(cap, np.int64)              # ring buffers; *_tail is the oldest
    mq = np.empty(cap, np.int64)
    s_head = 0
    s_tail = 0
    s_size = 0
    m_head = 0
    m_tail = 0
    m_size = 0
    gcap = max(ghost_cap, 1)
    gq = np.full(gcap, -1, np.int64)
    gq_stamp = np.zeros(gcap, np.int64)
    g_head = 0
    ghost = np.full(n_keys, -1, np.int64)     # stamp of the key's live ghost entry, or -1
    where = np.zeros(n_keys, np.int8)         # 0 absent, 1 in S, 2 in M
    freq = np.zeros(n_keys, np.int8)
    stamp = 0
    hits = 0
    for i in range(keys.size):
        k = keys[i]
        if where[k] != 0:
            hits += 1
            if freq[k] < max_freq:
                freq[k] += 1
            continue
        while s_size + m_size >= slots:
            if s_size >= small_target or m_size == 0:
                t = sq[s_tail]
                s_tail = (s_tail + 1) % cap
                s_size -= 1
                if freq[t] > 0:
                    freq[t] = 0
                    mq[m_head] = t
                    m_head = (m_head + 1) % cap
                    m_size += 1
                    where[t] = 2
                else:
                    where[t] = 0
                    old = gq[g_head]
                    if old >= 0 and ghost[old] == gq_stamp[g_head]:
                        ghost[old] = -1
                    stamp += 1
                    gq[g_head] = t
                    gq_stamp[g_head] = stamp
                    ghost[t] = stamp
                    g_head = (g_head + 1) % gcap
            else:
                t = mq[m_tail]
                m_tail = (m_tail + 1) % cap
                m_size -= 1
                if freq[t] > 0:
                    freq[t] -= 1
                    mq[m_head] = t
                    m_head = (m_head + 1) % cap
                    m_size += 1
                else:
                    where[t] = 0
        freq[k] = 0
        if ghost[k] >= 0:
            ghost[k] = -1
            mq[m_head] = k
            m_head = (m_head + 1) % cap
            m_size += 1
            where[k] = 2
        else:
            sq[s_head] = k
            s_head = (s_head + 1) % cap
            s_size += 1
            where[k] = 1
    return hits


# ======================================================================================
# layer-lfu (alpha = 1). alpha = 0 drops the distance term: plain decayed LFU, kept for
# the tests' ablation.
#
# Decayed count of key k at time t, the number of visits of its layer so far, counting
# each visit that requests k once:  C_k(t) = sum over those visits t_i of beta^(t - t_i),
# beta = 2^(-1/half life); p_k = (1 - beta) C_k(t) lies in (0, 1]. Stored scaled by the
# layer's clock, g_k = C_k(t) * scale_L with scale_L = 2^(t / half life), so a request
# adds scale_L to g_k (no exp or log per request: a log/exp form cost about a quarter of
# the replay time) and the order of a layer's keys never changes while they sit in its
# heap (the LRFU trick). When scale_L passes 2^400 the layer's scale and counts are
# divided by 2^400, exactly, keeping every order and every p.
#
# state (5 arrays, see the module docstring for why so few):
#   kk (n_keys, 5) int64   per key: [slot, heap position, last visit id, heap entry,
#                          layer]; layer L's min-heap (by count) lives in column 3 of
#                          rows L*n_experts .. L*n_experts + heap size - 1
#   sl (slots, 3) int64    per slot: [prev, next, key]; prev/next link the current
#                          visit's resident keys, most recent first
#   si int64               [0:_SI_N] scalars, then hsize[n_layers]
#   ka (n_keys,) float64   g_k, the scaled decayed count of each key
#   fl float64             [2^(1/half life), 1 - beta], then scale[n_layers], then
#                          score[n_layers]: each layer's least valuable heap key's
#                          n_layers * (1/p - 1) + alpha * L (-inf for an empty heap); the
#                          alpha * L part becomes dist() in the victim scan. A linear scan
#                          of 93 contiguous scores per miss measured faster than a segment
#                          tree's two range queries.
# ======================================================================================

_K_SLOT, _K_HPOS, _K_VISIT, _K_HEAP, _K_LAYER = 0, 1, 2, 3, 4
# si scalars: visit id, current layer, used slots, visit list head, visit list tail, ...
_S_VISIT, _S_CUR, _S_USED, _S_HEAD, _S_TAIL = 0, 1, 2, 3, 4
_S_NL, _S_NE, _S_SLOTS, _S_ALPHA = 5, 6, 7, 8
_SI_N = 9
_F_STEP, _F_OMB = 0, 1
_FL_N = 2


@njit(cache=True, nogil=True)
def _llfu_new(n_layers, n_experts, slots, alpha, half_life_visits):
    n_keys = n_layers * n_experts
    kk = np.full((n_keys, 5), -1, np.int64)
    kk[:, _K_LAYER] = np.arange(n_keys) // n_experts
    sl = np.full((max(slots, 1), 3), -1, np.int64)
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
    return kk, sl, si, ka, fl


@njit(cache=True, nogil=True, inline='always')
def _heap_less(kk, ka, x, y):
    return ka[x] < ka[y] or (ka[x] == ka[y] and x < y)


@njit(cache=True, nogil=True, inline='always')
def _heap_up(kk, ka, base, p):
    k = kk[base + p, _K_HEAP]
    while p > 0:
        q = (p - 1) >> 1
        kq = kk[base + q, _K_HEAP]
        if not _heap_less(kk, ka, k, kq):
            break
        kk[base + p, _K_HEAP] = kq
        kk[kq, _K_HPOS] = p
        p = q
    kk[base + p, _K_HEAP] = k
    kk[k, _K_HPOS] = p


@njit(cache=True, nogil=True, inline='always')
def _heap_down(kk, ka, base, p, size):
    k = kk[base + p, _K_HEAP]
    while True:
        c = 2 * p + 1
        if c >= size:
            break
        kc = kk[base + c, _K_HEAP]
        if c + 1 < size:
            kc1 = kk[base + c + 1, _K_HEAP]
            if _heap_less(kk, ka, kc1, kc):
                c += 1
                kc = kc1
        if not _heap_less(kk, ka, kc, k):
            break
        kk[base + p, _K_HEAP] = kc
        kk[kc, _K_HPOS] = p
        p = c
    kk[base + p, _K_HEAP] = k
    kk[k, _K_HPOS] = p


@njit(cache=True, nogil=True, inline='always')
def _heap_push(kk, si, ka, key):
    L = kk[key, _K_LAYER]
    base = L * si[_S_NE]
    size = si[_SI_N + L]
    kk[base + size, _K_HEAP] = key
    si[_SI_N + L] = size + 1
    _heap_up(kk, ka, base, size)


@njit(cache=True, nogil=True, inline='always')
def _heap_remove(kk, si, ka, key):
    L = kk[key, _K_LAYER]
    base = L * si[_S_NE]
    p = kk[key, _K_HPOS]
    kk[key, _K_HPOS] = -1
    last = si[_SI_N + L] - 1
    si[_SI_N + L] = last
    moved = kk[base + last, _K_HEAP]
    kk[base + last, _K_HEAP] = -1
    if p != last:
        kk[base + p, _K_HEAP] = moved
        kk[moved, _K_HPOS] = p
        _heap_up(kk, ka, base, p)
        _heap_down(kk, ka, base, kk[moved, _K_HPOS], last)


@njit(cache=True, nogil=True, inline='always')
def _score_set(kk, si, ka, fl, L):
    """Refresh layer L's eviction score from its least valuable heap key."""
    n_layers, n_experts = si[_S_NL], si[_S_NE]
    if si[_SI_N + L] == 0:
        fl[_FL_N + n_layers + L] = -np.inf
    else:
        g = max(ka[kk[L * n_experts, _K_HEAP]], _MIN_COUNT)         # 1/p = scale/(omb g)
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
def _llfu_new_visit(st, L):
    """Layer L starts a visit: the previous visit's keys return to their heap."""
    kk, sl, si, ka, fl = st
    old = si[_S_CUR]
    s = si[_S_HEAD]
    while s >= 0:
        nxt = sl[s, _NEXT]
        _heap_push(kk, si, ka, sl[s, _KEY])
        sl[s, _PREV] = -1
        sl[s, _NEXT] = -1
        s = nxt
    si[_S_HEAD] = -1
    si[_S_TAIL] = -1
    if old >= 0:
        _score_set(kk, si, ka, fl, old)
    si[_S_VISIT] += 1
    si[_S_CUR] = L
    fl[_FL_N + L] *= fl[_F_STEP]              # the layer's clock ticks: older counts decay
    if fl[_FL_N + L] > _RESCALE:
        fl[_FL_N + L] /= _RESCALE
        n_experts = si[_S_NE]
        for k in range(L * n_experts, (L + 1) * n_experts):
            ka[k] /= _RESCALE


@njit(cache=True, nogil=True)
def _llfu_lookup(st, key):
    """Record a request: -> the key's slot or -1. Counts the key once per visit of its
    layer and protects it (out of its heap) until the visit ends."""
    kk, sl, si, ka, fl = st
    L = kk[key, _K_LAYER]
    if L != si[_S_CUR]:
        _llfu_new_visit(st, L)
    s = kk[key, _K_SLOT]
    if kk[key, _K_VISIT] != si[_S_VISIT]:
        kk[key, _K_VISIT] = si[_S_VISIT]
        ka[key] += fl[_FL_N + L]
        if s >= 0:                              # the current layer's tree leaf is
            _heap_remove(kk, si, ka, key)       # refreshed when admit needs it
            _list_push_front(sl, si, _S_HEAD, s)
    elif s >= 0:
        _list_unlink(sl, si, _S_HEAD, s)
        _list_push_front(sl, si, _S_HEAD, s)
    return s


@njit(cache=True, nogil=True)
def _llfu_admit(st, key):
    """Place a missing key (call lookup first): a free slot, else evict the unprotected key
    with the largest expected number of layer visits to its next request; a key of the
    current visit (the least recent) only when no other key is resident.
    -> (slot, evicted key or -1); (-1, -1) when there are no slots."""
    kk, sl, si, ka, fl = st
    if si[_S_SLOTS] == 0:
        return -1, -1
    if kk[key, _K_LAYER] != si[_S_CUR] or kk[key, _K_VISIT] != si[_S_VISIT]:
        _llfu_lookup(st, key)
    evicted = -1
    if si[_S_USED] < si[_S_SLOTS]:
        s = si[_S_USED]
        si[_S_USED] += 1
    else:
        _score_set(kk, si, ka, fl, si[_S_CUR])
        Lv = _victim_layer(si, fl)
        if Lv >= 0:
            evicted = kk[Lv * si[_S_NE], _K_HEAP]
            _heap_remove(kk, si, ka, evicted)
            _score_set(kk, si, ka, fl, Lv)
            s = kk[evicted, _K_SLOT]
        else:
            s = si[_S_TAIL]
            evicted = sl[s, _KEY]
            _list_unlink(sl, si, _S_HEAD, s)
        kk[evicted, _K_SLOT] = -1
    sl[s, _KEY] = key
    kk[key, _K_SLOT] = s
    _list_push_front(sl, si, _S_HEAD, s)
    return s, evicted


@njit(cache=True, nogil=True)
def _simulate_llfu(keys, n_layers, n_experts, slots, alpha, half_life_visits):
    if slots <= 0:
        return 0
    st = _llfu_new(n_layers, n_experts, slots, alpha, half_life_visits)
    hits = 0
    for i in range(keys.size):
        k = keys[i]
        if _llfu_lookup(st, k) >= 0:
            hits += 1
        else:
            _llfu_admit(st, k)
    return hits


# ======================================================================================
# Python side: registry, replay, online policy objects.
# ======================================================================================

@dataclasses.dataclass(frozen=True)
class PolicyInfo:
    name: str
    online: bool            # False: uses future knowledge, a bound rather than a policy
    summary: str


POLICIES = {p.name: p for p in (
    PolicyInfo("lru", True, "least recently used (the C engine's v1.0 policy)"),
    PolicyInfo("belady", False, "optimal offline with bypass (upper bound)"),
    PolicyInfo("pin+lru", False, "hottest keys of the whole trace pinned + LRU (bound; "
                                 "first read of a pinned key is a miss)"),
    PolicyInfo("s3fifo", True, "small/main/ghost FIFOs, 2-bit frequency"),
    PolicyInfo("layer-lfu", True, "decayed per-visit frequency + distance to the layer's "
                                  "next visit in the cyclic layer order"),
)}
ONLINE_OBJECT_POLICIES = ("lru", "layer-lfu")


def check_policy_names(names) -> list:
    """The names, validated against POLICIES (UsageError listing the known ones)."""
    names = list(names)
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise UsageError(f"unknown cache policy {', '.join(unknown) or '(none given)'}",
                         expected=", ".join(POLICIES), found=", ".join(names))
    return names


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
            self._next_use = next_use_indices(self.keys, self.n_keys)
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
        if "belady" in policies:
            _ = self.next_use
        if "pin+lru" in policies:
            _ = self.hottest


def _run(rk: ReplayKeys, requested_slots: int, policy: str) -> dict:
    keys, n_keys = rk.keys, rk.n_keys
    # A cache with a slot for every key never evicts, under every policy here: simulating
    # n_keys slots gives exactly the hits of any larger count (10^12 slots, say) without
    # arrays sized by it. (pin+lru: every pin count ties, so the reported pin count is 0
    # either way.)
    slots = min(requested_slots, n_keys)
    extra = {}
    if policy == "lru":
        hits = _simulate_pin_lru(keys, slots, n_keys, np.zeros(n_keys, np.bool_), 0)
    elif policy == "belady":
        hits = _simulate_belady(keys, rk.next_use, slots, n_keys)
    elif policy == "pin+lru":
        hot = rk.hottest
        best, best_p = -1, 0
        for p in sorted({min(int(f * slots), hot.size) for f in PIN_FRACTIONS}):
            pinned = np.zeros(n_keys, np.bool_)
            pinned[hot[:p]] = True
            h = _simulate_pin_lru(keys, slots, n_keys, pinned, p)
            if h > best:
                best, best_p = h, p
        hits = best
        extra["pinned"] = best_p
    elif policy == "s3fifo":
        small = max(1, int(round(S3FIFO_SMALL_FRACTION * slots)))
        hits = _simulate_s3fifo(keys, slots, n_keys, small, max(slots - small, 1),
                                S3FIFO_MAX_FREQ)
    elif policy == "layer-lfu":
        hits = _simulate_llfu(keys, rk.n_layers, rk.n_experts, slots, 1, LFU_HALF_LIFE_VISITS)
    else:
        check_policy_names([policy])
        raise AssertionError(policy)
    n = int(keys.size)
    hits = int(hits)
    return {"policy": policy, "slots": int(requested_slots), "requests": n, "hits": hits,
            "misses": n - hits, "hit_rate": hits / n if n else 0.0, **extra}


def replay(keys, slots: int, policy: str, *, n_layers: int, n_experts: int) -> dict:
    """Replay keys (layer * n_experts + expert) through one policy with ``slots`` slots.
    -> {policy, slots, requests, hits, misses, hit_rate (0..1)[, pinned]}."""
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
    jobs = [(p, int(s)) for p in policies for s in slots_list]

    def one(job):
        t0, c0 = time.perf_counter(), time.thread_time()
        row = _run(rk, job[1], job[0])
        row["seconds"] = time.perf_counter() - t0
        row["cpu_seconds"] = time.thread_time() - c0
        return row

    if workers <= 1:
        return [one(j) for j in jobs]
    # longest jobs first keeps both threads busy to the end
    order = sorted(range(len(jobs)), key=lambda i: -_COST[jobs[i][0]])
    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = dict(zip(order, pool.map(one, [jobs[i] for i in order])))
    return [done[i] for i in range(len(jobs))]


# rough relative replay cost per policy, only used to schedule the longest jobs first
_COST = {"layer-lfu": 10, "pin+lru": 5, "belady": 2, "lru": 1, "s3fifo": 1}


class OnlinePolicy:
    """What k3-run's expert cache drives, one object per cache.

    ``lookup(key)`` records a request and returns the key's slot, or -1 on a miss; after
    a miss the cache calls ``admit(key)`` -> (slot, evicted key or -1) and reads the
    expert into that slot. Keys are ``layer * n_experts + expert``. For every policy here
    a key requested in the current layer visit is not evicted while any other key is
    resident, so with at least top_k + 1 slots all of a layer's experts stay resident
    while the layer computes. Cost: one numba call per method, about 2 us per request
    from Python (lookup + admit), so about 3 ms per token at 1,488 requests. The object
    never affects what the model computes, only which experts are read again.
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
        if name == "lru":
            self._state = _lru_new(self.n_keys, self.slots)
            self._lookup, self._admit = _lru_lookup, _lru_admit
        else:
            self._state = _llfu_new(self.n_layers, self.n_experts, self.slots, 1,
                                    LFU_HALF_LIFE_VISITS)
            self._lookup, self._admit = _llfu_lookup, _llfu_admit

    def _check(self, key) -> int:
        key = int(key)
        if not 0 <= key < self.n_keys:
            raise ValueError(f"key {key} outside 0..{self.n_keys - 1}")
        return key

    def lookup(self, key: int) -> int:
        return int(self._lookup(self._state, self._check(key)))

    def admit(self, key: int) -> tuple:
        s, e = self._admit(self._state, self._check(key))
        return int(s), int(e)

    def resident(self) -> np.ndarray:
        """(slots,) int64: the key held by each slot, -1 for a never-used slot."""
        if self.name == "lru":
            return self._state[0][:self.slots, _KEY].copy()
        return self._state[1][:self.slots, _KEY].copy()


def make_cache_policy(name: str, slots: int, *, n_layers: int, n_experts: int) -> OnlinePolicy:
    """The online policy object for k3-run's expert cache (names: ONLINE_OBJECT_POLICIES)."""
    return OnlinePolicy(name, slots, n_layers=n_layers, n_experts=n_experts)
