"""k3-doctor's advice: from a model's sizes, the machine's memory and measured speeds, which
preset to run, at what batch width, the s/token it should give, and whether a compressed
trunk or a draft pays (the formula in ``report``'s module docstring).

Owns: ``decide``, ``estimate`` (and ``placement_estimate``, the same over several
drives), ``hit_rate``, ``drafting_advice``,
``compression_advice`` and the figures they rest on. Does not own: measuring
(``libk3.machine``, ``timing``), the budget rules (``libk3.budget``), gathering the
report (``report``).
"""

from __future__ import annotations

from .. import budget
from ..budget import ModelSizes
from ..errors import BudgetError
from ..units import size_text, size_texts


AUTO_EXCLUDED = ("max",)          # never picked: beyond server, memory buys cache hits, not speed
HIT_CAP = 0.95                    # a partial cache never counts as more than 95 % hits
COMPRESS_GAIN = 0.95              # recommend a compressed trunk only if it saves >= 5 %
# Distinct experts of w consecutive tokens, in tokens' worth: about w^EXPERT_UNION
# (synthetic traces at K3's shape, checked against published prefill reads; bench/README.md,
# "Drafting").
EXPERT_UNION = 0.75
PUBLISHED_ACCEPTANCE = (("worst", 2.63), ("mean", 3.66), ("best", 5.55))   # dspark.md §7


def hit_rate(sizes: ModelSizes, cache_bytes: int) -> float:
    """Expected expert-cache hit rate under uniform routing (module docstring)."""
    if sizes.total_experts == 0:
        return 1.0
    slots = budget.expert_slots(sizes, cache_bytes)
    if slots >= sizes.total_experts:
        return 1.0
    return min(HIT_CAP, slots / sizes.total_experts)


def estimate(sizes: ModelSizes, split: budget.Budget, seq_bps, rand_bps,
             kernels: dict | None) -> dict | None:
    """Seconds per decoded token and its parts (module docstring), or None without
    measured speeds."""
    if not seq_bps or not kernels:
        return None
    plan = budget.plan_trunk(sizes.layer_bytes, min(split.trunk_bytes, sizes.trunk_bytes))
    hit = hit_rate(sizes, split.cache_bytes)
    misses = sizes.moe_layers * sizes.top_k * (1.0 - hit)
    trunk_io = plan.streamed_bytes / seq_bps
    if misses and not rand_bps:
        return None
    expert_io = misses * sizes.expert_bytes / rand_bps if misses else 0.0
    dense = (sizes.bf16_trunk_bytes + sizes.lm_head_bytes) / kernels["bf16_bytes_per_s"]
    experts = sizes.active_expert_bytes / kernels["mxfp4_bytes_per_s"]
    return {"seconds_per_token": trunk_io + expert_io + dense + experts, "trunk_io_s": trunk_io,
            "expert_io_s": expert_io, "compute_s": dense + experts,
            "dense_compute_s": dense, "expert_compute_s": experts,
            "pinned_layers": len(plan.pinned),
            "ring_bytes": plan.ring_bytes, "trunk_streamed_bytes": plan.streamed_bytes,
            "expert_hit_rate": hit, "expert_misses": misses,
            "kernels": kernels.get("source")}


def placement_estimate(est: dict, trunk_drives: dict, expert_drive: tuple,
                       expert_bytes: int) -> dict:
    """``est`` (one drive's ``estimate``) with the trunk striped evenly over
    ``trunk_drives`` (device -> sequential B/s) and the experts read from ``expert_drive``
    (device, random B/s): each drive's reads add up, the drives read at once (a queue
    each), so the I/O takes the busiest drive's time; compute as in ``estimate``. On one
    drive holding both it is ``estimate``'s figure."""
    work: dict = {}
    share = est["trunk_streamed_bytes"] / len(trunk_drives)
    for dev, bps in trunk_drives.items():
        work[dev] = work.get(dev, 0.0) + share / bps
    dev, rand_bps = expert_drive
    if est["expert_misses"]:
        work[dev] = work.get(dev, 0.0) + est["expert_misses"] * expert_bytes / rand_bps
    io = max(work.values(), default=0.0)
    return {"seconds_per_token": io + est["compute_s"], "io_s": io,
            "drive_seconds": {str(k): v for k, v in work.items()}}


def drafting_advice(est: dict | None, draft_bytes: int, lm_head_bytes: int,
                    kernels: dict | None, cap: int) -> dict | None:
    """Whether drafting pays at a preset whose plain estimate is ``est``: a verify pass of
    w tokens costs the trunk's reads and dense compute once and w^EXPERT_UNION tokens'
    worth of experts (consecutive tokens share many); the draft pass reads its weights
    and the target's head once; the width is ``speculative.best_width``'s choice at each
    published acceptance (dspark.md §7). None without an estimate."""
    from ..speculate.speculative import acceptance_for, best_width
    if est is None or not kernels:
        return None
    fixed = est["trunk_io_s"] + est["dense_compute_s"]
    per_token = est["expert_io_s"] + est["expert_compute_s"]
    plain = est["seconds_per_token"]
    draft = (draft_bytes + lm_head_bytes) / kernels["bf16_bytes_per_s"]
    rows = []
    for label, mean in PUBLISHED_ACCEPTANCE:
        conf = [acceptance_for(mean, cap)] * cap
        L, e, c = best_width(conf, lambda w: fixed + w ** EXPERT_UNION * per_token + draft)
        spt = c[L] / e[L] if L else plain
        if spt >= plain:
            L, spt = 0, plain
        rows.append({"acceptance": label, "mean_accepted": mean, "proposals": L,
                     "tokens_per_pass": round(float(e[L]), 3),
                     "seconds_per_token": spt, "vs_plain": spt / plain})
    mean_row = rows[1]
    pays = mean_row["vs_plain"] < 1.0
    why = (f"at the published mean acceptance ({mean_row['mean_accepted']} tokens per "
           f"pass verifying all {cap}): {mean_row['tokens_per_pass']:.2f} tokens per pass "
           f"verifying {mean_row['proposals']}, {mean_row['vs_plain']:.2f}x plain s/token; "
           f"the draft pass {draft:.2f} s")
    return {"draft_seconds": draft, "rows": rows, "pays": pays,
            "why": ("drafting pays " if pays else "drafting does not pay ") + why}


def decide(sizes: ModelSizes, memory, *, seq_bps=None, rand_bps=None, kernels=None,
           rules: budget.Rules | None = None) -> dict:
    """Every preset's budget, peak, fit and estimate; the pick and why; the smallest
    working budget. ``problems`` lists why nothing can run (memory)."""
    rules = rules or budget.load_rules()
    table = budget.load_presets()
    usable = budget.usable_memory(memory)
    floor = budget.minimum_budget(sizes)
    floor_total = budget.minimum_memory(sizes, rules)
    rows = {}
    for name in budget.NAMED:
        b = budget.resolve_budget(name, model_sizes=sizes)
        rows[name] = {"budget": b.to_json(), "description": table[name].description,
                      "peak_bytes": budget.peak_bytes(b, sizes, rules),
                      "problems": budget.admission_problems(b, sizes, memory, rules),
                      "estimate": estimate(sizes, b, seq_bps, rand_bps, kernels)}
    try:
        ab = budget.resolve_budget("auto", mem=memory, model_sizes=sizes)
        rows["auto"] = {"budget": ab.to_json(), "description": table["auto"].description,
                        "peak_bytes": budget.peak_bytes(ab, sizes, rules),
                        "problems": budget.admission_problems(ab, sizes, memory, rules),
                        "estimate": estimate(sizes, ab, seq_bps, rand_bps, kernels)}
    except BudgetError as e:
        rows["auto"] = {"budget": None, "description": table["auto"].description,
                        "peak_bytes": None, "problems": [e.one_line()], "estimate": None}
    for row in rows.values():
        row["batch_width"] = _batch_width(row, sizes, memory, rules)
    fitting = [n for n in budget.NAMED if n not in AUTO_EXCLUDED and not rows[n]["problems"]]
    pick, why, problems = None, None, []
    allowed = rules.headroom_fraction * usable
    if fitting:
        eff = {n: rows[n]["budget"]["trunk_bytes"] + rows[n]["budget"]["cache_bytes"]
               for n in fitting}
        pick = max(fitting, key=lambda n: (eff[n], -budget.NAMED.index(n)))
        bigger = [n for n in budget.NAMED if n not in AUTO_EXCLUDED
                  and budget.NAMED.index(n) > budget.NAMED.index(pick)]
        b = rows[pick]["budget"]
        if b["trunk_bytes"] >= sizes.trunk_bytes and b["cache_bytes"] >= sizes.cache_all_bytes:
            why = (f"{pick}: the smallest preset that holds the whole model (every layer "
                   f"pinned, every expert cached; peak {size_text(rows[pick]['peak_bytes'])})")
        else:
            peak, have, more = size_texts(rows[pick]["peak_bytes"], usable,
                                          rows[bigger[0]]["peak_bytes"] if bigger else 0)
            why = (f"{pick}: the largest preset whose planned peak ({peak}) fits "
                   f"{rules.headroom_fraction:.0%} of the {have} available")
            if bigger:
                why += f"; {bigger[0]} would need {more}"
    elif not rows["auto"]["problems"]:
        pick = "auto"
        why = (f"auto: no named preset fits {rules.headroom_fraction:.0%} of the "
               f"{size_text(usable)} available, but the computed budget does")
    else:
        have, need, ring, cache, over, least = size_texts(
            usable, floor_total, floor.trunk_bytes, floor.cache_bytes,
            budget.overhead_bytes(sizes, rules), floor_total / rules.headroom_fraction)
        problems.append(
            f"memory: {have} available, the smallest working budget needs {need} within "
            f"{rules.headroom_fraction:.0%} of it (ring {ring} + cache {cache} + overhead "
            f"{over}); needs at least {least} available")
    return {"memory_usable_bytes": usable, "memory_plannable_bytes": int(allowed),
            "overhead_bytes": budget.overhead_bytes(sizes, rules),
            "sequence_bytes": budget.sequence_bytes(sizes, rules.context_positions),
            "context_positions": rules.context_positions,
            "batch": _batch_pick(rows, sizes),
            "minimum_budget": floor.to_json(), "minimum_memory_bytes": floor_total,
            "presets": rows, "pick": pick, "why": why, "problems": problems}


def _batch_width(row: dict, sizes: ModelSizes, memory, rules) -> int | None:
    """The width ``k3-run --batch`` picks (``--batch-width auto``) beside a preset's
    budget, or None when the preset does not fit or no sequence fits beside it."""
    if row["budget"] is None or row["problems"]:
        return None
    b = row["budget"]
    held = budget.Budget(b["trunk_bytes"], b["cache_bytes"], b["preset"], ())
    try:
        return budget.batch_width(held, sizes, memory, "auto", rules=rules,
                                  held=budget.BATCH_SNAPSHOTS)[0]
    except BudgetError:
        return None


def _batch_pick(rows: dict, sizes: ModelSizes) -> dict | None:
    """For batch work: the preset and width that read the fewest trunk bytes per generated
    token (a lockstep pass streams the unpinned trunk once for its W tokens; experts are
    read per token either way, less what the W tokens share), ties to the wider."""
    best = None
    for name, row in rows.items():
        if not row["batch_width"]:
            continue
        b = row["budget"]
        streamed = budget.plan_trunk(sizes.layer_bytes, b["trunk_bytes"]).streamed_bytes
        key = (streamed / row["batch_width"], -row["batch_width"])
        if best is None or key < best[0]:
            best = (key, {"preset": name, "width": row["batch_width"],
                          "trunk_bytes_per_token": int(key[0])})
    return best[1] if best else None


def compression_advice(est: dict | None, seq_bps, decode: dict | None) -> dict:
    """Whether a compressed trunk (``k3-pack compress``) pays at the estimate ``est`` (one
    preset's), with the expected s/token both ways. Compressed, the streamed trunk reads
    ``fraction`` of its bytes and is decoded at ``decode_bytes_per_s``; the two overlap
    (piece by piece), so its time is the larger of the two, in place of the raw read."""
    if not est or not seq_bps or not decode:
        return {"recommend": None, "why": "not measured (--quick, or no disk read figure)"}
    streamed = est["trunk_streamed_bytes"]
    raw_io = streamed / seq_bps
    read_io = decode["fraction"] * streamed / seq_bps
    decode_s = streamed / decode["decode_bytes_per_s"]
    raw = est["seconds_per_token"]
    packed = raw - raw_io + max(read_io, decode_s)
    yes = streamed > 0 and packed < COMPRESS_GAIN * raw
    if not streamed:
        why = "no: the whole trunk is pinned in RAM at this preset, nothing streams"
    elif yes:
        why = (f"yes: the disk ({seq_bps / 1e6:,.0f} MB/s) is the bottleneck; decoding runs at "
               f"{decode['decode_bytes_per_s'] / 1e6:,.0f} MB/s and reads "
               f"{decode['fraction']:.0%} of the bytes")
    else:
        why = (f"no: decoding ({decode['decode_bytes_per_s'] / 1e6:,.0f} MB/s of output) "
               f"would not beat reading raw at {seq_bps / 1e6:,.0f} MB/s by "
               f"{1 - COMPRESS_GAIN:.0%}")
    return {"recommend": yes, "why": why, "seconds_per_token_raw": raw,
            "seconds_per_token_compressed": packed, "trunk_streamed_bytes": streamed,
            "read_bytes_per_s": seq_bps, "decode": decode}


# ---- the whole report ------------------------------------------------------------------
