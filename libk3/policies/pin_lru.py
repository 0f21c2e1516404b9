"""pin+lru: the hottest keys of the whole trace pinned, the rest under LRU (a bound).

Owns: the pin+lru declaration and its replay: the p most requested keys of the whole
trace pinned, p the best of ``PIN_FRACTIONS`` x slots; a pinned key's first request is a
miss, fraction 0 is plain LRU. It uses the future, so it bounds what pinning can do
rather than being a policy k3-run could run. Does not own: the LRU steps and the pinned
simulator (``libk3.policies.lru``).
"""

from __future__ import annotations

import numpy as np

from .lru import simulate_pin_lru
from .registry import PolicyInfo

POLICY = PolicyInfo(name="pin+lru", online=False, rank=30, needs=("hottest",), cost=5,
                    summary="hottest keys of the whole trace pinned + LRU (bound; "
                            "first read of a pinned key is a miss)",
                    note="pins the best of 0, 0.25, 0.5, 0.75, 1 of the slots")
PIN_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)     # the note above says them (tested)


def replay(rk, slots):
    """-> (hits, {"pinned": the best pin count}); ties keep the smaller count."""
    hot, n_keys = rk.hottest, rk.n_keys
    best, best_p = -1, 0
    for p in sorted({min(int(f * slots), hot.size) for f in PIN_FRACTIONS}):
        pinned = np.zeros(n_keys, np.bool_)
        pinned[hot[:p]] = True
        h = simulate_pin_lru(rk.keys, slots, n_keys, pinned, p)
        if h > best:
            best, best_p = h, p
    return best, {"pinned": best_p}
