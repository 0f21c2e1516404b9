"""The expert-cache policies by name: which exist, which can drive k3-run's cache, the default.

Owns: ``POLICIES`` (every replayable policy, online or a bound, and the module of
``libk3.policies`` holding its numba code: the one list, which the precompile table
reads too), ``ONLINE_OBJECT_POLICIES`` (those k3-run can run), ``DEFAULT_POLICY`` and
name validation. Imports nothing heavy, so
the click front ends can build their choices from it. Does not own: the policies
(``libk3.policies``) or replaying them (``libk3.trace.replay``).

Why ``adaptive`` is the default: it reads the fewest bytes per token, within 2 % of the
best of LRU, S3-FIFO, full-history LFU and layer-lfu on every trace and capacity of
``bench/replay.py`` (bench/README.md, "Cache policies"); each of those alone is 8 to 80 %
behind the best somewhere.
"""

from __future__ import annotations

import dataclasses

from ..errors import UsageError


@dataclasses.dataclass(frozen=True)
class PolicyInfo:
    name: str
    online: bool            # False: uses future knowledge, a bound rather than a policy
    summary: str
    module: str             # its numba step functions or simulator, in libk3.policies


POLICIES = {p.name: p for p in (
    PolicyInfo("lru", True, "least recently used (the C engine's v1.0 policy)", "lru"),
    PolicyInfo("belady", False, "optimal offline with bypass (upper bound)", "belady"),
    PolicyInfo("pin+lru", False, "hottest keys of the whole trace pinned + LRU (bound; "
                                 "first read of a pinned key is a miss)", "lru"),
    PolicyInfo("s3fifo", True, "small/main/ghost FIFOs, 2-bit frequency", "s3fifo"),
    PolicyInfo("lfu", True, "full-history request counts (perfect-frequency reference)",
               "lfu"),
    PolicyInfo("layer-lfu", True, "decayed per-visit frequency + distance to the layer's "
                                  "next visit in the cyclic layer order", "layer_lfu"),
    PolicyInfo("adaptive", True, "follows whichever of lru, s3fifo, lfu and layer-lfu "
                                 "misses least (shadow caches, hysteresis)", "adaptive"),
)}


def policy_module(name: str) -> str:
    """The module path of policy ``name``'s numba code (without importing it)."""
    return f"libk3.policies.{POLICIES[name].module}"
ONLINE_OBJECT_POLICIES = ("adaptive", "layer-lfu", "lru")     # what k3-run can run
DEFAULT_POLICY = "adaptive"


def check_policy_names(names) -> list:
    """The names, validated against POLICIES (UsageError listing the known ones)."""
    names = list(names)
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise UsageError(f"unknown cache policy {', '.join(unknown) or '(none given)'}",
                         expected=", ".join(POLICIES), found=", ".join(names))
    return names
