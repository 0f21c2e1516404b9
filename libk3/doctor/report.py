"""k3-doctor's report: can this machine run this model, with which preset, and what next.

Owns: putting the machine facts (``facts``), the model directory's health
(config, shard completeness, each shard's size against its own header), the pack
directory's state and the advice (``advice``: preset, batch width, a per-token time
estimate, compression, drafting) together into one JSON-ready report with its exit
status. Does not own: rendering it as
text (``render``), measuring (``libk3.machine``, ``timing``), budget rules
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
from ..errors import CheckpointError, ConfigError
from ..k3_dims import real_config
from ..machine import memory as _memory, storage
from ..units import size_texts
from . import drives, facts
from .advice import compression_advice, decide, drafting_advice

EXAMPLE_PROMPT = "The capital of France is"
EXAMPLE_IDS = "1,2,3"             # for models without a tokenizer


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
    from ..io.checkpoint import Checkpoint
    from ..io.shards import survey_shards
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

@dataclasses.dataclass(frozen=True)
class DiskProbe:
    """How the disk probe measures: the probe file's size, the seconds of sequential and
    of random reads, and where a probe file goes first (``storage.probe_dir``; None: the
    temporary directory)."""
    probe_bytes: int = storage.DEFAULT_PROBE_BYTES
    seq_seconds: float = 3.0
    rand_seconds: float = 1.5
    tmp: object = None


def diagnose(model=None, pack=None, *, quick: bool = False,
             memory: _memory.MemoryInfo | None = None, disk: DiskProbe = DiskProbe(),
             progress: bool = False, pack_free_bytes: int | None = None,
             read_bps: float | None = None, decode_bps: float | None = None,
             draft=None, stripes=()) -> Diagnosis:
    """Probe, inspect and decide. ``memory`` overrides the memory probe (simulated
    machines); ``disk`` says how the disk probe measures; ``pack_free_bytes`` overrides
    the free space seen at the pack directory (tests); ``read_bps`` the measured
    sequential read rate and ``decode_bps`` the compressed trunk's measured decode
    rate. ``quick`` skips the
    disk, kernel and decode measurements (no estimates). ``draft``: a DSpark draft
    directory for ``model``, checked, counted in every budget and judged (does drafting
    pay at the pick?). ``stripes``: more drives the trunk could go on (each measured, the
    placement compared: ``drives``); an existing striped pack's stripe directories are
    measured too."""
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
    stripe_dirs = [Path(s) for s in stripes] or \
        (drives.pack_stripe_dirs(pack_dir) if pack_dir is not None else [])
    targets += [("stripe", s) for s in stripe_dirs]
    if stripe_dirs:
        warnings += drives.shared_device_warnings([pack_dir, *stripe_dirs])
    avoid = [d for _, d in targets]
    for role, d in targets:
        dev = os.stat(storage.existing_ancestor(d)).st_dev
        shards = sorted(Path(d).glob("*.safetensors")) if role == "model" else []
        if dev in measured_dev:
            info = storage.probe_storage(d, measure=False, model_files=shards,
                                          avoid=avoid, tmp=disk.tmp)
            info["reads"] = measured_dev[dev]["reads"]
            info["measured_on"] = measured_dev[dev]["measured_on"]
            info["measured"] = measured_dev[dev]["measured"]
            info["notes"].append(f"same filesystem as {measured_dev[dev]['directory']}; "
                                 "measured once")
        else:
            info = storage.probe_storage(d, measure=not quick, model_files=shards,
                                         avoid=avoid, tmp=disk.tmp,
                                         probe_bytes=disk.probe_bytes,
                                         seq_seconds=disk.seq_seconds,
                                         rand_seconds=disk.rand_seconds, progress=progress)
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
    decision["placement"] = drives.placement(
        stores, decision["presets"][pick]["estimate"] if pick else None, sizes.expert_bytes,
        model, pack_dir, stripe_dirs) if stripe_dirs else None
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
    place = decision.get("placement")
    if state != "complete" and place:        # the drives compared: the trunk where it is fastest
        target = Path(place["pack_dir"])
    if state != "complete":
        cmds.append(f"k3-pack {q(str(model))} {q(str(target))}"
                    + "".join(f" --stripe {q(s)}" for s in (place or {}).get("stripe_args", ()))
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
