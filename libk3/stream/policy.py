"""Online eviction policies for the expert cache (the interface k3-run uses).

Owns: ``lookup(key) -> slot or -1`` (a hit also updates recency/frequency),
``admit(key, protected) -> (slot, evicted key or -1)`` (never evicts a protected key: the
experts of the batch being fetched), ``forget(key)`` (after a failed read). Does not own:
offline replay of traces (``libk3.cache_policy``) or the slots' bytes.

The policy never changes results, only which bytes are read again: k3-run's output is
the same for every policy (tested).
"""

from __future__ import annotations

from collections import OrderedDict

from ..errors import UsageError


class LRU:
    """Least recently used; the public C engine's v1.0 policy."""

    name = "lru"

    def __init__(self, n_slots: int, n_layers: int = 0, n_experts: int = 0):
        self.n_slots = n_slots
        self.order: OrderedDict = OrderedDict()        # key -> slot, oldest first
        self.free = list(range(n_slots - 1, -1, -1))

    def lookup(self, key: int) -> int:
        s = self.order.get(key)
        if s is None:
            return -1
        self.order.move_to_end(key)
        return s

    def admit(self, key: int, protected=()) -> tuple:
        if self.free:
            s = self.free.pop()
            self.order[key] = s
            return s, -1
        for victim in self.order:
            if victim not in protected:
                break
        else:
            raise RuntimeError("every cached expert is protected; batch larger than the cache")
        s = self.order.pop(victim)
        self.order[key] = s
        return s, victim

    def forget(self, key: int) -> None:
        s = self.order.pop(key, None)
        if s is not None:
            self.free.append(s)


POLICIES = {"lru": LRU}


def make_policy(name: str, n_slots: int, n_layers: int, n_experts: int):
    try:
        cls = POLICIES[name]
    except KeyError:
        raise UsageError(f"unknown cache policy {name!r}",
                         hint=f"choose one of {', '.join(sorted(POLICIES))}") from None
    return cls(n_slots, n_layers, n_experts)
