"""Sizing a memory budget offline: how to split it between trunk and expert cache.

Owns: ``size_budget``: for splits of a total budget, the trunk plan the streamer would
use (``libk3.budget.plan_trunk``: pinned layers, ring; each split judged by
``floor_problems``, the rule k3-run admits by), the trunk bytes streamed per token, the expert-cache miss rate replayed from a recorded trace at that cache's slot
count, and the predicted I/O seconds per token from the disk's sequential and random
read speeds. Does not own: replay (``libk3.trace.replay``) or measuring disks (k3-doctor).

The prediction is the I/O time per token (trunk / sequential speed + expert misses x
expert bytes / random speed): the floor for a streamed run, since compute overlaps it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .replay import replay
from ..policies.registry import DEFAULT_POLICY
from ..errors import BudgetError, FormatError
from ..pack.schema import load_manifest
from ..budget import floor_problems, plan_trunk
from ..io.direct import window_bytes
from ..stream.trunk import runs_from_pack
from ..units import gb_option, size_text, size_texts, unit_of
from .format import TraceReader
from .prediction import predicted_visits, split_with_prediction


def disk_speeds_from_doctor(path) -> tuple:
    """(sequential bytes/s, random bytes/s) from a `k3-doctor --json` report."""
    try:
        rep = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"not a k3-doctor JSON report ({str(e)[:200] or type(e).__name__})",
                          path=path) from None
    seq = rand = None
    storage = rep.get("storage") if isinstance(rep, dict) else None
    for st in storage if isinstance(storage, list) else ():
        reads = st.get("reads") if isinstance(st, dict) else None
        reads = reads if isinstance(reads, dict) else {}
        seq = seq or _speed(reads.get("seq_best_bps"))
        rand = rand or _speed(reads.get("rand_best_bps"))
    if not seq or not rand:
        raise FormatError("the doctor report holds no disk measurement (was it --quick?)",
                          path=path)
    return seq / 1e6, rand / 1e6


def _speed(v):
    """A measured speed in bytes/s (a finite positive number), else None."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    return v if ok else None


def size_budget(trace_path, pack_dir, budget: float, seq_bps: float, rand_bps: float, *,
                policy: str = DEFAULT_POLICY, steps: int = 12, prefetch: int = 0) -> dict:
    """Every split's figures (module doc); with ``prefetch`` (k3-run --prefetch-experts)
    on a trace recorded with predictions, each split also prices the read-ahead: expert
    bytes read (guesses included) and waited for per token, and the seconds of that wait
    at the random read speed."""
    reader = TraceReader(trace_path)
    reader.require_replayable()
    vis = predicted_visits(reader) if prefetch else None
    h = reader.header
    keys = reader.layer_expert_keys()
    layers = [r.held_bytes for r in runs_from_pack(pack_dir, load_manifest(pack_dir))]
    if len(layers) != h.n_layers:
        raise FormatError("the pack and the trace describe different models", path=pack_dir,
                          expected=f"{h.n_layers} layers", found=f"{len(layers)} layers")
    moe_layers = len({int(k) // h.n_experts for k in keys[: min(keys.size, 1 << 20)]}) or 1
    tokens = max(1, keys.size // (moe_layers * h.top_k))
    slot = window_bytes(h.expert_bytes)
    rows = []
    for i in range(steps + 1):
        trunk = int(budget * i / steps)
        cache = int(budget) - trunk
        slots = cache // slot
        row = {"trunk_bytes": trunk, "cache_bytes": cache, "cache_slots": slots}
        why = floor_problems(trunk, cache, layers, slot, h.top_k, moe_layers * h.n_experts)
        if why:
            rows.append(dict(row, feasible=False, why="; ".join(why)))
            continue
        plan = plan_trunk(layers, trunk)
        r = replay(keys, slots, policy, n_layers=h.n_layers, n_experts=h.n_experts)
        streamed = plan.streamed_bytes
        expert_read = r["misses"] / tokens * h.expert_bytes
        rows.append(dict(row, feasible=True, pinned_layers=len(plan.pinned), ring_slots=len(plan.slots),
                         trunk_streamed_per_token=streamed, hit_rate=r["hit_rate"],
                         expert_bytes_per_token=expert_read,
                         predicted_io_s_per_token=streamed / seq_bps + expert_read / rand_bps))
        if vis is not None:
            pr = split_with_prediction(vis, h, slots, policy=policy, cap=prefetch, tokens=tokens)
            pr["wait_s_per_token"] = pr["expert_wait_bytes_per_token"] / rand_bps
            rows[-1]["prefetch"] = pr
    ok = [r for r in rows if r["feasible"]]
    if not ok:
        raise BudgetError("no split of this budget can run the model", expected="a larger --budget-gb")
    best = min(ok, key=lambda r: r["predicted_io_s_per_token"])
    return {"trace": str(trace_path), "pack": str(pack_dir), "budget_bytes": int(budget),
            "policy": policy, "prefetch": prefetch, "tokens": tokens, "requests": int(keys.size),
            "seq_bps": seq_bps, "rand_bps": rand_bps, "splits": rows, "best": best}


def format_sizing(rep: dict) -> str:
    rows = rep["splits"]
    trunk = size_texts(*(r["trunk_bytes"] for r in rows))
    cache = size_texts(*(r["cache_bytes"] for r in rows))
    ok = [r for r in rows if r["feasible"]]
    t_unit, t_scale = unit_of(*(r["trunk_streamed_per_token"] for r in ok))
    e_unit, e_scale = unit_of(*(r["expert_bytes_per_token"] for r in ok))
    out = [f"budget {size_text(rep['budget_bytes'])}, {rep['tokens']} tokens in the trace, "
           f"policy {rep['policy']}, disk {rep['seq_bps'] / 1e6:.0f} MB/s sequential, "
           f"{rep['rand_bps'] / 1e6:.0f} MB/s random",
           f"{'trunk':>11} {'cache':>11} {'pinned':>6} {'hit %':>6} "
           f"{'trunk ' + t_unit + '/tok':>13} {'expert ' + e_unit + '/tok':>14} {'I/O s/tok':>9}"]
    for t, c, r in zip(trunk, cache, rows):
        head = f"{t:>11} {c:>11}"
        if not r["feasible"]:
            out.append(f"{head}   -- {r['why']}")
            continue
        mark = "  <- best" if r is rep["best"] or r == rep["best"] else ""
        pr = r.get("prefetch")
        ahead = "" if pr is None else (
            f"   ahead: {pr['expert_bytes_per_token'] / e_scale:.1f} {e_unit}/tok read, "
            f"{pr['expert_wait_bytes_per_token'] / e_scale:.1f} waited "
            f"({pr['wait_s_per_token']:.3f} s)")
        out.append(f"{head} {r['pinned_layers']:6d} {100 * r['hit_rate']:6.1f} "
                   f"{r['trunk_streamed_per_token'] / t_scale:13.1f} "
                   f"{r['expert_bytes_per_token'] / e_scale:14.1f} "
                   f"{r['predicted_io_s_per_token']:9.3f}{mark}{ahead}")
    b = rep["best"]
    out.append(f"recommended: --trunk-gb {gb_option(b['trunk_bytes'])} --cache-gb "
               f"{gb_option(b['cache_bytes'])} (predicted I/O "
               f"{b['predicted_io_s_per_token']:.3f} s/token; compute overlaps it)")
    return "\n".join(out)
