"""S3-FIFO (Yang et al., SOSP 2023; the public C engine's later default), replay and shadow.

Owns: the S3-FIFO state and steps. A small FIFO S (``SMALL_FRACTION`` of the slots) and
a main FIFO M share the slots; a ghost FIFO G remembers up to |M|'s share of keys that
left S unrequested. Hit: frequency + 1 (capped at ``MAX_FREQ``). Miss: a key found in G
goes to M, else to S, with frequency 0, after freeing one slot: while none is free, if
|S| >= the small target (or M is empty) take S's oldest: requested while in S -> moved
to M with frequency 0, else evicted into G; otherwise take M's oldest: frequency > 0 ->
reinserted with frequency - 1, else evicted. O(1) per request, amortised.

No slots are tracked (S3-FIFO is replayed and run as a shadow, never as k3-run's cache):
``lookup`` returns 0 on a hit, ``admit`` returns (0, evicted key or -1).

G holds at most ``ghost_cap`` live keys: a key that returns from G leaves it at once and
frees its place (as the paper's implementation does), so G is a doubly linked FIFO over
the keys rather than a ring, whose stale entries would crowd out remembered keys.

state: (q, kv, sc)
  q (2, cap) int32    rings of keys: S, M (the oldest at ``*_TAIL``)
  kv (n_keys, 4) int32 per key: where (0 absent, 1 in S, 2 in M, 3 in G), frequency,
                      and its older and newer neighbours in G (-1 at either end)
  sc int64            scalars below
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .registry import PolicyInfo

POLICY = PolicyInfo(name="s3fifo", online=True, rank=40, cost=1,
                    summary="small/main/ghost FIFOs, 2-bit frequency")

SMALL_FRACTION = 0.1     # S3-FIFO paper: the small queue holds 10 % of the cache
MAX_FREQ = 3             # 2-bit frequency counter

_Q_S, _Q_M = 0, 1
_K_WHERE, _K_FREQ, _K_OLDER, _K_NEWER = 0, 1, 2, 3
_ABSENT, _IN_S, _IN_M, _IN_G = 0, 1, 2, 3
(_S_HEAD, _S_TAIL, _S_SIZE, _M_HEAD, _M_TAIL, _M_SIZE, _G_NEWEST, _G_OLDEST, _G_SIZE,
 _SLOTS, _SMALL, _GCAP, _MAXF, _CAP) = range(14)


@njit(cache=True, nogil=True)
def sizes(slots):
    """(small target, ghost capacity) for a cache of ``slots``."""
    small = max(1, int(round(SMALL_FRACTION * slots)))
    return small, max(slots - small, 1)


KEY_COLUMNS = 4


@njit(cache=True, nogil=True)
def new_on(kv, slots, small_target, ghost_cap, max_freq):
    """A state over the per-key array kv (n_keys, KEY_COLUMNS) int32, which may be a view
    into a block shared with other policies (``libk3.policies.adaptive``)."""
    cap = max(slots, 0) + 1
    q = np.full((2, cap), -1, np.int32)
    kv[:, :] = -1
    kv[:, _K_WHERE] = _ABSENT
    kv[:, _K_FREQ] = 0
    sc = np.zeros(14, np.int64)
    sc[_G_NEWEST] = -1
    sc[_G_OLDEST] = -1
    sc[_SLOTS] = max(slots, 0)
    sc[_SMALL] = small_target
    sc[_GCAP] = max(ghost_cap, 1)
    sc[_MAXF] = max_freq
    sc[_CAP] = cap
    return q, kv, sc


@njit(cache=True, nogil=True)
def new(n_keys, slots, small_target, ghost_cap, max_freq):
    return new_on(np.empty((n_keys, KEY_COLUMNS), np.int32), slots, small_target, ghost_cap,
                  max_freq)


@njit(cache=True, nogil=True, inline='always')
def _push(q, sc, row, head, size, k):
    q[row, sc[head]] = k
    sc[head] = (sc[head] + 1) % sc[_CAP]
    sc[size] += 1


@njit(cache=True, nogil=True, inline='always')
def _pop(q, sc, row, tail, size):
    k = q[row, sc[tail]]
    sc[tail] = (sc[tail] + 1) % sc[_CAP]
    sc[size] -= 1
    return k


@njit(cache=True, nogil=True, inline='always')
def _ghost_unlink(kv, sc, k):
    older, newer = kv[k, _K_OLDER], kv[k, _K_NEWER]
    if older >= 0:
        kv[older, _K_NEWER] = newer
    else:
        sc[_G_OLDEST] = newer
    if newer >= 0:
        kv[newer, _K_OLDER] = older
    else:
        sc[_G_NEWEST] = older
    kv[k, _K_OLDER] = -1
    kv[k, _K_NEWER] = -1
    kv[k, _K_WHERE] = _ABSENT
    sc[_G_SIZE] -= 1


@njit(cache=True, nogil=True, inline='always')
def _ghost_push(kv, sc, k):
    if sc[_G_SIZE] >= sc[_GCAP]:
        _ghost_unlink(kv, sc, sc[_G_OLDEST])       # G forgets its oldest key
    newest = sc[_G_NEWEST]
    kv[k, _K_OLDER] = newest
    kv[k, _K_NEWER] = -1
    if newest >= 0:
        kv[newest, _K_NEWER] = k
    else:
        sc[_G_OLDEST] = k
    sc[_G_NEWEST] = k
    kv[k, _K_WHERE] = _IN_G
    sc[_G_SIZE] += 1


@njit(cache=True, nogil=True, inline='always')
def lookup(st, key):
    """Record a request: -> 0 on a hit (frequency + 1), -1 on a miss."""
    q, kv, sc = st
    if kv[key, _K_WHERE] == _IN_S or kv[key, _K_WHERE] == _IN_M:
        if kv[key, _K_FREQ] < sc[_MAXF]:
            kv[key, _K_FREQ] += 1
        return 0
    return -1


@njit(cache=True, nogil=True, inline='always')
def holds(st, key):
    w = st[1][key, _K_WHERE]
    return w == _IN_S or w == _IN_M


@njit(cache=True, nogil=True, inline='always')
def admit(st, key):
    """Insert a missing key after freeing one slot. -> (0, evicted key or -1)."""
    q, kv, sc = st
    if sc[_SLOTS] == 0:
        return -1, -1
    evicted = -1
    while sc[_S_SIZE] + sc[_M_SIZE] >= sc[_SLOTS]:
        if sc[_S_SIZE] >= sc[_SMALL] or sc[_M_SIZE] == 0:
            t = _pop(q, sc, _Q_S, _S_TAIL, _S_SIZE)
            if kv[t, _K_FREQ] > 0:
                kv[t, _K_FREQ] = 0
                _push(q, sc, _Q_M, _M_HEAD, _M_SIZE, t)
                kv[t, _K_WHERE] = _IN_M
            else:
                evicted = t
                _ghost_push(kv, sc, t)
        else:
            t = _pop(q, sc, _Q_M, _M_TAIL, _M_SIZE)
            if kv[t, _K_FREQ] > 0:
                kv[t, _K_FREQ] -= 1
                _push(q, sc, _Q_M, _M_HEAD, _M_SIZE, t)
            else:
                kv[t, _K_WHERE] = _ABSENT
                evicted = t
    kv[key, _K_FREQ] = 0
    if kv[key, _K_WHERE] == _IN_G:
        _ghost_unlink(kv, sc, key)
        _push(q, sc, _Q_M, _M_HEAD, _M_SIZE, key)
        kv[key, _K_WHERE] = _IN_M
    else:
        _push(q, sc, _Q_S, _S_HEAD, _S_SIZE, key)
        kv[key, _K_WHERE] = _IN_S
    return 0, evicted


@njit(cache=True, nogil=True)
def simulate(keys, slots, n_keys, small_target, ghost_cap, max_freq):
    """Replay keys: -> hits."""
    st = new(n_keys, slots, small_target, ghost_cap, max_freq)
    hits = 0
    for i in range(keys.size):
        if lookup(st, keys[i]) >= 0:
            hits += 1
        else:
            admit(st, keys[i])
    return hits


def replay(rk, slots):
    return simulate(rk.keys, slots, rk.n_keys, *sizes(slots), MAX_FREQ), {}
