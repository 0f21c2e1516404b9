"""Synthetic expert-routing traces: cyclic layer order, skewed and drifting popularity.

Owns: generating the (layer, expert) request stream of a decode run without a model, for
the cache-policy tests and ``bench/replay.py``. Does not own: the trace file format
(``libk3.trace.format``) or any replay (``libk3.trace.replay``).

The stream imitates what the per-token path of k3-run asks the expert cache for: for
every token, every MoE layer in order, ``top_k`` DISTINCT
experts of that layer. That cyclic layer order is what defeats LRU: a key's reuse distance
is at least one whole cycle (n_layers x top_k requests), so below that many slots LRU hits
almost nothing. Three knobs shape the reuse that a good policy can exploit; all three are
assumptions, not measurements of the real router (K3's router is trained to flatten usage,
so real popularity may be flatter than the defaults):

* ``zipf_s``: per layer, expert popularity follows rank^-s under an independent random
  ranking per layer, so each layer has its own hot experts.
* ``locality``: each of a token's picks copies one of the previous token's experts at the
  same layer with this probability (consecutive tokens route alike).
* ``drift``: per token and layer, with this probability two random popularity ranks swap
  experts, so what is hot changes slowly (a frequency count must age).
* ``shift_every``: every this many tokens (0: never) each layer's ranking is drawn
  afresh, so what is hot changes all at once (a long frequency memory is wrong after
  each shift).

``synth_recompute_keys`` replays the same routing in the C engine's full-recompute order
(every step re-runs the whole prefix), the regime of its published LRU-vs-Belady table.

Deterministic for a seed: the per-layer rankings come from numpy's ``default_rng(seed)``,
the picks from numba's generator seeded with ``seed`` inside the single-threaded kernel.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..k3_dims import EXPERT_BYTES, N_EXPERTS, N_LAYERS, TOP_K
from ..trace.format import PHASE_DECODE


@njit(cache=True, nogil=True)
def _synth_kernel(n_tokens, n_layers, n_experts, top_k, cdf, perm, locality, drift,
                  shift_every, seed, out_layer, out_expert):
    """Fill out_layer/out_expert (n_tokens*n_layers*top_k,) in token, layer, pick order.

    cdf: (n_experts,) f64 cumulative popularity by rank; perm: (n_layers, n_experts) int64
    rank -> expert, mutated by drift. A pick draws a rank by inverse CDF (or, with
    probability ``locality``, one of the previous token's experts at this layer) and is
    redrawn while it repeats an expert already picked for this (token, layer)."""
    np.random.seed(seed)
    prev = np.zeros((n_layers, top_k), np.int64)
    stamp = np.full(n_experts, -1, np.int64)
    i = 0
    for t in range(n_tokens):
        if shift_every > 0 and t > 0 and t % shift_every == 0:
            for L in range(n_layers):
                np.random.shuffle(perm[L])
        for L in range(n_layers):
            if drift > 0.0 and np.random.random() < drift:
                a = np.random.randint(n_experts)
                b = np.random.randint(n_experts)
                tmp = perm[L, a]
                perm[L, a] = perm[L, b]
                perm[L, b] = tmp
            group = t * n_layers + L
            for j in range(top_k):
                while True:
                    if t > 0 and np.random.random() < locality:
                        e = prev[L, np.random.randint(top_k)]
                    else:
                        r = np.searchsorted(cdf, np.random.random() * cdf[-1], side="right")
                        if r >= n_experts:
                            r = n_experts - 1
                        e = perm[L, r]
                    if stamp[e] != group:
                        break
                stamp[e] = group
                out_layer[i] = L
                out_expert[i] = e
                i += 1
            # the picks just written become "previous token" for this layer
            for j in range(top_k):
                prev[L, j] = out_expert[i - top_k + j]


def synth_routing(n_tokens: int, *, n_layers: int = N_LAYERS, n_experts: int = N_EXPERTS,
                  top_k: int = TOP_K,
                  zipf_s: float = 0.9, locality: float = 0.3, drift: float = 0.02,
                  shift_every: int = 0, seed: int = 0):
    """Return (layer, expert) int64 arrays of n_tokens * n_layers * top_k requests.

    The defaults are the bench's assumptions (module docstring) at the real model's
    shape, with every one of the 93 layers routed (the real model routes in layers 1..92
    only; a synthetic stream does not need the dense layer-0 gap)."""
    if not (n_tokens >= 1 and n_layers >= 1 and 1 <= top_k <= n_experts):
        raise ValueError(f"bad synthetic shape tokens={n_tokens} layers={n_layers} "
                         f"experts={n_experts} top_k={top_k}")
    if not (0.0 <= locality < 1.0 and 0.0 <= drift <= 1.0 and zipf_s >= 0.0
            and shift_every >= 0):
        raise ValueError(f"bad synthetic knobs zipf_s={zipf_s} locality={locality} "
                         f"drift={drift} shift_every={shift_every}")
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_experts + 1, dtype=np.float64) ** zipf_s
    cdf = np.cumsum(weights)
    perm = np.stack([rng.permutation(n_experts) for _ in range(n_layers)]).astype(np.int64)
    n = n_tokens * n_layers * top_k
    layer = np.empty(n, np.int64)
    expert = np.empty(n, np.int64)
    _synth_kernel(n_tokens, n_layers, n_experts, top_k, cdf, perm, float(locality),
                  float(drift), int(shift_every), int(seed) & 0x7FFFFFFF, layer, expert)
    return layer, expert


def synth_keys(n_tokens: int, *, n_layers: int = N_LAYERS, n_experts: int = N_EXPERTS,
               top_k: int = TOP_K,
               **knobs) -> np.ndarray:
    """Replay keys layer * n_experts + expert (int64) of a synthetic decode stream."""
    layer, expert = synth_routing(n_tokens, n_layers=n_layers, n_experts=n_experts,
                                  top_k=top_k, **knobs)
    return layer * n_experts + expert


def synth_recompute_keys(prompt_tokens: int, n_tokens: int, *, n_layers: int = N_LAYERS,
                         n_experts: int = N_EXPERTS, top_k: int = TOP_K, **knobs) -> np.ndarray:
    """Replay keys of a FULL-RECOMPUTE run, the mode of the C engine's published replay
    table: step s (s = prompt_tokens .. n_tokens) runs tokens
    0..s-1 again, and each layer requests every token's experts, token-major, before the
    next layer. The per-token routing is ``synth_routing``'s, so steps repeat exactly."""
    if not 1 <= prompt_tokens <= n_tokens:
        raise ValueError(f"need 1 <= prompt_tokens <= n_tokens, got {prompt_tokens}, {n_tokens}")
    layer, expert = synth_routing(n_tokens, n_layers=n_layers, n_experts=n_experts,
                                  top_k=top_k, **knobs)
    per_token = (layer * n_experts + expert).reshape(n_tokens, n_layers, top_k)
    layer_major = per_token.transpose(1, 0, 2)                  # (n_layers, n_tokens, top_k)
    return np.concatenate([layer_major[:, :s].reshape(-1)
                           for s in range(prompt_tokens, n_tokens + 1)])


def write_synth_trace(path, n_tokens: int, *, n_layers: int = N_LAYERS, n_experts: int = N_EXPERTS,
                      top_k: int = TOP_K, expert_bytes: int = EXPERT_BYTES, zipf_s: float = 0.9,
                      locality: float = 0.3, drift: float = 0.02, seed: int = 0):
    """Write a synthetic decode stream as a trace file (formats/trace.md; source
    "import", checkpoint null, the knobs in meta): positions 0..n_tokens-1, decode
    phase, sequence 0."""
    from .. import __version__
    from ..trace.format import RECORD_DTYPE, TraceHeader, TraceWriter

    knobs = {"zipf_s": zipf_s, "locality": locality, "drift": drift, "seed": seed}
    layer, expert = synth_routing(n_tokens, n_layers=n_layers, n_experts=n_experts,
                                  top_k=top_k, **knobs)
    records = np.empty(layer.size, RECORD_DTYPE)
    records["pos"] = np.arange(layer.size) // (n_layers * top_k)
    records["seq"] = 0
    records["layer"] = layer
    records["expert"] = expert
    records["phase"] = PHASE_DECODE
    header = TraceHeader(checkpoint=None, expert_bytes=expert_bytes, n_layers=n_layers,
                         n_experts=n_experts, top_k=top_k, source="import",
                         created_by=f"k3 {__version__} trace_synth",
                         meta={"synthetic": knobs})
    with TraceWriter(path, header) as w:
        w.append_records(records)
    return path
