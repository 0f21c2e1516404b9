"""Memory presets and budgets: how many bytes go to the trunk and to the expert cache.

Owns: reading and validating ``libk3/presets.yaml`` (formats/presets.md), the model's
sizes as the budget sees them (``ModelSizes``), the fixed overhead a run needs besides
its two budgets, the smallest budget that can work, the ``auto`` rule, resolving
``--preset``/``--trunk-gb``/``--cache-gb`` in argv order, how a trunk budget splits into
pinned layers and a ring, and whether a budget fits a machine's memory. Does not own:
probing the machine (``libk3.machine``), streaming or caching (``libk3.stream``), or
printing (the click front ends).

Why the memory model is what it is (numbers are Kimi K3's, model.md §3.5, §6):
* peak = trunk budget + cache budget + overhead. The overhead is lm_head and the three
  small model-level vectors (2.35 GB, resident), the recurrent state (0.46 GB), the MLA
  latent cache for ``context_positions`` positions (0.23 GB at 4096) and a runtime
  reserve. The embedding (another 2.35 GB) is NOT in it: a token needs one 14 KB row of
  it, read on demand. Keeping it resident would put the floor at ~9.6 GB and make an
  8 GB machine unusable.
* The trunk budget pays for the ring first, then for pins. The ring runs
  with one slot for the largest layer (2.34 GB: the dense layer 0), the next layer read
  into the room beside the one in use and into its bytes only once released; that is the
  feasibility floor (``floor_problems``, the one rule k3-run, k3-doctor and ``k3-trace
  size`` apply). Two slots, for the two largest layers (3.61 GB), let the reader fill one
  while the other is computed on; ``auto`` prefers that ring when memory allows.
* Pins go largest first: a pinned byte is a byte not read per token, and pinning the
  largest layers also shrinks the ring the rest needs. ``plan_trunk`` is the split
  k3-run's trunk streamer runs, so the doctor's estimate streams the layers k3-run will.
* The cache floor is top_k + 1 slots: one layer's experts plus one in
  flight. A slot is the expert's bytes widened to the enclosing 4096-aligned window, as
  O_DIRECT reads it (17,555,456 B for the real expert).
* ``auto`` gives memory to the trunk before the cache: a trunk byte held is read by
  every token, an expert byte held only by the tokens that route to it. There is no cap
  on the trunk's share of memory: k3 reads with O_DIRECT, so pins do not compete with
  the page cache.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from . import names
from .config import K3Config
from .errors import BudgetError, FormatError, UsageError
from .io import inventory
from .io.dtypes import bound_extra_bytes
from .io.direct import window_bytes

GB = 1e9                              # presets.yaml and every flag count decimal GB
PRESETS_FILE = Path(__file__).with_name("presets.yaml")
PRESET_FORMAT, PRESET_VERSION = "k3-presets", 1
NAMED = ("laptop", "desktop", "workstation", "server", "max")   # smallest to largest
PRESET_NAMES = NAMED + ("auto",)
FLAG_KEYS = ("preset", "trunk_gb", "cache_gb")     # the tokens of ``order``
_FLAG_TEXT = {"preset": "--preset", "trunk_gb": "--trunk-gb", "cache_gb": "--cache-gb"}


# ---- the preset file --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Preset:
    """One named budget. ``auto`` has trunk_gb = cache_gb = None (computed)."""

    name: str
    trunk_gb: float | None
    cache_gb: float | None
    description: str


@dataclasses.dataclass(frozen=True)
class Rules:
    """The ``auto`` and ``accounting`` sections of the preset file (formats/presets.md)."""

    headroom_fraction: float       # plan at most this share of usable memory
    cache_floor_bytes: int         # auto keeps at least this much cache when it can
    runtime_reserve_bytes: int     # interpreter, numba, activations, I/O staging
    context_positions: int         # MLA cache positions reserved in the overhead
    source: str


_PRESET_KEYS = ("trunk_gb", "cache_gb", "description")
_AUTO_KEYS = ("description", "headroom_fraction", "cache_floor_gb")
_ACCOUNTING_KEYS = ("runtime_reserve_gb", "context_positions")
_TOP_KEYS = ("format", "version", "presets", "auto", "accounting")


def _read_yaml(path) -> tuple[dict, str]:
    import yaml

    p = Path(path) if path is not None else PRESETS_FILE
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise FormatError(f"cannot read the preset file: {e.strerror}", path=p) from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise FormatError(f"preset file is not valid YAML: {' '.join(str(e).split())}",
                          path=p) from None
    if not isinstance(doc, dict):
        raise FormatError("preset file is not a mapping", path=p)
    return doc, str(p)


def _section_problems(where: str, section, keys: tuple) -> list:
    if not isinstance(section, dict):
        return [f"{where} is not a mapping"]
    out = [f"{where}.{k} missing" for k in keys if k not in section]
    out += [f"{where}.{k} unknown" for k in section if k not in keys]
    return out


def _number(where: str, value, problems: list, *, minimum: float = 0.0,
            maximum: float = math.inf, integer: bool = False):
    ok_type = (isinstance(value, int) if integer else isinstance(value, (int, float)))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) \
            or not minimum <= value <= maximum:
        kind = "an integer" if integer else "a number"
        problems.append(f"{where}={value!r} is not {kind} in [{minimum}, {maximum}]")
        return None
    return value


def _validated(path=None) -> tuple[dict, Rules]:
    """Parse and check the whole file; one FormatError listing every problem."""
    doc, src = _read_yaml(path)
    problems = _section_problems("<top>", doc, _TOP_KEYS)
    if doc.get("format", PRESET_FORMAT) != PRESET_FORMAT:
        problems.append(f"format={doc.get('format')!r}, expected {PRESET_FORMAT!r}")
    if "version" in doc and doc["version"] != PRESET_VERSION:
        problems.append(f"version={doc['version']!r}, this k3 reads version {PRESET_VERSION}")
    presets = {}
    table = doc.get("presets", {})
    problems += _section_problems("presets", table, NAMED)
    for name in NAMED:
        entry = table.get(name) if isinstance(table, dict) else None
        if entry is None:
            continue
        where = f"presets.{name}"
        got = _section_problems(where, entry, _PRESET_KEYS)
        problems += got
        if got:
            continue
        trunk = _number(f"{where}.trunk_gb", entry["trunk_gb"], problems)
        cache = _number(f"{where}.cache_gb", entry["cache_gb"], problems)
        if not isinstance(entry["description"], str):
            problems.append(f"{where}.description is not a string")
        presets[name] = Preset(name, trunk, cache, str(entry["description"]))
    auto = doc.get("auto", {})
    auto_gaps = _section_problems("auto", auto, _AUTO_KEYS)
    acc = doc.get("accounting", {})
    acc_gaps = _section_problems("accounting", acc, _ACCOUNTING_KEYS)
    problems += auto_gaps + acc_gaps
    if not auto_gaps:
        head = _number("auto.headroom_fraction", auto["headroom_fraction"], problems,
                       minimum=0.05, maximum=1.0)
        floor = _number("auto.cache_floor_gb", auto["cache_floor_gb"], problems)
        if not isinstance(auto["description"], str):
            problems.append("auto.description is not a string")
    if not acc_gaps:
        reserve = _number("accounting.runtime_reserve_gb", acc["runtime_reserve_gb"],
                          problems)
        ctx = _number("accounting.context_positions", acc["context_positions"], problems,
                      integer=True)
    if problems:
        raise FormatError("invalid preset file: " + "; ".join(problems)
                          + " (k3 refuses to substitute defaults)", path=src)
    presets["auto"] = Preset("auto", None, None, auto["description"])
    rules = Rules(float(head), int(floor * GB), int(reserve * GB), int(ctx), src)
    return presets, rules


def load_presets(path=None) -> dict:
    """{name: Preset} for laptop, desktop, workstation, server, max and auto (in that
    order), from ``path`` or the packaged presets.yaml. FormatError naming the file and
    every missing, unknown or ill-typed key."""
    return _validated(path)[0]


def load_rules(path=None) -> Rules:
    """The auto rule's and the overhead accounting's parameters from the preset file."""
    return _validated(path)[1]


# ---- the model as the budget sees it -------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """Byte sizes that decide budgets. ``exact`` is True when read from shard headers,
    False when derived from a config alone (small vectors then count as F32)."""

    layer_bytes: tuple             # trunk run of each layer, unpadded
    embed_bytes: int
    lm_head_bytes: int
    vectors_bytes: int             # final norm + output aggregator norm and projection
    expert_bytes: int              # one routed expert's six MXFP4 tensors
    num_experts: int
    top_k: int
    moe_layers: int
    bf16_trunk_bytes: int          # the trunk matrices' bytes the dense (bf16.py) kernels read
    state_bytes: int               # KDA recurrent state and conv history, all KDA layers
    kv_bytes_per_position: int     # MLA latent + rope cache over all MLA layers (f32)
    exact: bool
    draft_bytes: int = 0           # a draft model's weights and verify tape (``with_draft``)

    @property
    def trunk_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def model_level_bytes(self) -> int:
        return self.embed_bytes + self.lm_head_bytes + self.vectors_bytes

    @property
    def resident_bytes(self) -> int:
        """Model-level bytes kept in RAM: lm_head and vectors (the embedding is read by
        rows; module docstring), and a draft model's when one runs."""
        return self.lm_head_bytes + self.vectors_bytes + self.draft_bytes

    @property
    def expert_slot_bytes(self) -> int:
        """One cache slot: the expert widened to its enclosing aligned window, as the
        cache reads it (``window_bytes``, the one slot-size formula)."""
        return window_bytes(self.expert_bytes)

    @property
    def total_experts(self) -> int:
        return self.moe_layers * self.num_experts

    @property
    def experts_bytes(self) -> int:
        return self.total_experts * self.expert_bytes

    @property
    def cache_all_bytes(self) -> int:
        """Cache that holds every routed expert at once."""
        return self.total_experts * self.expert_slot_bytes

    @property
    def active_expert_bytes(self) -> int:
        """Expert bytes one token multiplies (top_k per MoE layer)."""
        return self.moe_layers * self.top_k * self.expert_bytes

    @classmethod
    def from_config(cls, cfg: K3Config) -> "ModelSizes":
        """Sizes implied by a config: matrices BF16 (the release's dtype), small vectors
        counted as F32 (a dtype is only known from the header; F32 is the upper bound
        for a vector). ``from_checkpoint`` counts the stored dtypes exactly."""
        layers, bf16 = [], 0
        for L in range(cfg.num_hidden_layers):
            total = 0
            for spec in inventory.layer_trunk(cfg, L):
                shape = spec.shape if spec.shape is not None else (inventory.a_log_width(cfg),)
                n = math.prod(shape)
                if spec.kind == inventory.MATRIX:
                    total += 2 * n
                    bf16 += 2 * n
                else:
                    total += 4 * n
            layers.append(total)
        E, V = cfg.hidden_size, cfg.vocab_size
        return cls(tuple(layers), 2 * V * E, 2 * V * E, 4 * 3 * E, cfg.expert_bytes,
                   cfg.num_experts, cfg.num_experts_per_token, len(cfg.moe_layers), bf16,
                   _state_bytes(cfg), _kv_per_position(cfg), exact=False)

    @classmethod
    def from_checkpoint(cls, ckpt) -> "ModelSizes":
        """Exact sizes from an opened ``libk3.io.checkpoint.Checkpoint``, in the stored
        dtypes; a tensor held widened once bound (F16) counts its widened copy too."""
        cfg = ckpt.config
        layers, bf16 = [], 0
        for L in range(cfg.num_hidden_layers):
            run = ckpt.layer_trunk_run(L)
            layers.append(run.nbytes + sum(bound_extra_bytes(dt, nb)
                                           for _, nb, dt, _ in run.tensors.values()))
            matrices = {s.name for s in inventory.layer_trunk(cfg, L) if s.kind == inventory.MATRIX}
            bf16 += sum(nb + bound_extra_bytes(dt, nb)
                        for name, (_, nb, dt, _) in run.tensors.items() if name in matrices)
        vec = sum(ckpt.entry(n).nbytes for n in
                  (names.NORM, names.OUTPUT_ATTN_RES_NORM, names.OUTPUT_ATTN_RES_PROJ))
        head = ckpt.entry(names.LM_HEAD)
        return cls(tuple(layers), ckpt.entry(names.EMBED).nbytes,
                   head.nbytes + bound_extra_bytes(head.dtype, head.nbytes), vec, cfg.expert_bytes,
                   cfg.num_experts, cfg.num_experts_per_token, len(cfg.moe_layers), bf16,
                   _state_bytes(cfg), _kv_per_position(cfg), exact=True)

    def to_json(self) -> dict:
        return {"trunk_bytes": self.trunk_bytes, "layers": len(self.layer_bytes),
                "largest_layer_bytes": max(self.layer_bytes, default=0),
                "model_level_bytes": self.model_level_bytes,
                "resident_bytes": self.resident_bytes, "expert_bytes": self.expert_bytes,
                "experts_total": self.total_experts, "experts_bytes": self.experts_bytes,
                "expert_slot_bytes": self.expert_slot_bytes, "top_k": self.top_k,
                "state_bytes": self.state_bytes,
                "kv_bytes_per_position": self.kv_bytes_per_position, "exact": self.exact}


def _state_bytes(cfg: K3Config) -> int:
    """KDA S [H, D, D] and conv history [3, K-1, P] per KDA layer, f32 (model.md §6)."""
    kda = sum(1 for L in range(cfg.num_hidden_layers) if not cfg.is_mla(L))
    per = cfg.num_heads * cfg.head_dim ** 2 + 3 * (cfg.short_conv_kernel_size - 1) * cfg.kda_dim
    return 4 * kda * per


def _kv_per_position(cfg: K3Config) -> int:
    """Latent [kv_lora] + rope [qk_rope] per MLA layer and position, f32 (model.md §6)."""
    mla = sum(1 for L in range(cfg.num_hidden_layers) if cfg.is_mla(L))
    return 4 * mla * cfg.mla_cache_width


# ---- budgets -----------------------------------------------------------------------------

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
    ring then reads a layer only once the last is released, ``libk3.stream.trunk``), or
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
        problems.append(f"trunk budget {_gb(trunk_bytes)} is below {_gb(trunk)} "
                        f"(one ring slot for the largest layer, {trunk} bytes)")
    if cache_bytes < cache:
        problems.append(f"cache budget {_gb(cache_bytes)} is below {_gb(cache)} "
                        f"({min(top_k + 1, total_experts)} expert slots of {slot_bytes} bytes)")
    return problems


def plan_trunk(sizes, budget: int) -> TrunkPlan:
    """The trunk's split for a budget in bytes, ``sizes`` the layers' bytes: the one plan
    ``libk3.stream.trunk.TrunkStreamer`` runs and the doctor and ``k3-trace size``
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
                          hint=f"raise --trunk-gb to at least {trunk_floor(sizes) / GB:.6f}")
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


def verify_tape_bytes(cfg: K3Config) -> int:
    """What a verify pass records per fed token to commit without a second pass
    (dspark.md §6.3): per KDA layer the pre-conv q, k, v, the convolved q, k, v, the
    decay (each kda_dim floats) and beta (one per head), f32."""
    kda_layers = sum(1 for L in range(cfg.num_hidden_layers) if not cfg.is_mla(L))
    return kda_layers * (7 * cfg.kda_dim + cfg.num_heads) * 4


def with_draft(sizes: ModelSizes, cfg: K3Config, weight_bytes: int, kv_per_position: int,
               cap: int) -> ModelSizes:
    """``sizes`` with a draft model beside the target: its weights resident, the verify
    tape of a pass of ``cap`` proposals and the anchor, and its context row per position
    (``kv_per_position`` bytes) with every sequence's MLA cache."""
    return dataclasses.replace(
        sizes, draft_bytes=weight_bytes + (cap + 1) * verify_tape_bytes(cfg),
        kv_bytes_per_position=sizes.kv_bytes_per_position + kv_per_position)


def sequence_bytes(sizes: ModelSizes, positions: int) -> int:
    """What one sequence holds: its recurrent state (KDA S and conv history, every KDA
    layer) and its MLA cache for ``positions`` positions (formats/presets.md 2, 5)."""
    return sizes.state_bytes + positions * sizes.kv_bytes_per_position


def overhead_bytes(sizes: ModelSizes, rules: Rules | None = None, width: int = 1) -> int:
    """Bytes a run needs besides its two budgets: resident model-level tensors, the
    state of ``width`` sequences (a batch decoded in lockstep holds one per slot) with
    MLA caches for the preset file's context positions, and the runtime reserve."""
    rules = rules or load_rules()
    return (sizes.resident_bytes + width * sequence_bytes(sizes, rules.context_positions)
            + rules.runtime_reserve_bytes)


def minimum_budget(sizes: ModelSizes) -> Budget:
    """The smallest budget that works (``floor_problems``): one ring slot for the largest
    layer (or the whole trunk, if smaller) and top_k + 1 expert slots (or every expert,
    if fewer). The overhead comes on top (``overhead_bytes``)."""
    trunk = trunk_floor(sizes.layer_bytes)
    cache = cache_floor(sizes.expert_slot_bytes, sizes.top_k, sizes.total_experts)
    return Budget(trunk, cache, "minimum", (
        f"trunk {_gb(trunk)}: one ring slot for the largest trunk layer",
        f"cache {_gb(cache)}: {sizes.top_k + 1} expert slots (top_k + 1) of "
        f"{sizes.expert_slot_bytes} bytes"))


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
        problems.append(f"planned peak {_gb(peak)} exceeds {rules.headroom_fraction:.0%} of "
                        f"the {_gb(usable_memory(mem))} of memory available")
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
        raise BudgetError(
            "not enough memory for the smallest working budget"
            + (f" beside batch width {width}" if width > 1 else ""),
            expected=f">= {_gb(floor.trunk_bytes + floor.cache_bytes + over)} "
                     f"(ring {_gb(floor.trunk_bytes)} + cache {_gb(floor.cache_bytes)} + "
                     f"overhead {_gb(over)}"
                     + (f", {width} sequences of "
                        f"{_gb(sequence_bytes(sizes, rules.context_positions))}"
                        if width > 1 else "")
                     + f") within {rules.headroom_fraction:.0%} of memory",
            found=f"{_gb(usable)} available",
            hint="free memory or run on a larger machine")
    reasons = [f"auto: {rules.headroom_fraction:.0%} of {_gb(usable)} available minus "
               f"{_gb(over)} overhead leaves {_gb(plan)}"]
    cache_keep = min(max(floor.cache_bytes, rules.cache_floor_bytes), sizes.cache_all_bytes)
    if fixed_trunk is not None:
        trunk = fixed_trunk
        cache = max(0, min(sizes.cache_all_bytes, plan - min(trunk, sizes.trunk_bytes)))
        reasons.append(f"auto: cache takes what the fixed trunk leaves, {_gb(cache)}")
    elif fixed_cache is not None:
        cache = fixed_cache
        trunk = max(0, min(sizes.trunk_bytes, plan - min(cache, sizes.cache_all_bytes)))
        reasons.append(f"auto: trunk takes what the fixed cache leaves, {_gb(trunk)}")
    else:
        # the overlapping ring (two slots) when it fits beside the cache floor
        ring = min(overlap_floor(sizes.layer_bytes), plan - floor.cache_bytes)
        trunk = min(sizes.trunk_bytes, max(ring, plan - cache_keep))
        cache = min(sizes.cache_all_bytes, plan - trunk)
        reasons.append(f"auto: trunk first, {_gb(trunk)}"
                       + (" (every layer pinned)" if trunk >= sizes.trunk_bytes else ""))
        reasons.append(f"auto: cache {_gb(cache)}"
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
        reasons.append(f"{part} {_gb(value[part])} from {source[part]}")
    trunk, cache = value["trunk"], value["cache"]
    if model_sizes is not None:
        if trunk > model_sizes.trunk_bytes:
            trunk = model_sizes.trunk_bytes
            reasons.append(f"trunk clamped to the model's {_gb(trunk)} (every layer pinned)")
        if cache > model_sizes.cache_all_bytes:
            cache = model_sizes.cache_all_bytes
            reasons.append(f"cache clamped to {_gb(cache)} (every expert fits)")
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
                rules: Rules | None = None) -> tuple:
    """(width, reasons) for ``--batch-width`` ``requested`` (an int >= 1 or "auto").

    Each sequence holds ``sequence_bytes`` for context_positions positions; the widths
    that fit are those whose states fit beside both budgets (clamped to the model), the
    resident tensors and the runtime reserve within headroom_fraction of usable memory.
    ``auto`` takes the largest, at most ``jobs`` (the prompts to run) and MAX_AUTO_WIDTH;
    a requested width that does not fit raises BudgetError with the figures, as does a
    machine where not even one sequence fits."""
    rules = rules or load_rules()
    per = sequence_bytes(sizes, rules.context_positions)
    allowed = int(rules.headroom_fraction * usable_memory(mem))
    trunk = min(budget.trunk_bytes, sizes.trunk_bytes)
    cache = min(budget.cache_bytes, sizes.cache_all_bytes)
    fixed = peak_bytes(budget, sizes, rules, width=0)
    fit = max(0, (allowed - fixed) // per)
    figures = (f"trunk {_gb(trunk)} + cache {_gb(cache)} + resident and reserve "
               f"{_gb(fixed - trunk - cache)} leave {_gb(max(0, allowed - fixed))} of "
               f"{_gb(allowed)} ({rules.headroom_fraction:.0%} of {_gb(usable_memory(mem))}) "
               f"for sequences of {_gb(per)} each ({rules.context_positions} positions)")
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


def _gb(n) -> str:
    return f"{n / GB:.2f} GB"
