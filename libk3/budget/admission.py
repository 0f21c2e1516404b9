"""Whether a budget fits a machine, and resolving the flags into one.

Owns: the fixed overhead a run needs besides its two budgets, the planned peak,
admission (``admission_problems``), the ``auto`` rule, ``--preset``/``--trunk-gb``/
``--cache-gb`` in argv order, the batch width and the prefill chunk. Does not own: the
trunk plan and the floor (``plan``), the presets file (``presets``), the model's sizes
(``sizes``), or what a run does with its budget (``libk3.run``).
"""

from __future__ import annotations

import math

from ..errors import BudgetError, UsageError
from ..units import size_text, size_texts
from .plan import Budget, floor_problems, minimum_budget, overlap_floor
from .presets import _FLAG_TEXT, FLAG_KEYS, GB, Rules, load_presets, load_rules
from .sizes import ModelSizes, sequence_bytes

def overhead_bytes(sizes: ModelSizes, rules: Rules | None = None, width: int = 1) -> int:
    """Bytes a run needs besides its two budgets: resident model-level tensors, the
    state of ``width`` sequences (a batch decoded in lockstep holds one per slot) with
    MLA caches for the preset file's context positions, the runtime reserve, and what
    its front end holds beside the model (``sizes.beside_bytes``: a server's)."""
    rules = rules or load_rules()
    return (sizes.resident_bytes + width * sequence_bytes(sizes, rules.context_positions)
            + rules.runtime_reserve_bytes + sizes.beside_bytes)


def minimum_memory(sizes: ModelSizes, rules: Rules | None = None) -> int:
    """Memory the minimum budget needs in all, overhead included."""
    rules = rules or load_rules()
    m = minimum_budget(sizes)
    return m.trunk_bytes + m.cache_bytes + overhead_bytes(sizes, rules)


def peak_bytes(budget: Budget, sizes: ModelSizes, rules: Rules | None = None,
               width: int = 1) -> int:
    """Planned peak: both budgets (clamped to the model) plus the overhead of ``width``
    sequences."""
    trunk = min(budget.trunk_bytes, sizes.trunk_bytes)
    cache = min(budget.cache_bytes, sizes.cache_all_bytes)
    return trunk + cache + overhead_bytes(sizes, rules, width=width)


def usable_memory(mem) -> int:
    """Bytes of a ``hwprobe.MemoryInfo`` (or a plain int) that a run may plan with."""
    return int(getattr(mem, "usable_bytes", mem))


def split_problems(trunk_bytes: int, cache_bytes: int, sizes: ModelSizes) -> list:
    """``floor_problems`` for this model."""
    return floor_problems(trunk_bytes, cache_bytes, sizes.layer_bytes, sizes.expert_slot_bytes,
                          sizes.top_k, sizes.total_experts)


def admission_problems(budget: Budget, sizes: ModelSizes, mem,
                       rules: Rules | None = None) -> list:
    """Why ``budget`` cannot run this model on a machine with ``mem``: [] when it can.
    Planned peak must stay within headroom_fraction of usable memory (a batch's width
    is judged on top by ``batch_width``)."""
    rules = rules or load_rules()
    problems = split_problems(budget.trunk_bytes, budget.cache_bytes, sizes)
    peak = peak_bytes(budget, sizes, rules)
    allowed = int(rules.headroom_fraction * usable_memory(mem))
    if peak > allowed:
        peak_t, usable_t = size_texts(peak, usable_memory(mem))
        problems.append(f"planned peak {peak_t} exceeds {rules.headroom_fraction:.0%} of "
                        f"the {usable_t} of memory available")
    return problems


def auto_budget(mem, sizes: ModelSizes, rules: Rules | None = None,
                fixed_trunk: int | None = None, fixed_cache: int | None = None,
                width: int = 1) -> Budget:
    """The ``auto`` rule (formats/presets.md 3): plan headroom_fraction x usable memory
    minus the overhead; the trunk gets it first (up to the whole trunk), the cache keeps
    max(floor, cache_floor) and takes the rest (up to every expert). A budget the caller
    fixed (a later flag) is kept and auto sizes only the other. BudgetError when even
    the minimum does not fit. ``width`` sequences' state is set aside first (a batch
    with a fixed ``--batch-width``)."""
    rules = rules or load_rules()
    usable = usable_memory(mem)
    over = overhead_bytes(sizes, rules, width=width)
    plan = int(rules.headroom_fraction * usable) - over
    floor = minimum_budget(sizes)
    if plan < floor.trunk_bytes + floor.cache_bytes:
        need, ring, cache, over_t, seq, have = size_texts(
            floor.trunk_bytes + floor.cache_bytes + over, floor.trunk_bytes,
            floor.cache_bytes, over, sequence_bytes(sizes, rules.context_positions), usable)
        raise BudgetError(
            "not enough memory for the smallest working budget"
            + (f" beside batch width {width}" if width > 1 else ""),
            expected=f">= {need} (ring {ring} + cache {cache} + overhead {over_t}"
                     + (f", {width} sequences of {seq}" if width > 1 else "")
                     + f") within {rules.headroom_fraction:.0%} of memory",
            found=f"{have} available",
            hint="free memory or run on a larger machine")
    usable_t, over_t, plan_t = size_texts(usable, over, plan)
    reasons = [f"auto: {rules.headroom_fraction:.0%} of {usable_t} available minus "
               f"{over_t} overhead leaves {plan_t}"]
    cache_keep = min(max(floor.cache_bytes, rules.cache_floor_bytes), sizes.cache_all_bytes)
    if fixed_trunk is not None:
        trunk = fixed_trunk
        cache = max(0, min(sizes.cache_all_bytes, plan - min(trunk, sizes.trunk_bytes)))
        reasons.append(f"auto: cache takes what the fixed trunk leaves, {size_text(cache)}")
    elif fixed_cache is not None:
        cache = fixed_cache
        trunk = max(0, min(sizes.trunk_bytes, plan - min(cache, sizes.cache_all_bytes)))
        reasons.append(f"auto: trunk takes what the fixed cache leaves, {size_text(trunk)}")
    else:
        # the overlapping ring (two slots) when it fits beside the cache floor
        ring = min(overlap_floor(sizes.layer_bytes), plan - floor.cache_bytes)
        trunk = min(sizes.trunk_bytes, max(ring, plan - cache_keep))
        cache = min(sizes.cache_all_bytes, plan - trunk)
        reasons.append(f"auto: trunk first, {size_text(trunk)}"
                       + (" (every layer pinned)" if trunk >= sizes.trunk_bytes else ""))
        reasons.append(f"auto: cache {size_text(cache)}"
                       + (" (every expert fits)" if cache >= sizes.cache_all_bytes else ""))
    return Budget(int(trunk), int(cache), "auto", tuple(reasons))


def _gb_to_bytes(flag: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise UsageError(f"{flag} must be a finite number of GB >= 0, got {value!r}")
    return int(round(value * GB))


def resolve_budget(name: str | None, trunk_gb: float | None = None,
                   cache_gb: float | None = None, order=None, mem=None,
                   model_sizes: ModelSizes | None = None, *, path=None,
                   width: int = 1) -> Budget:
    """The budget a run gets from ``--preset NAME``, ``--trunk-gb`` and ``--cache-gb``.

    ``order`` lists the given flags as they appeared in argv, as tokens of FLAG_KEYS
    ("preset", "trunk_gb", "cache_gb"); a later one overrides an earlier one for the
    values it sets (a preset sets both). Without ``order`` the preset comes first and the
    flags override it. No preset and no flag means ``auto``; a value that no flag sets
    comes from ``auto`` when the preset is auto or absent. ``auto`` needs ``mem`` (a
    ``hwprobe.MemoryInfo`` or bytes) and ``model_sizes``. With ``model_sizes`` budgets
    are clamped to the model (never more trunk than its trunk, nor more cache than all
    its experts) and a budget below ``minimum_budget`` raises BudgetError. Unknown
    presets and negative sizes raise UsageError. ``width``: sequences a batch holds at
    once, whose state ``auto`` sets aside."""
    presets = load_presets(path)
    rules = load_rules(path)
    if name is not None and name not in presets:
        raise UsageError(f"unknown preset {name!r}", hint=f"choose one of {', '.join(presets)}")
    given = {"preset": name, "trunk_gb": trunk_gb, "cache_gb": cache_gb}
    if order is None:
        order = [k for k in FLAG_KEYS if given[k] is not None]
    order = list(order)
    bad = [k for k in order if k not in FLAG_KEYS or given[k] is None]
    missed = [k for k in FLAG_KEYS if given[k] is not None and k not in order]
    if bad or missed or len(set(order)) != len(order):
        raise ValueError(f"order {order!r} must list each given flag once, from {FLAG_KEYS}")
    if "preset" not in order:
        order.insert(0, "preset")
        name = "auto"
    # each value: (source token, bytes or None for "auto computes it")
    source = {"trunk": None, "cache": None}
    value = {"trunk": None, "cache": None}
    reasons = []
    for tok in order:
        if tok == "preset":
            p = presets[name]
            for part, gb in (("trunk", p.trunk_gb), ("cache", p.cache_gb)):
                source[part] = f"preset {name}"
                value[part] = None if gb is None else _gb_to_bytes(f"preset {name}", gb)
        else:
            part = tok.split("_")[0]
            source[part] = _FLAG_TEXT[tok]
            value[part] = _gb_to_bytes(_FLAG_TEXT[tok], given[tok])
    if value["trunk"] is None or value["cache"] is None:
        if mem is None or model_sizes is None:
            raise ValueError("the auto preset needs mem and model_sizes")
        auto = auto_budget(mem, model_sizes, rules, fixed_trunk=value["trunk"],
                           fixed_cache=value["cache"], width=width)
        reasons += list(auto.reasons)
        value = {"trunk": auto.trunk_bytes, "cache": auto.cache_bytes}
    for part in ("trunk", "cache"):
        reasons.append(f"{part} {size_text(value[part])} from {source[part]}")
    trunk, cache = value["trunk"], value["cache"]
    if model_sizes is not None:
        if trunk > model_sizes.trunk_bytes:
            trunk = model_sizes.trunk_bytes
            reasons.append(f"trunk clamped to the model's {size_text(trunk)} "
                           "(every layer pinned)")
        if cache > model_sizes.cache_all_bytes:
            cache = model_sizes.cache_all_bytes
            reasons.append(f"cache clamped to {size_text(cache)} (every expert fits)")
        floor = minimum_budget(model_sizes)
        low = split_problems(trunk, cache, model_sizes)
        if low:
            raise BudgetError("budget below the smallest that can work: " + "; ".join(low),
                              expected=f"trunk >= {floor.trunk_bytes} B, cache >= "
                                       f"{floor.cache_bytes} B",
                              found=f"trunk {trunk} B, cache {cache} B",
                              hint="use --preset laptop or larger --trunk-gb/--cache-gb")
    from_preset = any(src.startswith("preset") for src in source.values())
    return Budget(int(trunk), int(cache), name if from_preset else None, tuple(reasons))


# ---- batch width (formats/presets.md 5) -----------------------------------------------

# ``auto`` width at most: a lockstep pass carries one prefill chunk (64 tokens by default)
# plus one token per sequence, so this keeps a pass's activations within two chunks'.
MAX_AUTO_WIDTH = 64


def batch_width(budget: Budget, sizes: ModelSizes, mem, requested, *, jobs: int | None = None,
                rules: Rules | None = None, held: int = 0) -> tuple:
    """(width, reasons) for ``--batch-width`` ``requested`` (an int >= 1 or "auto").

    Each sequence holds ``sequence_bytes`` for context_positions positions; the widths
    that fit are those whose states fit beside both budgets (clamped to the model), the
    resident tensors and the runtime reserve within headroom_fraction of usable memory.
    ``auto`` takes the largest, at most ``jobs`` (the prompts to run) and MAX_AUTO_WIDTH;
    a requested width that does not fit raises BudgetError with the figures, as does a
    machine where not even one sequence fits. ``held``: sequences' states kept besides
    the lanes (the state store's, ``store.StoreShare.states``)."""
    rules = rules or load_rules()
    per = sequence_bytes(sizes, rules.context_positions)
    allowed = int(rules.headroom_fraction * usable_memory(mem))
    trunk = min(budget.trunk_bytes, sizes.trunk_bytes)
    cache = min(budget.cache_bytes, sizes.cache_all_bytes)
    fixed = peak_bytes(budget, sizes, rules, width=held)
    fit = max(0, (allowed - fixed) // per)
    t = size_texts(trunk, cache, fixed - trunk - cache, max(0, allowed - fixed), allowed,
                   usable_memory(mem), per)
    figures = (f"trunk {t[0]} + cache {t[1]} + resident and reserve"
               + (f" and {held} snapshot{'s' if held > 1 else ''}" if held else "")
               + f" {t[2]} leave {t[3]} of "
               f"{t[4]} ({rules.headroom_fraction:.0%} of {t[5]}) "
               f"for sequences of {t[6]} each ({rules.context_positions} positions)")
    want = fit if requested == "auto" else int(requested)
    if want < 1 or (requested != "auto" and want > fit):
        raise BudgetError(
            f"batch width {requested} does not fit: {figures}",
            expected=f"width <= {fit}", found=f"width {requested}",
            hint=(f"use --batch-width {fit} (or auto)" if fit >= 1 else
                  "free memory or choose smaller --trunk-gb/--cache-gb"))
    reasons = [figures + f": {fit} fit"]
    width = want
    if requested == "auto":
        caps = [(MAX_AUTO_WIDTH, "the auto maximum")]
        if jobs is not None:
            caps.append((max(1, jobs), "the prompts to run"))
        for cap, why in caps:
            if width > cap:
                width = cap
                reasons.append(f"auto: capped at {cap} ({why})")
        reasons.append(f"auto: width {width}")
    else:
        reasons.append(f"width {width} from --batch-width")
    return width, tuple(reasons)


# ---- prefill chunk (formats/presets.md 6) -----------------------------------------------

# The prefill chunks the rule picks from. Why raise it: a chunk streams the trunk once and
# loads the union of its tokens' experts, so a longer chunk reads fewer bytes per prompt
# token (bench/README.md, "Prefill chunk"); past 512 the union is nearly every expert.
PREFILL_CHUNKS = (128, 256, 512)
# A chunk's activations beyond the base chunk's take at most this share of the expert cache.
CHUNK_CACHE_SHARE = 1 / 16


def prefill_chunk(budget: Budget, sizes: ModelSizes, base: int,
                  requested: int | None = None) -> tuple:
    """(chunk, cache bytes, reason): the prompt tokens per prefill pass and what is left
    of ``budget``'s expert cache beside its activations.

    The runtime reserve holds the activations of a ``base``-token pass; a longer chunk's
    extra activations (``activation_token_bytes`` per token) come out of the expert
    cache, never on top of the budget. Unless ``requested``, the chunk is the longest of
    PREFILL_CHUNKS whose extra is at most CHUNK_CACHE_SHARE of the cache and leaves the
    cache its floor, else ``base``. A ``requested`` chunk takes its extra from the cache
    as far as the floor allows (the rest raises the peak: the reason says by how much).
    Same arithmetic at every chunk: it only sets how many tokens a pass feeds."""
    floor = minimum_budget(sizes).cache_bytes
    cache = budget.cache_bytes
    extra = lambda k: max(0, k - base) * sizes.activation_token_bytes  # noqa: E731
    if requested is None:
        fits = [k for k in PREFILL_CHUNKS if k > base and extra(k) <= CHUNK_CACHE_SHARE * cache
                and cache - extra(k) >= floor]
        chunk = max(fits, default=base)
    else:
        chunk = requested
    need = extra(chunk)
    if need == 0:
        return chunk, cache, ""
    taken = min(need, max(0, cache - floor))
    if taken < need:
        return chunk, cache - taken, (
            f"prefill chunk {chunk}: its activations beyond {base} tokens' raise the peak by "
            f"{size_text(need - taken)} (the expert cache is at its floor)")
    return chunk, cache - taken, (f"prefill chunk {chunk}: its activations beyond {base} "
                                  f"tokens' ({size_text(need)}) come out of the expert cache")
