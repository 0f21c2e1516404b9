"""What `k3-trace stats` and `k3-trace replay` report about a trace, as data and as text.

Owns: trace statistics (requests, tokens, distinct experts, reuse, hottest experts,
per-layer spread, compulsory-miss ceiling), the capacity ladder (GB or slots given, else
derived from the trace), the replay report over that ladder, its text tables and the
optional plot. Does not own: the file format (``libk3.trace.format``), the policies
(``libk3.trace.replay``), how sizes are written (``libk3.units``) or option parsing (the
click front end).

Units: GB = 10^9 bytes; slots = floor(capacity bytes / expert bytes), as the public C
engine's cache simulator counts them. A capacity with fewer than top_k + 1 slots is
skipped, because a cache that cannot hold one layer's experts plus one cannot run.
Why the default ladder comes from the trace: fixed sizes fit one model only (for a small
model every one of them holds every expert it touches); fractions of the experts the
trace touches span its whole curve, and the last, all of them, reaches its ceiling.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

from ..errors import FormatError, UsageError
from ..io import atomic
from ..policies.registry import POLICIES, check_policy_names
from ..units import GB, size_text, size_texts, unit_of
from .format import PHASE_NAMES, TraceHeader, TraceReader

# Shares of the trace's distinct experts a default ladder holds, smallest first.
DERIVED_FRACTIONS = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1)
HOTTEST_SHOWN = 6
PLOT_INSTALL = "pip install 'k3[plot]'"      # the distribution's extra (pyproject.toml)


def _scan(reader: TraceReader):
    """One pass over the frames: replay keys, per-phase counts and token identities."""
    reader.require_replayable()
    ne = reader.header.n_experts
    keys, phase_counts = [], np.zeros(len(PHASE_NAMES), np.int64)
    tokens, unknown_pos = set(), 0
    for rec in reader.iter_frames():
        keys.append(rec["layer"].astype(np.int64) * ne + rec["expert"])
        phase_counts += np.bincount(rec["phase"], minlength=len(PHASE_NAMES))
        known = rec["pos"] >= 0
        unknown_pos += int(rec.size - np.count_nonzero(known))
        ids = (rec["seq"][known].astype(np.int64) << 32) | rec["pos"][known].astype(np.int64)
        tokens.update(np.unique(ids).tolist())
    keys = np.concatenate(keys) if keys else np.empty(0, np.int64)
    if keys.size == 0:
        raise FormatError("trace holds no requests", path=reader.path)
    return keys, phase_counts, len(tokens), unknown_pos


def _tokens(reader, keys, n_tokens_known, unknown_pos, layers_seen):
    """Tokens: counted from positions when every record has one, else estimated as
    requests / (MoE layers seen x top_k), which is exact for per-token decode traces."""
    if unknown_pos == 0:
        return n_tokens_known, False
    return max(1, round(keys.size / (layers_seen * reader.header.top_k))), True


def trace_stats(reader: TraceReader) -> dict:
    """The `k3-trace stats` document for a trace."""
    h = reader.header
    keys, phase_counts, n_tok, unknown_pos = _scan(reader)
    counts = np.bincount(keys, minlength=h.n_keys)
    per_layer = counts.reshape(h.n_layers, h.n_experts)
    layer_requests = per_layer.sum(axis=1)
    layers = np.flatnonzero(layer_requests)
    distinct = int(np.count_nonzero(counts))
    tokens, estimated = _tokens(reader, keys, n_tok, unknown_pos, layers.size)
    n = int(keys.size)
    hot = np.argsort(-counts, kind="stable")[:HOTTEST_SHOWN]
    layer_rows = []
    for L in layers:
        row = per_layer[L]
        layer_rows.append({"layer": int(L), "requests": int(layer_requests[L]),
                           "distinct": int(np.count_nonzero(row)),
                           "top_expert": int(np.argmax(row)),
                           "top_share": float(row.max() / layer_requests[L])})
    d_per_layer = np.array([r["distinct"] for r in layer_rows])
    pool = int(layers.size * h.n_experts)
    return {
        "trace": str(reader.path),
        "header": h.to_json(),
        "requests": n,
        "tokens": tokens,
        "tokens_estimated": estimated,
        "requests_per_token": n / tokens,
        "phases": {PHASE_NAMES[i]: int(c) for i, c in enumerate(phase_counts) if c},
        "distinct_experts": distinct,
        "moe_layers_seen": int(layers.size),
        "pool_experts": pool,
        "distinct_share_of_pool": distinct / pool,
        "reuse": (n - distinct) / n,
        "compulsory_misses": distinct,
        "hit_rate_ceiling": 1.0 - distinct / n,
        "gb_per_token_uncached": n / tokens * h.expert_bytes / GB,
        "gb_all_touched": distinct * h.expert_bytes / GB,
        "gb_pool": pool * h.expert_bytes / GB,
        "hottest": [{"layer": int(k // h.n_experts), "expert": int(k % h.n_experts),
                     "requests": int(counts[k])} for k in hot if counts[k]],
        "per_layer_distinct": {"min": int(d_per_layer.min()),
                               "median": float(np.median(d_per_layer)),
                               "max": int(d_per_layer.max())},
        "per_layer": layer_rows,
        "truncated_tail": None if reader.tail_error is None else reader.tail_error.one_line(),
    }


def model_label(h: TraceHeader) -> str:
    """The model a trace was taken on, for titles: the model directory k3-run recorded
    (else synthetic or imported), then its shape."""
    meta = h.meta or {}
    model = meta.get("model")
    if isinstance(model, str) and model:
        name = Path(model).name or model
    elif "synthetic" in meta:
        name = "synthetic"
    elif isinstance(meta.get("imported_from"), str):
        name = f"imported {meta['imported_from']}"
    else:
        name = f"checkpoint {h.checkpoint[:12]}" if h.checkpoint else "unknown model"
    return f"{name} ({h.n_layers} layers x {h.n_experts} experts, top-{h.top_k})"


def derived_slots(distinct: int, top_k: int) -> list:
    """The default ladder in slots: DERIVED_FRACTIONS of the ``distinct`` experts a trace
    touches (rounded up), never below top_k + 1, without repeats."""
    return sorted({max(top_k + 1, math.ceil(f * distinct)) for f in DERIVED_FRACTIONS})


def capacity_ladder(expert_bytes: int, top_k: int, *, capacities_gb=None, slots=None,
                    distinct: int | None = None):
    """-> (rows [{capacity_gb, capacity_bytes, slots}], skipped [notes]). With neither
    list given, the ladder derived from the trace's ``distinct`` experts."""
    if expert_bytes <= 0:
        raise UsageError("expert bytes must be positive", found=expert_bytes)
    if not capacities_gb and not slots:
        if distinct is None:
            raise ValueError("a ladder without capacities needs the trace's distinct experts")
        slots = derived_slots(distinct, top_k)
    rows, skipped = [], []
    for gb in capacities_gb or ():
        if gb <= 0:
            raise UsageError("capacities must be positive", found=gb)
        n = int(round(gb * GB)) // expert_bytes
        rows.append({"capacity_gb": float(gb), "capacity_bytes": int(round(gb * GB)),
                     "slots": n})
    for n in slots or ():
        if n <= 0:
            raise UsageError("slot counts must be positive", found=n)
        rows.append({"capacity_gb": n * expert_bytes / GB, "capacity_bytes": n * expert_bytes,
                     "slots": int(n)})
    kept = []
    for r in rows:
        if r["slots"] < top_k + 1:
            skipped.append(f"{size_text(r['capacity_bytes'])} = {r['slots']} slots skipped: "
                           f"fewer than top_k + 1 = {top_k + 1} slots cannot hold a layer's "
                           "experts")
        else:
            kept.append(r)
    return kept, skipped


def replay_report(reader: TraceReader, *, policies, capacities_gb=None, slots=None,
                  expert_bytes: int | None = None, workers: int = 1) -> dict:
    """The `k3-trace replay` document: every policy at every ladder capacity."""
    h = reader.header
    keys, _, n_tok, unknown_pos = _scan(reader)
    layers_seen = int(np.unique(keys // h.n_experts).size)
    tokens, estimated = _tokens(reader, keys, n_tok, unknown_pos, layers_seen)
    rep = replay_keys_report(keys, n_layers=h.n_layers, n_experts=h.n_experts, top_k=h.top_k,
                             expert_bytes=h.expert_bytes if expert_bytes is None else expert_bytes,
                             tokens=tokens, tokens_estimated=estimated, policies=policies,
                             capacities_gb=capacities_gb, slots=slots, workers=workers)
    rep["trace"] = str(reader.path)
    rep["model"] = model_label(h)
    rep["truncated_tail"] = None if reader.tail_error is None else reader.tail_error.one_line()
    return rep


def replay_keys_report(keys, *, n_layers: int, n_experts: int, top_k: int, expert_bytes: int,
                       tokens: int, tokens_estimated: bool, policies, capacities_gb=None,
                       slots=None, workers: int = 1) -> dict:
    """replay_report's work on a key array (also used by bench/replay.py)."""
    from . import replay      # numba: imported only by replays, not by stats

    policies = check_policy_names(policies)
    eb = int(expert_bytes)
    distinct = int(np.unique(keys).size)
    ladder, skipped = capacity_ladder(eb, top_k, capacities_gb=capacities_gb, slots=slots,
                                      distinct=distinct)
    rk = replay.ReplayKeys(keys, n_layers=n_layers, n_experts=n_experts)
    results = replay.replay_grid(rk, [r["slots"] for r in ladder], policies,
                                       n_layers=n_layers, n_experts=n_experts, workers=workers)
    by = {(r["policy"], r["slots"]): r for r in results}
    rows = []
    for r in ladder:
        cells = {}
        for p in policies:
            res = by[(p, r["slots"])]
            cell = {"hit_rate_pct": 100.0 * res["hit_rate"], "hits": res["hits"],
                    "misses": res["misses"],
                    "gb_read_per_token": res["misses"] * eb / GB / tokens}
            for extra in ("pinned", "followed", "switches"):
                if extra in res:
                    cell[extra] = res[extra]
            cells[p] = cell
        rows.append({**r, "policies": cells})
    seconds = {p: sum(x["seconds"] for x in results if x["policy"] == p) for p in policies}
    cpu = {p: sum(x["cpu_seconds"] for x in results if x["policy"] == p) for p in policies}
    return {
        "trace": None,
        "model": None,
        "requests": int(rk.keys.size),
        "tokens": int(tokens),
        "tokens_estimated": bool(tokens_estimated),
        "expert_bytes": eb,
        "policies": policies,
        "online": {p: POLICIES[p].online for p in policies},
        "capacities": rows,
        "capacities_from": "options" if capacities_gb or slots else "trace",
        "skipped": skipped,
        "compulsory_misses": distinct,
        "hit_rate_ceiling_pct": 100.0 * (1.0 - distinct / rk.keys.size),
        "gb_all_touched": distinct * eb / GB,
        "replay_seconds": seconds,
        "replay_cpu_seconds": cpu,
        "truncated_tail": None,
    }


# ---- text ----------------------------------------------------------------------------

def format_stats(s: dict) -> str:
    h = s["header"]
    tok = f"{s['tokens']:,}" + (" (estimated)" if s["tokens_estimated"] else "")
    lines = [
        f"trace        {s['trace']}",
        f"model        {h['checkpoint'] or '(imported, unknown)'}  "
        f"{h['n_layers']} layers x {h['n_experts']} experts, top-{h['top_k']}, "
        f"{h['expert_bytes']:,} B/expert",
        f"requests     {s['requests']:,}  ({', '.join(f'{k} {v:,}' for k, v in s['phases'].items())})",
        f"tokens       {tok}  ({s['requests_per_token']:.1f} requests/token)",
        f"distinct     {s['distinct_experts']:,} experts = {100 * s['distinct_share_of_pool']:.2f} % "
        f"of the {s['pool_experts']:,}-expert pool of {s['moe_layers_seen']} MoE layers",
        f"reuse        {100 * s['reuse']:.2f} % of requests repeat an earlier one",
        f"ceiling      {100 * s['hit_rate_ceiling']:.2f} % hit rate with unlimited cache "
        f"({s['compulsory_misses']:,} compulsory misses)",
        "uncached     {} read per token; every touched expert {}; whole pool {}".format(
            *size_texts(s["gb_per_token_uncached"] * GB, s["gb_all_touched"] * GB,
                        s["gb_pool"] * GB)),
        "hottest      " + ", ".join(f"L{x['layer']}/e{x['expert']} x{x['requests']:,}"
                                    for x in s["hottest"]),
        f"per layer    distinct experts min {s['per_layer_distinct']['min']}, median "
        f"{s['per_layer_distinct']['median']:g}, max {s['per_layer_distinct']['max']}",
    ]
    if s["truncated_tail"]:
        lines.append(f"WARNING      damaged tail ignored: {s['truncated_tail']}")
    return "\n".join(lines)


def format_replay(rep: dict) -> str:
    pols = rep["policies"]
    rows = rep["capacities"]
    w = max(9, max(len(p) for p in pols) + 1)
    bound = {p: ("" if rep["online"][p] else "*") for p in pols}
    cache = size_texts(*(r["capacity_bytes"] for r in rows))
    cw = max([11] + [len(c) for c in cache])
    head = f"{'CACHE':>{cw}} {'SLOTS':>7} " + " ".join(f"{p + bound[p]:>{w}}" for p in pols)
    tok = f"{rep['tokens']:,}" + (" (estimated)" if rep["tokens_estimated"] else "")
    model = f" on {rep['model']}" if rep.get("model") else ""
    out = [f"trace {rep['trace'] or '(in memory)'}{model}: {rep['requests']:,} requests, "
           f"{tok} tokens, {rep['expert_bytes']:,} B/expert", "", "hit rate (%)", head]
    for c, r in zip(cache, rows):
        out.append(f"{c:>{cw}} {r['slots']:>7,} " + " ".join(
            f"{r['policies'][p]['hit_rate_pct']:>{w}.2f}" for p in pols))
    unit, scale = unit_of(*(r["policies"][p]["gb_read_per_token"] * GB
                            for r in rows for p in pols))
    out += ["", f"{unit} read per token", head]
    for c, r in zip(cache, rows):
        out.append(f"{c:>{cw}} {r['slots']:>7,} " + " ".join(
            f"{r['policies'][p]['gb_read_per_token'] * GB / scale:>{w}.3f}" for p in pols))
    out.append("")
    followed = [(c, r["policies"][p]["followed"]) for p in pols
                for c, r in zip(cache, rows) if "followed" in r["policies"][p]]
    if followed:
        out.append("adaptive followed (at the end): "
                   + ", ".join(f"{c} {name}" for c, name in followed))
    if any(not v for v in rep["online"].values()):
        note = "* offline bound (uses the future)"
        for p in pols:
            if p in POLICIES and POLICIES[p].note:
                note += f"; {p} {POLICIES[p].note}"
        out.append(note)
    out.append(f"compulsory misses {rep['compulsory_misses']:,}: hit-rate ceiling "
               f"{rep['hit_rate_ceiling_pct']:.2f} %; every touched expert "
               f"{size_text(rep['gb_all_touched'] * GB)}")
    if rep.get("capacities_from") == "trace":
        out.append(f"capacities: 1/{round(1 / DERIVED_FRACTIONS[0])} .. 1 of the "
                   f"{rep['compulsory_misses']:,} experts the trace touches; --capacity-gb "
                   "or --slots replays others")
    out += rep["skipped"]
    if rep["truncated_tail"]:
        out.append(f"WARNING damaged tail ignored: {rep['truncated_tail']}")
    return "\n".join(out)


# ---- plot (optional extra) -----------------------------------------------------------

def require_matplotlib():
    """Fail before any work if --plot cannot be honoured: a usage error naming the extra
    that installs it."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib, which is not installed",
                         hint=f"{PLOT_INSTALL}, or drop --plot")


def replay_figure(rep: dict):
    """Hit rate versus capacity, one line per policy (bounds dashed): capacity ticks in
    KB/MB/GB below, slots above, the trace's file name and model in the title."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rep["capacities"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    xs = [r["capacity_bytes"] for r in rows]
    for p in rep["policies"]:
        ys = [r["policies"][p]["hit_rate_pct"] for r in rows]
        ax.plot(xs, ys, marker="o", linestyle="-" if rep["online"][p] else "--",
                label=p + ("" if rep["online"][p] else " (bound)"))
    ax.axhline(rep["hit_rate_ceiling_pct"], color="grey", linewidth=0.8, linestyle=":",
               label="ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, size_texts(*xs))
    ax.tick_params(axis="x", labelrotation=30)
    ax.minorticks_off()
    ax.set_xlabel("expert cache")
    ax.set_ylabel("hit rate (%)")
    slots = ax.secondary_xaxis("top")
    slots.set_xticks(xs, [f"{r['slots']:,}" for r in rows])
    slots.minorticks_off()
    slots.set_xlabel("slots")
    name = Path(rep["trace"]).name if rep.get("trace") else "(in memory)"
    tok = f"{rep['tokens']:,}" + (" (estimated)" if rep["tokens_estimated"] else "")
    ax.set_title(f"{name}: {rep.get('model') or 'unknown model'}\n"
                 f"{rep['requests']:,} requests, {tok} tokens", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_replay(rep: dict, path) -> None:
    """``replay_figure`` to an image file, its format from the name (as savefig)."""
    fig = replay_figure(rep)
    import matplotlib.pyplot as plt
    try:
        with atomic.replacing(path) as f:
            fig.savefig(f, format=Path(path).suffix[1:] or None)
    finally:
        plt.close(fig)
