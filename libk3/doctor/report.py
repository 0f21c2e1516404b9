"""k3-doctor's report: can this machine run this model, with which preset, and what next.

Owns: putting the machine facts (``facts``), the model directory's health
(config, shard completeness, each shard's size against its own header), the pack
directory's state, the presets (``libk3.budget``) and a per-token time estimate
together into one JSON-ready report with its exit status, and rendering that report as
text. Does not own: measuring (``libk3.machine``, ``timing``), budget rules
(``libk3.budget``), packing (``libk3.pack.writer``) or option parsing (``tools/k3-doctor``).

Exit status: 0 the machine can run the model; 1 it cannot, with every reason listed
(incomplete or invalid checkpoint, memory below the smallest working budget, too little
disk for the pack); 2 is the front end's, for usage errors.

The s/token estimate (per decoded token, steady state; deliberately rough):
  trunk bytes not pinned / best sequential read speed
  + expected expert misses x expert bytes / random read speed at the best queue depth
  + always-active bytes / measured kernel bytes per second
where expected misses = MoE layers x top_k x (1 - hit) and hit = cache slots / (MoE
layers x experts), or 1 when every expert fits. That hit rate assumes uniform routing, so
it is pessimistic: real routing is skewed, and a cache keeps more of it than this
formula says. I/O and compute are summed, not
overlapped, so the figure is an upper estimate for an engine that overlaps them.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path

from .. import budget
from ..budget import ModelSizes
from ..config import K3Config, load_config
from ..errors import BudgetError, CheckpointError, ConfigError
from ..k3_dims import real_config
from ..machine import memory as _memory, storage
from ..units import size_text, size_texts
from . import facts

EXAMPLE_PROMPT = "The capital of France is"
EXAMPLE_IDS = "1,2,3"             # for models without a tokenizer
AUTO_EXCLUDED = ("max",)          # never picked: beyond server, memory buys cache hits, not speed
HIT_CAP = 0.95                    # a partial cache never counts as more than 95 % hits
COMPRESS_GAIN = 0.95              # recommend a compressed trunk only if it saves >= 5 %
# Distinct experts of w consecutive tokens, in tokens' worth: about w^EXPERT_UNION
# (synthetic traces at K3's shape, checked against published prefill reads; bench/README.md,
# "Drafting").
EXPERT_UNION = 0.75
PUBLISHED_ACCEPTANCE = (("worst", 2.63), ("mean", 3.66), ("best", 5.55))   # dspark.md §7


@dataclasses.dataclass
class Diagnosis:
    """``report`` is what --json prints; the rest lets callers ask follow-up questions
    (e.g. ``decide`` with another memory) without probing again."""

    report: dict
    sizes: ModelSizes | None
    memory: _memory.MemoryInfo
    exit_status: int


def reference_config() -> K3Config:
    """Kimi K3's architecture, for the machine-only report (no model given)."""
    return real_config()


def default_pack_dir(model_dir, env=None) -> Path:
    """Where the doctor suggests packing when --pack is not given: a sibling directory
    ``MODEL-pack``, unless that lies inside a git checkout (a pack there would show up
    as gigabytes of untracked files) or where this user cannot write; then
    ``$XDG_DATA_HOME/k3/packs/MODEL-pack`` (``~/.local/share``), the first of the two
    that is neither (else the second: the disk check then says what is wrong)."""
    m = Path(os.path.abspath(model_dir))
    env = os.environ if env is None else env
    base = env.get("XDG_DATA_HOME", "")
    data = Path(base) if os.path.isabs(base) else \
        Path(env.get("HOME") or Path.home()) / ".local" / "share"
    candidates = (m.with_name(m.name + "-pack"), data / "k3" / "packs" / (m.name + "-pack"))
    for c in candidates:
        if not storage.in_git_checkout(c) and _writable(c):
            return c
    return candidates[-1]


def _writable(path: Path) -> bool:
    """Whether this user may create ``path`` (its nearest existing ancestor is a
    writable directory)."""
    for q in (path, *path.parents):
        if q.exists():
            return q.is_dir() and os.access(q, os.W_OK | os.X_OK)
    return False


# ---- the model directory -------------------------------------------------------------

def inspect_model(model_dir, pack_dir) -> tuple:
    """(section, sizes or None, problems, warnings) for one model directory. Problems
    are one line each and name the file (and tensor) at fault."""
    from ..io.checkpoint import Checkpoint, survey_shards
    from ..pack.writer import PARTIAL_FILE, disk_needed, pack_state, plan_pack

    d = Path(model_dir)
    sec = {"path": str(d), "config": None, "shards": None, "sizes": None, "pack": None}
    problems, warnings = [], []
    try:
        cfg = load_config(d)
    except ConfigError as e:
        sec["config"] = {"ok": False, "error": e.one_line()}
        problems.append(f"config: {e.one_line()}")
        return sec, None, problems, warnings
    sec["config"] = {"ok": True, "source": cfg.source, "layers": cfg.num_hidden_layers,
                     "layer_map": cfg.layer_map, "experts": cfg.num_experts,
                     "top_k": cfg.num_experts_per_token, "fingerprint": cfg.fingerprint()}
    sizes = ModelSizes.from_config(cfg)
    try:
        survey = survey_shards(d)
        present, shard_problems = survey.shards, survey.problems
    except CheckpointError as e:
        problems.append(f"checkpoint: {e.one_line()}")
        sec["shards"] = {"ok": False, "problems": [e.one_line()]}
        _note_sizes(sec, sizes)
        return sec, sizes, problems, warnings
    apparent = sum(os.stat(p).st_size for p in present)
    allocated = sum(os.stat(p).st_blocks * 512 for p in present)
    sec["shards"] = {"ok": not shard_problems,
                     "expected": len(present) + len(survey.missing),
                     "present": len(present), "indexed": survey.weight_map is not None,
                     "apparent_bytes": apparent, "allocated_bytes": allocated,
                     "problems": [e.one_line() for e in shard_problems]}
    if apparent and allocated < storage.DATA_FRACTION * apparent:
        held, whole = size_texts(allocated, apparent)
        warnings.append(f"the shards are sparse: {held} allocated of {whole} (a synthetic "
                        "checkpoint? holes read as zeros)")
    for tok in ("tiktoken.model", "tokenizer_config.json"):
        if not (d / tok).is_file():
            warnings.append(f"{d / tok} is missing: k3-run will need --ids instead of --prompt")
    if shard_problems:
        problems += [f"checkpoint: {e.one_line()}" for e in shard_problems]
        _note_sizes(sec, sizes)
        return sec, sizes, problems, warnings
    pack = Path(pack_dir)
    try:
        with Checkpoint.open(d, cfg, survey=survey) as ckpt:
            sizes = ModelSizes.from_checkpoint(ckpt)
            needed = disk_needed(plan_pack(ckpt))
            state = pack_state(pack, ckpt)
    except CheckpointError as e:
        problems.append(f"checkpoint: {e.one_line()}")
        _note_sizes(sec, sizes)
        return sec, sizes, problems, warnings
    have = 0
    if state == "partial" and (pack / PARTIAL_FILE).is_file():
        have = min(needed, os.stat(pack / PARTIAL_FILE).st_blocks * 512)
    remaining = {"complete": 0, "partial": needed - have}.get(state, needed)
    sec["pack"] = {"directory": str(pack), "state": state, "trunk_bytes_needed": needed,
                   "bytes_still_to_write": remaining}
    _note_sizes(sec, sizes)
    return sec, sizes, problems, warnings


def _note_sizes(sec: dict, sizes: ModelSizes) -> None:
    sec["sizes"] = sizes.to_json()


# ---- the decision ------------------------------------------------------------------------

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


def drafting_advice(est: dict | None, draft_bytes: int, lm_head_bytes: int,
                    kernels: dict | None, cap: int) -> dict | None:
    """Whether drafting pays at a preset whose plain estimate is ``est``: a verify pass of
    w tokens costs the trunk's reads and dense compute once and w^EXPERT_UNION tokens'
    worth of experts (consecutive tokens share many); the draft pass reads its weights
    and the target's head once; the width is ``speculative.best_width``'s choice at each
    published acceptance (dspark.md §7). None without an estimate."""
    from ..engine.speculative import acceptance_for, best_width
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

def diagnose(model=None, pack=None, *, quick: bool = False,
             memory: _memory.MemoryInfo | None = None,
             probe_bytes: int = storage.DEFAULT_PROBE_BYTES, progress: bool = False,
             seq_seconds: float = 3.0, rand_seconds: float = 1.5,
             pack_free_bytes: int | None = None, read_bps: float | None = None,
             decode_bps: float | None = None, probe_tmp=None, draft=None) -> Diagnosis:
    """Probe, inspect and decide. ``memory`` overrides the memory probe (simulated
    machines); ``pack_free_bytes`` overrides the free space seen at the pack directory
    (tests); ``read_bps`` the measured sequential read rate and ``decode_bps`` the
    compressed trunk's measured decode rate; ``probe_tmp`` is where a probe file goes
    first (``storage.probe_dir``; default the temporary directory). ``quick`` skips the
    disk, kernel and decode measurements (no estimates). ``draft``: a DSpark draft
    directory for ``model``, checked, counted in every budget and judged (does drafting
    pay at the pick?)."""
    mem = memory if memory is not None else _memory.probe_memory()
    machine = facts.probe_machine(mem)
    problems, warnings = list(), list(machine["warnings"])
    model_sec, sizes = None, None
    pack_dir = Path(pack) if pack is not None else (default_pack_dir(model) if model else None)
    if model is not None:
        model_sec, sizes, p, w = inspect_model(model, pack_dir)
        problems += p
        warnings += w
    # storage: each directory once per filesystem, the model's first (its shards); a
    # probe file never goes into the model's or the pack's directory
    stores, measured_dev = [], {}
    targets = []
    if model is not None:
        targets.append(("model", Path(model)))
    if pack_dir is not None:
        targets.append(("pack" if pack is not None else "pack (suggested)", pack_dir))
    avoid = [d for _, d in targets]
    for role, d in targets:
        dev = os.stat(storage.existing_ancestor(d)).st_dev
        shards = sorted(Path(d).glob("*.safetensors")) if role == "model" else []
        if dev in measured_dev:
            info = storage.probe_storage(d, measure=False, model_files=shards,
                                          avoid=avoid, tmp=probe_tmp)
            info["reads"] = measured_dev[dev]["reads"]
            info["measured_on"] = measured_dev[dev]["measured_on"]
            info["measured"] = measured_dev[dev]["measured"]
            info["notes"].append(f"same filesystem as {measured_dev[dev]['directory']}; "
                                 "measured once")
        else:
            info = storage.probe_storage(d, measure=not quick, model_files=shards,
                                         avoid=avoid, tmp=probe_tmp,
                                         probe_bytes=probe_bytes, seq_seconds=seq_seconds,
                                         rand_seconds=rand_seconds, progress=progress)
            measured_dev[dev] = info
        info["role"] = role
        stores.append(info)
        if info["o_direct"] is False:
            warnings.append(f"{d}: O_DIRECT does not work here ({info['o_direct_note']}); "
                            "k3-run will read through the page cache")
    reference = sizes is None
    cfg = reference_config() if reference else None
    if reference:
        sizes = ModelSizes.from_config(cfg)
    draft_sec = None
    if draft is not None:
        draft_sec, sizes = _with_draft(draft, model, sizes, problems)
    kernels = None
    if not quick:
        from ..engine.precompile import prepare
        from . import timing
        prepare(["kernel-timing"], show=progress)    # announced here, after the disk probe
        bf16_shapes, mxfp4_shapes = timing.kernel_shapes(cfg or load_config(model))
        kernels = timing.measure_kernels_twice(bf16_shapes=bf16_shapes,
                                               mxfp4_shapes=mxfp4_shapes)
        if kernels["unreliable"]:
            warnings.append("kernel timings are unreliable: " + kernels["unreliable"])
    seq_bps, rand_bps = _speeds(stores)
    seq_bps = read_bps or seq_bps
    decision = decide(sizes, mem, seq_bps=seq_bps, rand_bps=rand_bps, kernels=kernels)
    decode = None
    if not quick:
        import numba

        from . import timing
        decode = timing.measure_trunk_decode(numba.get_num_threads())
        if decode_bps:
            decode["decode_bytes_per_s"] = float(decode_bps)
    pick = decision["pick"]
    if draft_sec is not None and draft_sec["ok"]:
        draft_sec["advice"] = drafting_advice(
            decision["presets"][pick]["estimate"] if pick else None,
            draft_sec["bytes"], sizes.lm_head_bytes, kernels, draft_sec["cap"])
    decision["drafting"] = draft_sec
    decision["compression"] = compression_advice(
        decision["presets"][pick]["estimate"] if pick else None, seq_bps, decode)
    decision["sizes_of"] = "Kimi K3 (reference config)" if reference else str(model)
    problems += decision["problems"]
    disk = None
    if model_sec is not None and model_sec.get("pack"):
        disk = _disk_check(model_sec["pack"], stores, pack_free_bytes)
        if disk["problem"]:
            problems.append(disk["problem"])
    nxt = _next_steps(model, pack, pack_dir, model_sec, decision, problems)
    report = {"machine": machine, "storage": stores, "model": model_sec, "kernels": kernels,
              "decision": decision, "disk_for_pack": disk, "problems": problems,
              "warnings": warnings, "next_commands": nxt["commands"], "next_step": nxt["text"],
              "quick": quick, "can_run": not problems, "exit_status": 1 if problems else 0}
    return Diagnosis(report, None if reference else sizes, mem, report["exit_status"])


def _with_draft(draft, model, sizes: ModelSizes, problems: list) -> tuple:
    """(the report's draft section, ``sizes`` with the draft counted): the draft checked
    against the model (not read); a bad one is a problem naming its file."""
    from ..draft.checkpoint import load_draft
    from ..errors import K3Error
    if model is None:
        problems.append("draft: --draft needs the model directory it was made for")
        return {"path": str(draft), "ok": False}, sizes
    try:
        d = load_draft(draft, load_config(model), read=False)
    except K3Error as e:
        problems.append(f"draft: {e.one_line()}")
        return {"path": str(draft), "ok": False, "error": e.one_line()}, sizes
    cfg = load_config(model)
    kv = d.cfg.num_hidden_layers * d.cfg.cache_width * 4
    return ({"path": str(draft), "ok": True, "bytes": d.nbytes,
             "streamed_bytes": d.streamed_nbytes, "cap": d.cfg.block_size,
             "taps": list(d.cfg.target_layer_ids)},
            budget.with_draft(sizes, cfg, d.nbytes, kv, d.cfg.block_size))


def _speeds(storage: list) -> tuple:
    """(sequential B/s for the trunk, random B/s for experts). The trunk streams from the
    pack when there is one, the experts always from the model's shards."""
    by_role = {s["role"].split(" ")[0]: s for s in storage if s.get("reads")}
    trunk = by_role.get("pack") or by_role.get("model")
    experts = by_role.get("model") or by_role.get("pack")
    seq = trunk["reads"]["seq_best_bps"] if trunk else None
    rand = experts["reads"]["rand_best_bps"] if experts else None
    return seq or None, rand or None


def _disk_check(pack_sec: dict, storage: list, free_override) -> dict:
    st = next(s for s in storage if s["role"].startswith("pack"))
    free = st["free_bytes"] if free_override is None else int(free_override)
    need = pack_sec["bytes_still_to_write"]
    problem = None
    if need > free:
        need_t, free_t = size_texts(need, free)
        problem = (f"disk: the pack needs {need_t} more at {pack_sec['directory']}, only "
                   f"{free_t} free on its filesystem ({st['mount_point']}); choose --pack "
                   "on a disk with room (k3-run can also read the trunk from the shards, "
                   "slower)")
    return {"directory": pack_sec["directory"], "needed_bytes": pack_sec["trunk_bytes_needed"],
            "still_to_write_bytes": need, "free_bytes": free, "problem": problem}


def _next_steps(model, pack, pack_dir, model_sec, decision, problems) -> dict:
    q = shlex.quote
    if model is None:
        return {"commands": [], "text": "give a model directory (and --pack DIR) for a full "
                                        "check: k3-doctor MODEL --pack PACK_DIR"}
    if problems:
        return {"commands": [], "text": "fix the problems above, then run k3-doctor again"}
    preset = decision["pick"]
    state = (model_sec.get("pack") or {}).get("state")
    target = Path(pack_dir)
    cmds = []
    if state == "stale":
        target = default_pack_dir(model)
        if os.path.abspath(target) == os.path.abspath(pack_dir):
            target = Path(str(pack_dir) + "-2")
    compress = (decision.get("compression") or {}).get("recommend")
    if state != "complete":
        cmds.append(f"k3-pack {q(str(model))} {q(str(target))}"
                    + (" --compress-trunk" if compress else ""))
    elif compress and not (target / "trunk.kz").is_file():
        cmds.append(f"k3-pack compress {q(str(target))}")
    prompt = (f"--prompt {q(EXAMPLE_PROMPT)}" if (Path(model) / "tiktoken.model").is_file()
              else f"--ids {EXAMPLE_IDS}")
    cmds.append(f"k3-run {q(str(model))} --pack {q(str(target))} --preset {preset} {prompt}")
    text = {"complete": "the pack is ready: run",
            "partial": "resume the interrupted pack, then run",
            "stale": f"{pack_dir} holds a pack of another checkpoint: pack into a new "
                     "directory, then run",
            "missing": "pack the trunk (once), then run"}.get(state, "run")
    return {"commands": cmds, "text": text}


# ---- text ----------------------------------------------------------------------------------

def _gb(n) -> str:
    """A size for the text report (``libk3.units``); "?" when it is unknown."""
    return "?" if n is None else size_text(n)


def _mbs(n) -> str:
    return "-" if not n else f"{n / 1e6:,.0f} MB/s"


def render_text(report: dict) -> str:
    """The human-readable report (what k3-doctor prints without --json), section by
    section."""
    out = []
    for section in (_render_machine, _render_storage, _render_kernels, _render_model,
                    _render_decision, _render_verdict):
        section(report, out.append)
    return "\n".join(out) + "\n"


def _render_machine(report: dict, w) -> None:
    """The machine: packages, threads, CPU, load, memory."""
    m = report["machine"]
    w("== machine")
    w(f"python {m['python']} ({m['implementation']}), "
      + ", ".join(f"{k} {v or 'missing'}" for k, v in m["packages"].items()))
    thr = m["numba"]
    w(f"numba threading layer: {thr['layer']} ({thr['threads']} threads, idle threads: "
      f"{thr['wait_policy'] or 'the runtime default'}; fitted to the load as k3 runs)")
    cpu = m["cpu"]
    isa = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["isa"].items())
    w(f"cpu: {cpu['model'] or cpu['machine']}, {cpu['cores_usable']} usable cores "
      f"({cpu['allowance']['why']}); {isa}")
    load = m["load"]
    w(f"load: {', '.join(load['busy']) if load['busy'] else 'the CPUs were free'} "
      f"(sampled {load['seconds']:.1f} s; load average {load['loadavg_1m']})")
    mem = m["memory"]
    cg = _gb(mem["cgroup_limit_bytes"]) if mem["cgroup_limit_bytes"] else "none"
    w(f"memory: total {_gb(mem['total_bytes'])}, available {_gb(mem['available_bytes'])}, "
      f"cgroup limit {cg}, swap {_gb(mem['swap_total_bytes'])}"
      + (" (assumed, --assume-memory-gb)" if mem["assumed"] else ""))


def _render_storage(report: dict, w) -> None:
    """Each directory measured: filesystem, free space, read rates."""
    for s in report["storage"]:
        w(f"== storage: {s['role']} {s['directory']}")
        w(f"filesystem {s['filesystem']} at {s['mount_point']}, free {_gb(s['free_bytes'])}, "
          f"O_DIRECT {'works' if s['o_direct'] else 'no' if s['o_direct'] is False else '?'}")
        r = s.get("reads")
        if r:
            tag = " (cached: page cache may have served these)" if r["cached"] else ""
            seq = ", ".join(f"x{k} {_mbs(v)}" for k, v in r["seq_bps"].items())
            w(f"sequential 8 MiB reads on {s['measured_on']}: {seq}{tag}")
            if r["rand_bps"]:
                rnd = ", ".join(f"QD{k} {_mbs(v)}" for k, v in r["rand_bps"].items())
                w(f"random 17.5 MB reads: {rnd}; best QD{r['rand_best_depth']}{tag}")
        elif not report["quick"]:
            w("read speed: not measured")
        for n in s["notes"]:
            w(f"note: {n}")


def _render_kernels(report: dict, w) -> None:
    """The kernels' measured speed, and whether it can be trusted."""
    k = report.get("kernels")
    if k:
        w(f"== kernels ({k['source']}): BF16 {_mbs(k['bf16_bytes_per_s'])}, "
          f"MXFP4 {_mbs(k['mxfp4_bytes_per_s'])} of weights, one token at the model's "
          "matrix shapes, weights from RAM")
        if k.get("unreliable"):
            lo, hi = k["bf16_range_bytes_per_s"]
            mlo, mhi = k["mxfp4_range_bytes_per_s"]
            w(f"unreliable ({k['unreliable']}): measured twice, BF16 {_mbs(lo)} to "
              f"{_mbs(hi)}, MXFP4 {_mbs(mlo)} to {_mbs(mhi)}; the estimates use the faster")


def _render_model(report: dict, w) -> None:
    """The model: config, shards, sizes, pack."""
    ms = report.get("model")
    if ms:
        w(f"== model {ms['path']}")
        c = ms["config"]
        if c and c["ok"]:
            w(f"config ok: {c['layers']} layers ({c['layer_map']}), {c['experts']} experts, "
              f"top-{c['top_k']}")
        elif c:
            w("config: invalid (see FAIL below)")
        sh = ms.get("shards")
        if sh and "present" in sh:
            w(f"shards: {sh['present']} of {sh['expected']} present, "
              f"{_gb(sh['apparent_bytes'])} ({_gb(sh['allocated_bytes'])} allocated)"
              + ("; every shard's size matches its header" if sh["ok"] else ""))
        sz = ms.get("sizes")
        if sz:
            w(f"sizes{'' if sz['exact'] else ' (from config)'}: trunk {_gb(sz['trunk_bytes'])}, "
              f"experts {_gb(sz['experts_bytes'])} ({sz['experts_total']} x "
              f"{sz['expert_bytes']:,} B), model-level {_gb(sz['model_level_bytes'])}")
        pk = ms.get("pack")
        if pk:
            w(f"pack {pk['directory']}: {pk['state']}; trunk file "
              f"{_gb(pk['trunk_bytes_needed'])}")


def _render_decision(report: dict, w) -> None:
    """Memory to plan with, every preset's budget and estimate, the pick."""
    d = report["decision"]
    w(f"== decision (sizes of {d['sizes_of']})")
    w(f"memory to plan with: {_gb(d['memory_plannable_bytes'])} of {_gb(d['memory_usable_bytes'])}; "
      f"overhead {_gb(d['overhead_bytes'])}; smallest working budget "
      f"{_gb(d['minimum_memory_bytes'])} in all")
    w(f"batch: each sequence holds {_gb(d['sequence_bytes'])} (recurrent state + MLA cache "
      f"for {d['context_positions']} positions); 'batch' is the --batch-width auto beside "
      "each preset")
    bp = d.get("batch")
    if bp:
        w(f"for batch work: --preset {bp['preset']} --batch-width {bp['width']} (trunk read "
          f"per generated token {_gb(bp['trunk_bytes_per_token'])}, the fewest)")
    w(f"{'preset':<12}{'trunk':>11}{'cache':>11}{'peak':>11}{'fits':>6}{'s/token':>10}"
      f"{'pinned':>8}{'batch':>7}")
    for name, row in d["presets"].items():
        b = row["budget"]
        est = row["estimate"]
        if b is None:
            w(f"{name:<12}{'-':>11}{'-':>11}{'-':>11}{'no':>6}{'-':>10}")
            continue
        spt = f"{est['seconds_per_token']:.2f}" if est else "-"
        pinned = str(est["pinned_layers"]) if est else "-"
        width = str(row["batch_width"]) if row["batch_width"] else "-"
        w(f"{name:<12}{_gb(b['trunk_bytes']):>11}{_gb(b['cache_bytes']):>11}"
          f"{_gb(row['peak_bytes']):>11}{'yes' if not row['problems'] else 'no':>6}"
          f"{spt:>10}{pinned:>8}{width:>7}")
    if not any(r["estimate"] for r in d["presets"].values()):
        w("s/token: not estimated" + (" (--quick)" if report["quick"] else
                                      " (read speed or kernels not measured)"))
    else:
        w("s/token is a rough upper estimate: uniform routing, I/O and compute not overlapped")
    if d["pick"]:
        w(f"pick: {d['why']}")
    dr = d.get("drafting")
    if dr and dr.get("ok"):
        w(f"draft {dr['path']}: {_gb(dr['bytes'])} resident, counted in every peak above "
          f"(where that does not fit, k3-run streams its matrices and holds "
          f"{_gb(dr['streamed_bytes'])})")
        if dr.get("advice"):
            w(f"  {dr['advice']['why']} at {d['pick']}")
    c = d.get("compression") or {}
    if c.get("recommend") is not None:
        w(f"compressed trunk (k3-pack compress): {c['why']}; expected "
          f"{c['seconds_per_token_compressed']:.2f} s/token compressed vs "
          f"{c['seconds_per_token_raw']:.2f} raw at {d['pick']}")


def _render_verdict(report: dict, w) -> None:
    """Disk for the pack, warnings, failures, the verdict and what to run next."""
    dk = report.get("disk_for_pack")
    if dk:
        w(f"disk for the pack: {_gb(dk['still_to_write_bytes'])} to write, "
          f"{_gb(dk['free_bytes'])} free")
    for x in report["warnings"]:
        w(f"warning: {x}")
    for x in report["problems"]:
        w(f"FAIL: {x}")
    w("== verdict: " + ("this machine can run the model" if report["can_run"]
                        else "cannot run, see FAIL lines"))
    w(f"next: {report['next_step']}")
    for c in report["next_commands"]:
        w(f"  {c}")

