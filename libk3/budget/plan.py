"""Budgets and the trunk's split: the smallest budget that can work (the one feasibility
rule), and how a trunk budget splits into pinned layers and a ring (the one plan the
streamer, the doctor and ``k3-trace size`` use).
"""

from __future__ import annotations

import dataclasses

from ..errors import BudgetError
from ..units import gb_option, size_text, size_texts
from .sizes import ModelSizes

@dataclasses.dataclass(frozen=True)
class Budget:
    """Bytes for the trunk (pins + ring) and for the expert cache; ``preset`` is the
    preset name it came from (None for flags only, 'minimum' for ``minimum_budget``);
    ``reasons`` says, in order, where each number came from."""

    trunk_bytes: int
    cache_bytes: int
    preset: str | None
    reasons: tuple

    def to_json(self) -> dict:
        return {"trunk_bytes": self.trunk_bytes, "cache_bytes": self.cache_bytes,
                "preset": self.preset, "reasons": list(self.reasons)}


@dataclasses.dataclass(frozen=True)
class TrunkPlan:
    pinned: frozenset          # layer indices held permanently
    slots: tuple               # ring slot capacities in bytes: the layer in use (+ the next)
    streamed_bytes: int        # trunk bytes read from disk per token

    @property
    def ring_bytes(self) -> int:
        return sum(self.slots)


def trunk_floor(layer_bytes) -> int:
    """The smallest trunk budget that runs: one ring slot for the largest layer (the
    ring then reads a layer only once the last is released, ``libk3.stream.trunk_modes``), or
    the whole trunk if smaller."""
    return min(max(layer_bytes, default=0), sum(layer_bytes))


def overlap_floor(layer_bytes) -> int:
    """The smallest trunk budget whose ring overlaps reading with compute: two slots, for
    the two largest layers (or the whole trunk, if smaller). ``auto`` prefers it."""
    return min(sum(sorted(layer_bytes, reverse=True)[:2]), sum(layer_bytes))


def cache_floor(slot_bytes: int, top_k: int, total_experts: int) -> int:
    """The smallest cache that runs: top_k + 1 slots (or every expert, if fewer)."""
    return min(top_k + 1, total_experts) * slot_bytes


def floor_problems(trunk_bytes: int, cache_bytes: int, layer_bytes, slot_bytes: int,
                   top_k: int, total_experts: int) -> list:
    """The one feasibility rule for a split (k3-run's admission, ``resolve_budget``,
    k3-doctor and ``k3-trace size``): why it cannot run, [] when it can."""
    problems = []
    trunk, cache = trunk_floor(layer_bytes), cache_floor(slot_bytes, top_k, total_experts)
    if trunk_bytes < trunk:
        given, need = size_texts(trunk_bytes, trunk)
        problems.append(f"trunk budget {given} is below {need} "
                        f"(one ring slot for the largest layer, {trunk} bytes)")
    if cache_bytes < cache:
        given, need = size_texts(cache_bytes, cache)
        problems.append(f"cache budget {given} is below {need} "
                        f"({min(top_k + 1, total_experts)} expert slots of {slot_bytes} bytes)")
    return problems


def plan_trunk(sizes, budget: int) -> TrunkPlan:
    """The trunk's split for a budget in bytes, ``sizes`` the layers' bytes: the one plan
    ``libk3.stream.trunk_modes.open_trunk`` runs and the doctor and ``k3-trace size``
    estimate from.

    Everything fits: all pinned, no ring. Otherwise a ring of 2 slots (sized for the two
    largest unpinned layers: the layer in use and the one being read) if the budget allows
    it, else 1 slot; then pin largest-first while pins + slots still fit. Costs count the
    layers' bytes; the few KB of alignment around each buffer, and a compressed layer's
    room to decode in place (at most one block, ``BlockPlan.in_place``), are part of the
    documented fixed overhead. BudgetError below ``trunk_floor``."""
    n = len(sizes)

    def plan(pinned, slots):
        return TrunkPlan(frozenset(pinned), tuple(slots),
                         sum(b for L, b in enumerate(sizes) if L not in pinned))
    if sum(sizes) <= budget:
        return plan(range(n), ())
    if budget < trunk_floor(sizes):
        raise BudgetError("trunk budget is below one layer slot",
                          expected=f">= {trunk_floor(sizes)} bytes", found=f"{budget} bytes",
                          hint=f"raise --trunk-gb to at least {gb_option(trunk_floor(sizes))}")
    order = sorted(range(n), key=lambda L: (-sizes[L], L))

    def ring(pinned, n_slots):
        rest = sorted((sizes[i] for i in range(n) if i not in pinned), reverse=True)
        return rest[:n_slots]

    for n_slots in (2, 1):
        pinned: set = set()
        for L in order:
            trial = pinned | {L}
            if sum(sizes[i] for i in trial) + sum(ring(trial, n_slots)) <= budget:
                pinned = trial
        slots = ring(pinned, n_slots)
        if len(pinned) < n and sum(sizes[i] for i in pinned) + sum(slots) <= budget:
            return plan(pinned, slots)
    raise AssertionError("one slot of the largest layer always fits at trunk_floor")


def expert_slots(sizes: ModelSizes, cache_bytes: int) -> int:
    return cache_bytes // sizes.expert_slot_bytes if sizes.expert_slot_bytes else 0


def minimum_budget(sizes: ModelSizes) -> Budget:
    """The smallest budget that works (``floor_problems``): one ring slot for the largest
    layer (or the whole trunk, if smaller) and top_k + 1 expert slots (or every expert,
    if fewer). The overhead comes on top (``overhead_bytes``)."""
    trunk = trunk_floor(sizes.layer_bytes)
    cache = cache_floor(sizes.expert_slot_bytes, sizes.top_k, sizes.total_experts)
    return Budget(trunk, cache, "minimum", (
        f"trunk {size_text(trunk)}: one ring slot for the largest trunk layer",
        f"cache {size_text(cache)}: {sizes.top_k + 1} expert slots (top_k + 1) of "
        f"{sizes.expert_slot_bytes} bytes"))
