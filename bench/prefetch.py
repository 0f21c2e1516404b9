"""Experts read ahead from a prediction, side by side (issue 49, item 3).

Part 1 (the model): on the `medium` checkpoint at a budget where the whole trunk is held
and experts stream through a cache of ``--cache-share`` of their bytes, k3-run with
``--prefetch-experts 0`` against the default (one token's worth), in alternating rounds:
expert wait seconds per forward pass (the time the forward blocks on expert reads; a
one-token prompt, so every pass carries one token and the first, cold one is included), s/token, prediction hit rate, reads used, bytes wasted,
whether every run's logits are byte-identical. The last run with prediction records a
trace, which ``k3-trace predict`` then prices (without / with / keep).

Part 2 (no model, ``--replay-only`` runs just this): the prediction-aware cache variant
``keep`` (the router's unused guesses admitted to the cache) against plain staging
(``with``) on the synthetic traces ``bench/replay.py`` replays, at Kimi K3's shape, with
guesses synthesised at ``--accuracy`` (each routed expert guessed with that probability,
else a random other expert: an assumption, not a measurement), and on a trace k3-run
recorded with prediction on the `small` checkpoint.

Run: python bench/prefetch.py                  (generates scratch/medium, ~5 GB, once)
     python bench/prefetch.py --replay-only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, checkpoint, k3_run_report, run, table  # noqa: E402

from libk3.budget import ModelSizes  # noqa: E402
from libk3.io.checkpoint import Checkpoint  # noqa: E402
from libk3.io.direct import window_bytes  # noqa: E402
from libk3.k3_dims import EXPERT_BYTES, N_EXPERTS, N_LAYERS, TOP_K  # noqa: E402
from libk3.synth.traces import synth_routing  # noqa: E402
from libk3.trace import format as tr  # noqa: E402
from libk3.trace.prediction import format_prediction, price_prediction  # noqa: E402

PROMPT = "5"       # one prompt token: the prefill pass waits like a decode step


def _budget(ckpt_dir, share):
    """(trunk GB, cache GB): the whole trunk held, ``share`` of the experts' bytes cached."""
    with Checkpoint.open(ckpt_dir) as ckpt:
        sizes = ModelSizes.from_checkpoint(ckpt)
    trunk = sizes.trunk_bytes * 1.05 + 64e6
    cache = max(share * sizes.experts_bytes, (2 * sizes.top_k + 2) * window_bytes(sizes.expert_bytes))
    return f"{trunk / 1e9:.6f}", f"{cache / 1e9:.6f}"


def model_rounds(a) -> None:
    ckpt_dir = checkpoint("medium")
    trunk_gb, cache_gb = _budget(ckpt_dir, a.cache_share)
    print(f"medium at --trunk-gb {trunk_gb} --cache-gb {cache_gb} (whole trunk held, "
          f"{100 * a.cache_share:.0f}% of the experts cached), {a.gen} tokens, {a.rounds} rounds")
    rows, logits, ons, offs = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        trace = tmp / "ahead.k3trace"
        for r in range(a.rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                name = f"{mode}{r}"
                extra = ["--prefetch-experts", 0] if mode == "off" else (
                    ["--trace", trace] if r == a.rounds - 1 else [])
                rep = k3_run_report([ckpt_dir, "--ids", PROMPT, "--gen", a.gen, "--trunk-gb",
                                     trunk_gb, "--cache-gb", cache_gb, "--logits-out",
                                     tmp / f"{name}.npy", *extra], tmp, name)
                logits.append(np.load(tmp / f"{name}.npy").view(np.uint32))
                n = max(1, len(rep["generated_ids"]))      # passes: the prompt + n - 1 fed
                wait = rep["expert_wait_seconds"] / n
                (ons if mode == "on" else offs).append(wait)
                rate = rep["prefetch_hit_rate"]
                rows.append([r, mode, f"{rep['seconds_per_token']:.3f}", f"{wait:.4f}",
                             f"{100 * rep['cache_hit_rate']:.1f}",
                             "-" if rate is None else f"{100 * rate:.1f}",
                             f"{rep['prefetch_used']}/{rep['prefetch_reads']}",
                             f"{rep['prefetch_bytes_wasted'] / 1e6:.1f}",
                             f"{rep['expert_bytes_read'] / 1e6 / n:.1f}"])
                if mode == "on":        # what k3-trace predict replays the trace at
                    slots, ahead = rep["cache_slots"] + rep["prefetch_slots"], rep["prefetch_slots"]
        print(table(rows, ["round", "predict", "s/token", "wait s/pass", "cache hit %",
                           "pred hit %", "used/reads", "MB wasted", "expert MB/token"]))
        same = all(np.array_equal(x, logits[0]) for x in logits)
        print(f"logits identical in every run: {'yes' if same else 'NO'}")
        off_w, on_w = float(np.mean(offs)), float(np.mean(ons))
        print(f"expert wait per pass: off {off_w:.4f} s, on {on_w:.4f} s, ratio "
              f"{on_w / off_w if off_w else float('nan'):.2f} (target <= 0.5)")
        p = run(["k3-trace", "predict", trace, "--slots", slots, "--prefetch", ahead])
        print(p.stdout)


def _with_guesses(layer, expert, n_layers, n_experts, top_k, accuracy, seed):
    """Records of a synthetic decode stream with a guess before each layer visit: each
    routed expert guessed with probability ``accuracy``, else a random expert it did not
    route to."""
    rng = np.random.default_rng(seed)
    visits = layer.size // top_k
    routed = expert.reshape(visits, top_k)
    guess = routed.copy()
    miss = rng.random(guess.shape) >= accuracy
    for v, j in zip(*np.nonzero(miss)):
        while True:
            e = int(rng.integers(n_experts))
            if e not in routed[v] and e not in guess[v]:
                guess[v, j] = e
                break
    rec = np.empty(2 * layer.size, tr.RECORD_DTYPE)
    pos = np.repeat(np.arange(visits) // n_layers, top_k)
    lay = layer.reshape(visits, top_k)
    both = lambda a, b: np.stack([a.reshape(visits, top_k), b.reshape(visits, top_k)], 1).reshape(-1)  # noqa: E731
    rec["pos"] = both(pos, pos)
    rec["seq"] = 0
    rec["layer"] = both(lay, lay)
    rec["expert"] = both(guess, routed)
    rec["phase"] = both(np.full(layer.size, tr.PHASE_PREDICTED), np.full(layer.size, tr.PHASE_DECODE))
    return rec


def _synthetic_trace(path, name, tokens, accuracy):
    knobs = {"decode": dict(zipf_s=0.9, locality=0.3, drift=0.02),
             "zipf-1.3": dict(zipf_s=1.3, locality=0.0, drift=0.0),
             "shifting": dict(zipf_s=1.1, locality=0.0, drift=0.0, shift_every=100)}[name]
    layer, expert = synth_routing(tokens, n_layers=N_LAYERS, n_experts=N_EXPERTS, top_k=TOP_K,
                                  seed=1, **knobs)
    h = tr.TraceHeader(checkpoint=None, expert_bytes=EXPERT_BYTES, n_layers=N_LAYERS,
                       n_experts=N_EXPERTS, top_k=TOP_K, source="import",
                       created_by="bench/prefetch.py", meta={"synthetic": knobs,
                                                             "guess_accuracy": accuracy})
    with tr.TraceWriter(path, h) as w:
        w.append_records(_with_guesses(layer, expert, N_LAYERS, N_EXPERTS, TOP_K, accuracy, 2))
    return path


def _recorded_small() -> Path:
    """k3-run on `small` with the trunk held and prediction on, recorded once."""
    path = DATA / "recorded-small-ahead.k3trace"
    if not path.exists():
        ckpt = checkpoint("small")
        trunk_gb, cache_gb = _budget(ckpt, 0.15)
        print(f"[setup] recording {path} ...", flush=True)
        run(["k3-run", ckpt, "--ids", "5,12,19,26", "--gen", 150, "--temperature", 0.8, "--seed", 1,
             "--trunk-gb", trunk_gb, "--cache-gb", cache_gb, "--trace", path, "--quiet"])
    return path


def replays(a) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        traces = [(name, _synthetic_trace(Path(tmp) / f"{name}.k3trace", name, a.tokens,
                                          a.accuracy)) for name in ("decode", "zipf-1.3",
                                                                    "shifting")]
        traces.append(("recorded-small", _recorded_small()))
        for name, path in traces:
            h = tr.TraceReader(path).header
            slot = window_bytes(h.expert_bytes)
            caps = [(f"{gb} GB", int(gb * 1e9 // slot)) for gb in (8, 64, 128)] \
                if h.n_experts == N_EXPERTS else [("15%", None)]
            for label, slots in caps:
                if slots is None:       # the recorded run's own cache: slots from its size
                    slots = int(0.15 * h.n_experts * (h.n_layers - 1)) + 1
                rep = price_prediction(tr.TraceReader(path), slots, policy=a.policy,
                                       cap=h.top_k)
                w, k, o = rep["with"], rep["keep"], rep["without"]
                rows.append([name, label, slots, f"{100 * w['hit_rate']:.1f}",
                             f"{o['bytes_read'] / 1e9:.2f}", f"{w['bytes_read'] / 1e9:.2f}",
                             f"{k['bytes_read'] / 1e9:.2f}", f"{o['wait_bytes'] / 1e9:.2f}",
                             f"{w['wait_bytes'] / 1e9:.2f}", f"{k['wait_bytes'] / 1e9:.2f}"])
                if a.verbose:
                    print(format_prediction(rep))
    print(f"guesses on synthetic traces: accuracy {a.accuracy} per routed expert (assumed); "
          f"{a.tokens} tokens; policy {a.policy}; staging = top_k slots")
    print(table(rows, ["trace", "cache", "slots", "pred hit %", "GB read off", "with", "keep",
                       "GB waited off", "with", "keep"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--cache-share", type=float, default=0.10)
    ap.add_argument("--replay-only", action="store_true")
    ap.add_argument("--tokens", type=int, default=300, help="synthetic trace tokens")
    ap.add_argument("--accuracy", type=float, default=0.8)
    ap.add_argument("--policy", default="adaptive")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    if not a.replay_only:
        model_rounds(a)
    replays(a)


if __name__ == "__main__":
    main()
