"""Pricing expert prediction offline: what k3-run's read-ahead would read, use and waste.

Owns: ``price_prediction`` (and ``split_with_prediction``, its figures for one split of
``k3-trace size``), which replays a v2 trace's requests together with its
predicted records (formats/trace.md, "Predictions") through the online policy object
k3-run's cache drives, the way ``libk3.stream.experts`` runs it: the budget's slots less
the staging slots go to the policy, a layer visit's guess (``libk3.model.predict.ranked``,
capped) reads only what the cache does not hold, and a routed expert whose guess was read
is a miss taken off the wait path. Also a prediction-aware variant (``keep``): guesses the
router did not take are admitted to the cache instead of dropped. Does not own: the trace
layout (``libk3.trace.format``) or the policies (``libk3.policies``).

A visit is a maximal run of requests of one layer (what one forward pass asks the cache
for: each distinct expert once, in first-use order); the predicted records of that layer
just before it are its guess.
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError, UsageError
from ..model.predict import ranked
from ..policies.online import make_cache_policy
from .format import PHASE_PREDICTED, TraceReader


def visits(records) -> list:
    """[(layer, guess ids in record order or None, requested ids in first-use order)]."""
    if records.size == 0:
        return []
    pred = records["phase"] == PHASE_PREDICTED
    layer = records["layer"].astype(np.int64)
    cut = np.flatnonzero((layer[1:] != layer[:-1]) | (pred[1:] != pred[:-1])) + 1
    out, guess = [], None
    for a, b in zip(np.r_[0, cut], np.r_[cut, records.size]):
        ids = records["expert"][a:b].astype(np.int64)
        if pred[a]:
            guess = (int(layer[a]), ids)
            continue
        g = guess[1] if guess is not None and guess[0] == layer[a] else None
        out.append((int(layer[a]), g, ids[np.sort(np.unique(ids, return_index=True)[1])]))
        guess = None
    return out


def _replay(vis, n_layers, n_experts, slots, policy, cap, keep):
    """One replay: counters of the cache (policy over ``slots`` - ``cap`` slots) with a
    read-ahead of at most ``cap`` guessed experts per visit (``cap`` 0: none)."""
    pol = make_cache_policy(policy, slots - cap, n_layers=n_layers, n_experts=n_experts)
    where = np.full(n_layers * n_experts, -1, np.int64)
    c = dict.fromkeys(("requests", "misses", "predictions", "predicted", "hits", "reads",
                       "used"), 0)

    def access(keys):
        out = pol.access(np.asarray(keys, np.int64))
        for k, (s, ev, hit) in zip(keys, out.tolist()):
            if not hit:
                if ev >= 0:
                    where[ev] = -1
                where[k] = s
        return out[:, 2]

    for L, guess, req in vis:
        base = L * n_experts
        reads = set()
        if cap and guess is not None:
            g = ranked(guess)[:cap]
            c["predictions"] += 1
            c["predicted"] += g.size
            c["hits"] += int(np.isin(g, req).sum())
            reads = {int(e) for e in g if where[base + e] < 0}
            c["reads"] += len(reads)
        for i in range(0, req.size, slots - cap):        # batches of at most the slots
            part = req[i:i + slots - cap]
            hit = access((base + part).tolist())
            c["requests"] += part.size
            missed = part[hit == 0]
            c["misses"] += missed.size
            c["used"] += sum(int(e) in reads for e in missed)
        wrong = sorted(reads - {int(e) for e in req})
        if keep and wrong:
            access([base + e for e in wrong])
    return c


def predicted_visits(reader: TraceReader) -> list:
    """``visits`` of every record of a replayable trace that holds predictions (a one-line
    refusal otherwise)."""
    reader.require_replayable()
    vis = visits(reader.read_all(predictions=True))
    if not vis:
        raise FormatError("trace holds no requests", path=reader.path)
    if not any(g is not None for _, g, _ in vis):
        raise FormatError("trace holds no predicted records (record it with k3-run "
                          "--trace at a budget that pins the trunk, prefetch on)",
                          path=reader.path)
    return vis


def split_with_prediction(vis, header, slots: int, *, policy: str, cap: int,
                          tokens: int) -> dict:
    """For ``k3-trace size``: one split's expert bytes read and waited for per token with a
    read-ahead of ``cap`` experts per layer (capped as k3-run caps it at ``slots``)."""
    cap = max(0, min(cap, slots - (header.top_k + 1)))
    c = _replay(vis, header.n_layers, header.n_experts, slots, policy, cap, False)
    eb = header.expert_bytes
    return {"staging_slots": cap,
            "hit_rate": c["hits"] / c["predicted"] if c["predicted"] else None,
            "expert_bytes_per_token": (c["misses"] + c["reads"] - c["used"]) * eb / tokens,
            "expert_wait_bytes_per_token": (c["misses"] - c["used"]) * eb / tokens}


def price_prediction(reader: TraceReader, slots: int, *, policy: str, cap: int) -> dict:
    """Replay ``reader``'s trace at ``slots`` cache slots without and with a read-ahead of
    ``cap`` experts per layer (as ``libk3.stream.experts``: staging slots come out of the
    budget, never leaving fewer than top_k + 1), and with the ``keep`` variant."""
    vis = predicted_visits(reader)
    h = reader.header
    need = h.top_k + 1
    if slots < need:
        raise UsageError(f"--slots {slots} holds fewer than this trace's top_k + 1 = {need} "
                         "experts")
    cap = max(0, min(cap, slots - need))
    eb = h.expert_bytes
    base = _replay(vis, h.n_layers, h.n_experts, slots, policy, 0, False)
    out = {"trace": str(reader.path), "policy": policy, "slots": slots, "staging_slots": cap,
           "expert_bytes": eb, "requests": base["requests"],
           "without": {"misses": base["misses"], "bytes_read": base["misses"] * eb,
                       "wait_bytes": base["misses"] * eb}}
    for name, keep in (("with", False), ("keep", True)):
        c = _replay(vis, h.n_layers, h.n_experts, slots, policy, cap, keep)
        wasted = c["reads"] - c["used"]
        out[name] = {"misses": c["misses"], "predictions": c["predictions"],
                     "predicted": c["predicted"], "hits": c["hits"],
                     "hit_rate": c["hits"] / c["predicted"] if c["predicted"] else None,
                     "reads": c["reads"], "used": c["used"],
                     "bytes_read": (c["misses"] + wasted) * eb, "bytes_wasted": wasted * eb,
                     "wait_bytes": (c["misses"] - c["used"]) * eb,
                     "wait_bytes_saved": (base["misses"] - c["misses"] + c["used"]) * eb}
    return out


def format_prediction(rep: dict) -> str:
    w = rep["without"]
    lines = [f"{rep['trace']}: {rep['requests']:,} requests, policy {rep['policy']}, "
             f"{rep['slots']} slots ({rep['staging_slots']} of them staging with prediction)",
             f"{'':9} {'misses':>8} {'hit %':>6} {'used':>6} {'MB read':>9} {'MB wasted':>9} "
             f"{'MB waited':>9}",
             f"{'without':9} {w['misses']:8d} {'':>6} {'':>6} {w['bytes_read'] / 1e6:9.1f} "
             f"{0:9.1f} {w['wait_bytes'] / 1e6:9.1f}"]
    for name in ("with", "keep"):
        r = rep[name]
        rate = "" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}"
        lines.append(f"{name:9} {r['misses']:8d} {rate:>6} {r['used']:6d} "
                     f"{r['bytes_read'] / 1e6:9.1f} {r['bytes_wasted'] / 1e6:9.1f} "
                     f"{r['wait_bytes'] / 1e6:9.1f}")
    lines.append("with: guesses read into staging slots; keep: the router's unused guesses "
                 "kept in the cache; MB waited: read while a layer waits")
    return "\n".join(lines)
