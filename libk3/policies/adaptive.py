"""adaptive: follow whichever of four online policies reads least on this trace, live.

Owns: the adaptive policy's state and steps. Four shadow caches of the same size replay
every request: LRU, S3-FIFO, full-history LFU and layer-lfu (``CANDIDATES``); they hold
keys only, no expert bytes. Every window of requests (as many as the cache has slots,
within ``WINDOW_MIN``..``WINDOW_MAX``) each shadow's misses in the window are added to
a decayed score (``DECAY`` per window); the leader changes only when another shadow's
score is below ``1 - MARGIN`` times the leader's (hysteresis). The real cache
follows the leader: on a miss it evicts a key the leader no longer holds (the leader's
own victims, oldest first), so it converges to the leader's contents and then makes
exactly the leader's choices; a switch queues every resident the new leader lacks.

Why four whole policies and not one layer-lfu with a learned half life (bench/README.md,
"Cache policies"): on stable popularity full-history LFU reads least and on shifting
popularity a short half life does, but where consecutive tokens share experts LRU (a
cache of about one cycle) or S3-FIFO (several cycles) beats every half life of
layer-lfu. Why a long score memory: on full-recompute traces the best shadow changes
within each step; a short half life switched back and forth and read more than layer-lfu
alone, a long one does not. The cost is the four shadows' work on every request.

Why it is the default (``POLICY``): it reads the fewest bytes per token, close to the
best of LRU, S3-FIFO, full-history LFU and layer-lfu on every trace and capacity of
``bench/replay.py`` (bench/README.md, "Cache policies"); each of those alone is far
behind the best somewhere.

Like every online policy here it never evicts a key requested in the current layer
visit while another key is resident: a leader's victim from the current visit stays
queued, and with nothing else queued (rare: the real cache and the leader differ only
after a switch) the real cache evicts the next key outside the visit under a clock hand
over its slots. When every resident belongs to the visit (one layer fetched twice in a
row) it evicts the least recently requested one, which is never a key the current batch
of at most ``slots`` keys has placed.

state: (lru state, s3fifo state, lfu state, layer-lfu state, (ks, rk, rq, rs, rf, kt))
  ks (slots,) int32     the key in each real slot
  rk (n_keys, 3) int32  per key: real slot or -1, visit id of its last request, queued
                        (columns of the shared per-key rows, see ``new``)
  rq (slots + 1,) int32 ring of keys to evict first (residents the leader lacks)
  rs int64              scalars below, then each shadow's misses in the window and
                        since the start
  rf float64            each shadow's decayed miss score
  kt (slots,) int64     the request number of each real slot's key's latest request
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import drive, layer_lfu, lfu, lru, s3fifo
from .registry import PolicyInfo

POLICY = PolicyInfo(name="adaptive", online=True, live=True, default=True, rank=70,
                    state_parts=5, cost=20, shadows=("lru", "s3fifo", "lfu", "layer-lfu"),
                    summary="follows whichever of lru, s3fifo, lfu and layer-lfu "
                            "misses least (shadow caches, hysteresis)")
CANDIDATES = POLICY.shadows    # shadow order; the state's order
FIRST_LEADER = 3                # layer-lfu, the previous default, until a window says more
WINDOW_MIN, WINDOW_MAX = 256, 4096   # requests per scoring window: the slots, within these
DECAY = 0.99                    # a window's weight in the score halves after ~69 windows
MARGIN = 0.01                   # switch only to a shadow with 1 % fewer (decayed) misses

_LRU, _S3, _LFU, _LLFU = 0, 1, 2, 3
_N_SHADOWS = 4
_R_SLOT, _R_VISIT, _R_QUEUED = 0, 1, 2
_DECAY, _MARGIN = _N_SHADOWS, _N_SHADOWS + 1     # in rf, after the scores
_R_COLUMNS = 3
(_HAND, _USED, _SLOTS, _QHEAD, _QTAIL, _CUR, _VISIT, _LEADER, _NE, _WCOUNT,
 _SWITCHES, _WINDOW, _SEQ) = range(13)
_WMISS = 13                     # then each shadow's misses in the window
_TOTAL = _WMISS + 4              # then each shadow's misses since the start


_COLUMNS = (lru.KEY_COLUMNS, s3fifo.KEY_COLUMNS, lfu.KEY_COLUMNS, layer_lfu.KEY_COLUMNS,
            _R_COLUMNS)


def new(n_layers, n_experts, slots, window=None, decay=DECAY, margin=MARGIN):
    """The state. Every per-key column of the four shadows and the real cache shares one
    64-byte row per key, so a request touches one cache line for all five."""
    width = 16                                  # int32: one 64-byte line
    assert sum(_COLUMNS) <= width
    n_keys = n_layers * n_experts
    flat = np.empty(n_keys * width + 16, np.int32)
    skip = (-flat.ctypes.data % 64) // 4
    rows = flat[skip:skip + n_keys * width].reshape(n_keys, width)
    if window is None:
        window = min(max(slots, WINDOW_MIN), WINDOW_MAX)
    return new_on(rows, n_layers, n_experts, slots, window, decay, margin)


@njit(cache=True, nogil=True)
def new_on(rows, n_layers, n_experts, slots, window, decay, margin):
    """The state over rows (n_keys, 16) int32, C-contiguous (``new`` aligns them)."""
    c0 = lru.KEY_COLUMNS
    c1 = c0 + s3fifo.KEY_COLUMNS
    c2 = c1 + lfu.KEY_COLUMNS
    c3 = c2 + layer_lfu.KEY_COLUMNS
    small, ghost = s3fifo.sizes(slots)
    ks = np.full(max(slots, 1), -1, np.int32)
    rk = rows[:, c3:c3 + _R_COLUMNS]
    rk[:, :] = -1
    rk[:, _R_QUEUED] = 0
    rq = np.full(max(slots, 0) + 1, -1, np.int32)
    rs = np.zeros(_TOTAL + _N_SHADOWS, np.int64)
    rs[_SLOTS] = max(slots, 0)
    rs[_CUR] = -1
    rs[_VISIT] = -1
    rs[_LEADER] = FIRST_LEADER
    rs[_NE] = n_experts
    rs[_WINDOW] = window
    rf = np.zeros(_N_SHADOWS + 2, np.float64)
    rf[_DECAY] = decay
    rf[_MARGIN] = margin
    kt = np.zeros(max(slots, 1), np.int64)
    return (lru.new_on(rows[:, 0:c0], slots),
            s3fifo.new_on(rows[:, c0:c1], slots, small, ghost, s3fifo.MAX_FREQ),
            lfu.new_on(rows[:, c1:c2], n_experts, slots),
            layer_lfu.new_on(rows[:, c2:c3], n_layers, n_experts, slots, 1,
                             layer_lfu.HALF_LIFE_VISITS),
            (ks, rk, rq, rs, rf, kt))


@njit(cache=True, nogil=True, inline='always')
def _holds(st, j, key):
    """Does shadow j hold key?"""
    if j == _LRU:
        return lru.holds(st[0], key)
    if j == _S3:
        return s3fifo.holds(st[1], key)
    if j == _LFU:
        return lfu.holds(st[2], key)
    return layer_lfu.holds(st[3], key)


@njit(cache=True, nogil=True, inline='always')
def _enqueue(rk, rq, rs, key):
    """Queue a resident key for eviction (a full ring drops it: the clock hand covers)."""
    head = (rs[_QHEAD] + 1) % rq.size
    if head != rs[_QTAIL]:
        rk[key, _R_QUEUED] = 1
        rq[rs[_QHEAD]] = key
        rs[_QHEAD] = head


@njit(cache=True, nogil=True, inline='always')
def _shadow_missed(rk, rq, rs, j, evicted):
    """Shadow j missed and evicted ``evicted``: count it, and if j leads, queue the key
    for eviction from the real cache."""
    rs[_WMISS + j] += 1
    rs[_TOTAL + j] += 1
    if j == rs[_LEADER] and evicted >= 0 and rk[evicted, _R_SLOT] >= 0 \
            and rk[evicted, _R_QUEUED] == 0:
        _enqueue(rk, rq, rs, evicted)


@njit(cache=True, nogil=True)
def _end_window(st):
    """Fold the window's misses into the scores; switch leader with hysteresis."""
    ks, rk, rq, rs, rf, kt = st[4]
    leader = rs[_LEADER]
    best = leader
    for j in range(_N_SHADOWS):
        rf[j] = rf[j] * rf[_DECAY] + rs[_WMISS + j]
        rs[_WMISS + j] = 0
    for j in range(_N_SHADOWS):
        if rf[j] < rf[best]:
            best = j
    rs[_WCOUNT] = 0
    if best == leader or rf[best] >= (1.0 - rf[_MARGIN]) * rf[leader]:
        return
    rs[_LEADER] = best
    rs[_SWITCHES] += 1
    while rs[_QTAIL] != rs[_QHEAD]:                 # drop the old leader's queue
        rk[rq[rs[_QTAIL]], _R_QUEUED] = 0
        rs[_QTAIL] = (rs[_QTAIL] + 1) % rq.size
    for s in range(rs[_USED]):
        if not _holds(st, best, ks[s]):
            _enqueue(rk, rq, rs, ks[s])


@njit(cache=True, nogil=True, inline='always')
def lookup(st, key):
    """Record a request in every shadow and the real cache: -> the real slot or -1."""
    ks, rk, rq, rs, rf, kt = st[4]
    if lru.lookup(st[0], key) < 0:
        _shadow_missed(rk, rq, rs, _LRU, lru.admit(st[0], key)[1])
    if s3fifo.lookup(st[1], key) < 0:
        _shadow_missed(rk, rq, rs, _S3, s3fifo.admit(st[1], key)[1])
    if lfu.lookup(st[2], key) < 0:
        _shadow_missed(rk, rq, rs, _LFU, lfu.admit(st[2], key)[1])
    if layer_lfu.lookup(st[3], key) < 0:
        _shadow_missed(rk, rq, rs, _LLFU, layer_lfu.admit(st[3], key)[1])
    rs[_WCOUNT] += 1
    if rs[_WCOUNT] == rs[_WINDOW]:
        _end_window(st)
    L = key // rs[_NE]
    if L != rs[_CUR]:
        rs[_CUR] = L
        rs[_VISIT] = (rs[_VISIT] + 1) & 0x7FFFFFFF     # rk holds int32
    rk[key, _R_VISIT] = rs[_VISIT]
    rs[_SEQ] += 1
    s = rk[key, _R_SLOT]
    if s >= 0:
        kt[s] = rs[_SEQ]
    return s


@njit(cache=True, nogil=True, inline='always')
def _victim(st):
    """The real cache's key to evict: the oldest queued key the leader lacks, outside the
    current visit; else the next key outside it under the clock hand; else (every
    resident is of the visit) the least recently requested."""
    ks, rk, rq, rs, rf, kt = st[4]
    leader = rs[_LEADER]
    for _ in range((rs[_QHEAD] - rs[_QTAIL]) % rq.size):
        k = rq[rs[_QTAIL]]
        rs[_QTAIL] = (rs[_QTAIL] + 1) % rq.size
        rk[k, _R_QUEUED] = 0
        if rk[k, _R_SLOT] < 0 or _holds(st, leader, k):
            continue                                # gone, or the leader took it back
        if rk[k, _R_VISIT] != rs[_VISIT]:
            return k
        _enqueue(rk, rq, rs, k)                     # in use now: later
    for _ in range(rs[_SLOTS]):
        k = ks[rs[_HAND]]
        rs[_HAND] = (rs[_HAND] + 1) % rs[_SLOTS]
        if rk[k, _R_VISIT] != rs[_VISIT]:
            return k
    oldest = 0
    for s in range(1, rs[_SLOTS]):
        if kt[s] < kt[oldest]:
            oldest = s
    return ks[oldest]


@njit(cache=True, nogil=True, inline='always')
def admit(st, key):
    """Place a missing key (call lookup first) in a free slot, else in the victim's.
    -> (slot, evicted key or -1); (-1, -1) when there are no slots."""
    ks, rk, rq, rs, rf, kt = st[4]
    if rs[_SLOTS] == 0:
        return -1, -1
    evicted = -1
    if rs[_USED] < rs[_SLOTS]:
        s = rs[_USED]
        rs[_USED] += 1
    else:
        evicted = _victim(st)
        s = rk[evicted, _R_SLOT]
        rk[evicted, _R_SLOT] = -1
    ks[s] = key
    kt[s] = rs[_SEQ]
    rk[key, _R_SLOT] = s
    return s, evicted



def resident(st, slots):
    """(slots,) int64: the key held by each slot, -1 for a never-used slot."""
    return st[4][0][:slots].astype(np.int64)


def leader(st) -> str:
    """The candidate the real cache follows now."""
    return CANDIDATES[int(st[4][3][_LEADER])]


def switches(st) -> int:
    return int(st[4][3][_SWITCHES])


def shadow_misses(st) -> dict:
    """{candidate: misses since the start}: each shadow replays exactly as that policy
    alone would (same steps, same requests, same slots)."""
    rs = st[4][3]
    return {name: int(rs[_TOTAL + j]) for j, name in enumerate(CANDIDATES)}


def live_state(n_layers, n_experts, slots):
    return new(n_layers, n_experts, slots)


def replay(rk, slots):
    """-> (hits, {followed, switches, shadow_misses}): the shadows' misses are the other
    candidates' replays, exact."""
    st = live_state(rk.n_layers, rk.n_experts, slots)
    hits = drive.hits(st, rk.keys)
    return hits, {"followed": leader(st), "switches": switches(st),
                  "shadow_misses": shadow_misses(st)}
