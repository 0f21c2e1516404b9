"""One request loop for every policy that runs as a live cache or replays through one.

Owns: ``access(st, keys, out)``, the batch k3-run's expert cache hands over per layer
visit (each key in order looked up and, on a miss, admitted), and ``hits(st, keys)``,
the same over a whole trace. Does not own: any policy's rules.

The policy is chosen at compile time from its state: numba ``overload`` on the state
tuple's length (each policy declares it, ``state_parts`` in ``libk3.policies.registry``), because a numba function
passed as an argument, or built in a closure, is compiled again in every process instead
of loaded from the cache.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from .registry import stepping

_CHUNK = 1 << 16


def _lookup(st, key):
    raise NotImplementedError("numba only")


def _admit(st, key):
    raise NotImplementedError("numba only")


@overload(_lookup)
def _lookup_for(st, key):
    f = stepping(len(st)).lookup
    return lambda st, key: f(st, key)


@overload(_admit)
def _admit_for(st, key):
    f = stepping(len(st)).admit
    return lambda st, key: f(st, key)


@njit(cache=True, nogil=True)
def access(st, keys, out):
    """Each key in order looked up, and admitted on a miss. out (n, 3) int64 rows
    [slot, evicted key or -1, 1 if hit]. -> hits."""
    hits = 0
    for i in range(keys.size):
        s = _lookup(st, keys[i])
        ev = -1
        if s >= 0:
            hits += 1
            out[i, 2] = 1
        else:
            s, ev = _admit(st, keys[i])
            out[i, 2] = 0
        out[i, 0] = s
        out[i, 1] = ev
    return hits


@njit(cache=True, nogil=True)
def hits(st, keys):
    """Replay a whole key stream through ``access``: -> hits."""
    out = np.empty((min(keys.size, _CHUNK), 3), np.int64)
    total = 0
    for a in range(0, keys.size, _CHUNK):
        part = keys[a:a + _CHUNK]
        total += access(st, part, out[:part.size])
    return total
