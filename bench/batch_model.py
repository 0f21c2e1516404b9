"""Kimi K3 batch decode at the laptop preset, modelled from pieces measured here (issue 12).

Prints bytes read per generated token and s/token at widths 1, 8, 32 in lockstep, and the
target check (bytes per generated token at width 8 <= 0.35x width 1). What is measured
and what is arithmetic:

* trunk bytes per pass: arithmetic, the project's byte ledger (``libk3.budget`` on the
  Kimi K3 reference config, ``libk3.k3_dims.REAL``): at the laptop preset nothing is
  pinned, so the whole trunk is streamed once per pass; per generated token = / W.
* expert bytes per pass: the union of the experts routed by W independent sequences, per
  (MoE layer, step), counted on SYNTHETIC decode traces (``libk3.synth.traces``, its
  default knobs, one seed per sequence; no recorded Kimi K3 trace exists), times the MXFP4
  expert size, minus the hits of the laptop cache (its slots, the default policy) on the
  union stream replayed in the engine's order (``libk3.trace.replay``).
* per-sequence state: arithmetic (ledger), only for whether W fits (memory column).
* disk: measured, an O_DIRECT read of a temporary file (size printed) beside the models.
* compute per pass, measured at the real widths: with ``--real-dims DIR`` (or
  $K3_REAL_DIMS; the 3-layer real-dims synthetic checkpoint, resident, after a warm-up
  batch) each layer's wall time per decode pass of W one-id prompts in lockstep
  (``Forward.layer_seconds``): its dense layer counts once for K3's, its KDA+MoE layer
  68 times, its MLA+MoE layer 24 times (K3's layer map), each minus its own experts, and
  the rest of its pass (lm_head, embedding, sampling, glue) once. K3's routed experts:
  the three MXFP4 matmuls of one real expert timed on n = 1, 2, 4, ... tokens (linear in
  between), summed over the traces' union with the tokens each expert got. Widths not
  run on real-dims, or no ``--real-dims``: the trunk and lm_head at the BF16 block
  matmul's measured rate on a 8192 x 7168 matrix instead (no KDA/MLA recurrence, norms
  or glue: an underestimate), the "compute from" column says which.
* memory: arithmetic, the planned peak (both budgets + resident + reserve + W sequences of
  4096 positions, formats/presets.md section 2).
* s/token: compute / W plus I/O / W (reads and compute in series) and the larger of the
  two (reads fully hidden behind compute or the reverse); the engine is in between.

    python bench/batch_model.py [--widths 1,8,32] [--steps 64] [--disk-mb 2000]
                                [--real-dims DIR] [--rd-widths 1,8,32] [--rd-gen 3]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, LOCKSTEP_DRIVER, ROOT, run, table  # noqa: E402

from libk3.budget import (GB, ModelSizes, expert_slots, load_presets, load_rules,  # noqa: E402
                          overhead_bytes, plan_trunk, sequence_bytes)
from libk3.config import config_from_dict  # noqa: E402
from libk3.k3_dims import real_config  # noqa: E402
from libk3.kernels import bf16, mxfp4  # noqa: E402
from libk3.policies.registry import DEFAULT_POLICY  # noqa: E402
from libk3.synth.presets import REAL_DIMS  # noqa: E402
from libk3.synth.traces import synth_routing  # noqa: E402
from libk3.trace.replay import replay  # noqa: E402

TARGET = 0.35
BF16_SHAPE = (8192, 7168)          # a trunk matrix at the real hidden size (117 MB)


# ---- the ledger ---------------------------------------------------------------------------

def ledger(preset: str = "laptop") -> dict:
    cfg = real_config()
    sizes = ModelSizes.from_config(cfg)
    p = load_presets()[preset]
    trunk_budget, cache_budget = int(p.trunk_gb * GB), int(p.cache_gb * GB)
    plan = plan_trunk(sizes.layer_bytes, trunk_budget)
    return {"cfg": cfg, "sizes": sizes, "trunk_budget": trunk_budget,
            "cache_budget": cache_budget, "pinned": len(plan.pinned),
            "streamed": plan.streamed_bytes, "slots": expert_slots(sizes, cache_budget),
            "sequence": sequence_bytes(sizes, load_rules().context_positions)}


# ---- the expert union of W independent sequences -------------------------------------------

def union_stream(width: int, steps: int, n_layers: int, n_experts: int, top_k: int):
    """-> (keys, union sizes (steps, n_layers), tokens per union expert (flat)).
    Sequence i is the synthetic decode trace of seed i; per (step, layer) the union is
    taken in first-use order, sequence by sequence, as the engine fetches it."""
    picks = np.stack([synth_routing(steps, n_layers=n_layers, n_experts=n_experts,
                                    top_k=top_k, seed=s)[1].reshape(steps, n_layers, top_k)
                      for s in range(width)], axis=2)          # (steps, layers, W, k)
    keys, sizes, counts = [], np.empty((steps, n_layers), np.int64), []
    for t in range(steps):
        for L in range(n_layers):
            flat = picks[t, L].reshape(-1)
            uniq, first, n = np.unique(flat, return_index=True, return_counts=True)
            order = np.argsort(first, kind="stable")
            keys.append(L * n_experts + uniq[order])
            counts.append(n[order])
            sizes[t, L] = uniq.size
    return np.concatenate(keys), sizes, np.concatenate(counts)


# ---- measured pieces -----------------------------------------------------------------------

def disk_read_rate(size_mb: int, where: Path) -> float:
    """Bytes/s of O_DIRECT reads (16 MiB, 4 in flight) of a fresh ``size_mb`` MB file."""
    chunk, depth = 16 << 20, 4
    n_chunks = max(1, size_mb * 1_000_000 // chunk)
    where.mkdir(parents=True, exist_ok=True)
    fd_w, path = tempfile.mkstemp(prefix="k3-disk-probe-", dir=where)
    try:
        block = np.random.default_rng(0).bytes(chunk)
        for _ in range(n_chunks):
            os.write(fd_w, block)
        os.fsync(fd_w)
        os.close(fd_w)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        bufs = [mmap.mmap(-1, chunk) for _ in range(depth)]      # page-aligned
        try:
            def read(i):
                return os.preadv(fd, [bufs[i % depth]], i * chunk)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(depth) as pool:
                for lo in range(0, n_chunks, depth):
                    got = sum(pool.map(read, range(lo, min(lo + depth, n_chunks))))
                    assert got == chunk * (min(lo + depth, n_chunks) - lo)
            return n_chunks * chunk / (time.perf_counter() - t0)
        finally:
            os.close(fd)
    finally:
        os.unlink(path)


def _median_seconds(fn, reps: int) -> float:
    fn()                                                  # compile / warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bf16_seconds_per_byte(tokens: int, reps: int) -> float:
    """Seconds per weight byte of the BF16 block matmul on ``tokens`` tokens."""
    rng = np.random.default_rng(1)
    O, I = BF16_SHAPE
    W = rng.integers(0x3C00, 0x3F80, size=(O, I), dtype=np.uint16)   # moderate BF16 values
    X = rng.standard_normal((tokens, I)).astype(np.float32)
    Y = np.empty((tokens, O), np.float32)
    return _median_seconds(lambda: bf16.matmul(W, X, Y), reps) / W.nbytes


def expert_seconds(cfg, tokens: int, reps: int) -> float:
    """Seconds of one routed expert (w1, w3: [inter, lat]; w2: [lat, inter]; MXFP4) on
    ``tokens`` tokens."""
    rng = np.random.default_rng(2)
    lat, inter = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size

    def weight(rows, cols):
        return (rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8),
                np.full((rows, cols // 32), 127, np.uint8))
    w1, w3, w2 = weight(inter, lat), weight(inter, lat), weight(lat, inter)
    z = rng.standard_normal((tokens, lat)).astype(np.float32)
    h = np.empty((tokens, inter), np.float32)
    h3 = np.empty_like(h)
    y = np.empty((tokens, lat), np.float32)

    def one():
        mxfp4.matmul(*w1, z, h)
        mxfp4.matmul(*w3, z, h3)
        mxfp4.matmul(*w2, h, y)
    return _median_seconds(one, reps)


class KernelTimes:
    """Measured kernel times, on demand, per token count (cached)."""

    def __init__(self, cfg, reps: int):
        self.cfg, self.reps = cfg, reps
        self._bf16, self._expert = {}, {}

    def bf16_per_byte(self, tokens: int) -> float:
        if tokens not in self._bf16:
            self._bf16[tokens] = bf16_seconds_per_byte(tokens, self.reps)
        return self._bf16[tokens]

    def expert(self, tokens: int) -> float:
        """Measured at 1, 2, 4, 8, ... tokens; linear in between."""
        points = [1 << i for i in range(max(1, tokens - 1).bit_length() + 1)]
        for n in points:
            if n not in self._expert:
                self._expert[n] = expert_seconds(self.cfg, n, self.reps)
        return float(np.interp(tokens, points, [self._expert[n] for n in points]))

    def experts(self, counts) -> float:
        """Seconds of the union's experts, each on the tokens routed to it."""
        n = np.bincount(np.asarray(counts, np.int64))
        return sum(int(c) * self.expert(t) for t, c in enumerate(n) if c)


def modelled_compute(sizes: ModelSizes, width: int, counts, kt: KernelTimes,
                     passes: int) -> dict:
    """Kernel seconds per pass of ``width`` tokens: the BF16 trunk matrices and lm_head at
    the block matmul's measured rate, and the routed experts with the token counts of
    ``counts`` (over ``passes`` passes). Leaves out KDA/MLA per token, norms and glue."""
    dense = (sizes.bf16_trunk_bytes + sizes.lm_head_bytes) * kt.bf16_per_byte(width)
    return {"dense": dense, "experts": kt.experts(counts) / passes}


# ---- real-dims: whole layers at the real widths --------------------------------------------

_LAYERS = r"""
import json, sys
from libk3.engine.generate import GenSettings
""" + LOCKSTEP_DRIVER + r"""
from libk3.engine.session import open_session
from libk3.model.state import State
s = open_session(sys.argv[1])                      # every weight resident
width, gen = int(sys.argv[2]), int(sys.argv[3])
def batch(n, first):
    return [Job(i, [first + 37 * i], GenSettings(gen=gen)) for i in range(n)]
new_state = lambda n: State(s.cfg, capacity=n)
run_lockstep(s.forward, new_state, batch(8, 500), 8, lambda j, r: None)   # load, warm
f = s.forward
layers0, union0, passes0 = list(f.layer_seconds), list(f.expert_union), f.passes
st = run_lockstep(s.forward, new_state, batch(width, 1000), width, lambda j, r: None)
n = f.passes - passes0
print(json.dumps({"passes": n, "pass_seconds": st.seconds / n,
                  "layers": [(a - b) / n for a, b in zip(f.layer_seconds, layers0)],
                  "union": [(a - b) / n for a, b in zip(f.expert_union, union0)]}))
"""


def real_dims_layers(ckpt: Path, width: int, gen: int) -> dict:
    """Per pass of ``width`` one-id prompts on the resident real-dims checkpoint (after a
    warm-up batch that loads every weight; a one-id prefill is a decode pass's work):
    seconds of the whole pass, of each layer (``Forward.layer_seconds``), and the mean
    expert union of each layer."""
    p = run([sys.executable, "-c", _LAYERS, ckpt, width, gen], cwd=ROOT)
    return json.loads(p.stdout.splitlines()[-1])


def even_counts(width: int, top_k: int, union: float) -> list:
    """Token counts of ``union`` experts sharing ``width * top_k`` routed tokens evenly."""
    u = max(1, round(union))
    base, extra = divmod(width * top_k, u)
    return [base + 1] * extra + [base] * (u - extra)


def measured_pass(rd: dict, rd_cfg, cfg, width: int, counts_per_pass, kt, steps: int) -> dict:
    """Kimi K3 compute per pass from real-dims' measured layers: its dense layer once, its
    KDA+MoE and MLA+MoE layers (experts taken out by the kernel model of its own union)
    once per such layer of K3, K3's experts by the kernel model of the traces' union, and
    real-dims' rest of the pass (lm_head, embedding, sampling, glue) once."""
    k = rd_cfg.num_experts_per_token
    trunk = {}
    for L, t in enumerate(rd["layers"]):
        if L in rd_cfg.moe_layers:
            t -= kt.experts(even_counts(width, k, rd["union"][L]))
        trunk[("mla" if rd_cfg.is_mla(L) else "kda", L in rd_cfg.moe_layers)] = max(0.0, t)
    rest = max(0.0, rd["pass_seconds"] - sum(rd["layers"]))
    layers = sum(trunk[("mla" if cfg.is_mla(L) else "kda", L in cfg.moe_layers)]
                 for L in range(cfg.num_hidden_layers))
    return {"dense": layers + rest, "experts": kt.experts(counts_per_pass) / steps}


# ---- the table -----------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="1,8,32")
    ap.add_argument("--steps", type=int, default=64, help="decode steps of each trace")
    ap.add_argument("--disk-mb", type=int, default=2000, help="size of the disk probe file")
    ap.add_argument("--reps", type=int, default=3, help="timed repeats per kernel (median)")
    ap.add_argument("--real-dims", type=Path, default=os.environ.get("K3_REAL_DIMS"),
                    help="real-dims checkpoint (or $K3_REAL_DIMS) for the unmodelled part")
    ap.add_argument("--rd-widths", default="1,8,32", help="widths run on real-dims")
    ap.add_argument("--rd-gen", type=int, default=3, help="tokens per real-dims prompt")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]

    led = ledger()
    cfg, sizes = led["cfg"], led["sizes"]
    n_moe, E, k = len(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_token
    print(f"Kimi K3 at laptop: trunk budget {led['trunk_budget'] / GB:.2f} GB "
          f"({led['pinned']} layers pinned), streamed per pass {led['streamed'] / GB:.3f} GB; "
          f"cache {led['cache_budget'] / GB:.2f} GB = {led['slots']} slots of "
          f"{sizes.expert_slot_bytes} B; expert {sizes.expert_bytes} B; "
          f"per sequence {led['sequence'] / GB:.3f} GB", flush=True)

    kt = KernelTimes(cfg, args.reps)
    rd = {}
    if args.real_dims:
        rd_cfg = config_from_dict(dict(REAL_DIMS), source="<real-dims>")
        for w in (int(x) for x in args.rd_widths.split(",")):
            rd[w] = real_dims_layers(args.real_dims, w, args.rd_gen)
            print(f"real-dims width {w}, per decode pass ({rd[w]['passes']} passes): "
                  f"{rd[w]['pass_seconds']:.3f} s; layers "
                  f"{', '.join(f'{t:.3f}' for t in rd[w]['layers'])} s; expert union "
                  f"{', '.join(f'{u:.1f}' for u in rd[w]['union'])}", flush=True)
    disk = disk_read_rate(args.disk_mb, DATA)
    print(f"disk: O_DIRECT read of a {args.disk_mb} MB file beside the models: "
          f"{disk / 1e9:.3f} GB/s", flush=True)

    rows, base_bytes = [], None
    for w in widths:
        keys, usize, counts = union_stream(w, args.steps, n_moe, E, k)
        hits = replay(keys, led["slots"], DEFAULT_POLICY, n_layers=n_moe,
                      n_experts=E)["hits"]
        trunk_tok = led["streamed"] / w
        expert_tok = (keys.size - hits) * sizes.expert_bytes / (args.steps * w)
        total = trunk_tok + expert_tok
        base_bytes = base_bytes or total
        if w in rd:
            comp, source = measured_pass(rd[w], rd_cfg, cfg, w, counts, kt, args.steps), \
                "real-dims layers"
        else:
            comp, source = modelled_compute(sizes, w, counts, kt, args.steps), "kernels only"
        compute_tok = (comp["dense"] + comp["experts"]) / w
        io_tok = total / disk
        peak = led["trunk_budget"] + led["cache_budget"] + overhead_bytes(sizes, width=w)
        rows.append([w, f"{usize.mean():.1f}", f"{hits / keys.size:.4f}",
                     f"{trunk_tok / GB:.2f}", f"{expert_tok / GB:.2f}", f"{total / GB:.2f}",
                     f"{total / base_bytes:.3f}x", source, f"{comp['dense'] / w:.2f}",
                     f"{comp['experts'] / w:.2f}", f"{io_tok:.1f}",
                     f"{compute_tok + io_tok:.1f}", f"{max(compute_tok, io_tok):.1f}",
                     f"{peak / GB:.2f}"])
        print(f"[width {w} done]", flush=True)
    print(table(rows, ["width", "union/layer", "cache hits", "trunk GB/tok", "expert GB/tok",
                       "total GB/tok", "vs w1", "compute from", "trunk s/tok", "expert s/tok",
                       "I/O s/tok", "s/tok serial", "s/tok overlapped", "peak GB"]))
    print("one expert's three MXFP4 matmuls, median s at n tokens: "
          + ", ".join(f"{n}: {t:.4f}" for n, t in sorted(kt._expert.items())))
    if kt._bf16:
        print("BF16 block matmul 8192 x 7168, GB/s of weights at T tokens: "
              + ", ".join(f"{n}: {1e-9 / t:.2f}" for n, t in sorted(kt._bf16.items())))
    if 8 in widths:
        r = next(x for x in rows if x[0] == 8)
        ratio = float(r[6].rstrip("x"))
        print(f"target: width 8 bytes per generated token <= {TARGET}x width 1: "
              f"{ratio:.3f}x {'met' if ratio <= TARGET else 'NOT met'}")


if __name__ == "__main__":
    main()
