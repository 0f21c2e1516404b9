"""Multi-token arithmetic on `real-dims`, everything resident, side by side with a BASE tree.

Prints, from one run that alternates BASE and this tree (round 0 of each fills its numba
cache and is not counted), one thread, every weight read into RAM when the session opens
(no disk in the timed part):

1. a 64-token prompt's prefill: process CPU seconds per prompt token (``time.process_time``
   around the prefill passes), and its ratio to BASE (target <= 0.5x);
2. decode after it, 8 tokens: process CPU seconds per token (target <= 0.7x);
3. lockstep, 8 prompts x 8 generated tokens at width 8: tokens/s of the passes in which
   every lane decodes (target >= 1.6x);
4. whether every run of both trees produced the same ids (prefill+decode and lockstep).

Medians of --rounds, with each round's ratio. The kernels alone at the real dimensions,
against this CPU's peak: ``bench/roofline.py``.

With --model, instead: Kimi K3 modelled from kernel rates measured here (BASE's kernels
and this tree's, one thread, in one run): CPU seconds per prompt token at the laptop
preset's prefill chunk (the trunk's dense matrices at the chunk's width, each routed
expert at the tokens a chunk gives it under uniform routing, MLA attention over the
prompt's mean position), and time to first token for 100, 1,000 and 10,000-token
prompts at the laptop preset on this machine (its cores, its drive: --drive-gbps, else
measured by reading a real-dims shard with O_DIRECT) and on an 8-core machine with a
7 GB/s drive (this core's rates on each core). A pass reads the trunk it does not hold
and the union of its experts (no cache hits: an upper bound) while it computes; the
pass takes the longer of the two. Kernel time only: the measured passes spend under 1 %
outside kernels (``bench/roofline.py --stages``).

    python bench/arithmetic.py [--base 49d9015] [--head REV] [--rounds 3]
    python bench/arithmetic.py --model [--base 49d9015] [--drive-gbps G]

Generates scratch/real-dims (~8 GB) on first use.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LOCKSTEP_DRIVER, ROOT, base_tree, checkpoint, table  # noqa: E402

_RUN = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numba
numba.set_num_threads(1)
from libk3.engine.session import open_session
from libk3.engine.generate import GenSettings, generate
""" + LOCKSTEP_DRIVER + r"""
from libk3.model.state import State
s = open_session(sys.argv[2])
cpu = {}
class Cpu:
    # s.forward with CPU time kept by phase: called (a tree from before the engine core)
    # or run over segments (the core)
    def __call__(self, *a, **kw):
        c0 = time.process_time()
        out = s.forward(*a, **kw)
        ph = kw.get("phase", "prefill")
        cpu[ph] = cpu.get(ph, 0.0) + time.process_time() - c0
        return out
    def run(self, segs):
        c0 = time.process_time()
        out = s.forward.run(segs)
        cpu[segs[0].phase] = cpu.get(segs[0].phase, 0.0) + time.process_time() - c0
        return out
    def __getattr__(self, name):
        return getattr(s.forward, name)
fwd = Cpu()
prompt = [(37 * i) % 150000 + 11 for i in range(64)]
r = generate(fwd, s.new_state(), prompt, GenSettings(gen=8))
out = {"prefill_cpu_per_token": cpu["prefill"] / len(prompt),
       "decode_cpu_per_token": cpu["decode"] / len(r.generated_ids),
       "ids": r.generated_ids}


class Timed:
    # s.forward with the passes whose lanes all decode timed apart
    def __init__(self, f):
        self.f, self.decode_s, self.decode_tokens = f, 0.0, 0
    def run(self, segs):
        c0 = time.process_time()
        res = self.f.run(segs)
        if all(g.phase == "decode" for g in segs):
            self.decode_s += time.process_time() - c0
            self.decode_tokens += sum(len(g.ids) for g in segs)
        return res
    def __getattr__(self, name):
        return getattr(self.f, name)


timed = Timed(s.forward)
jobs = [Job(i, [(97 * i + 13 * j) % 150000 + 5 for j in range(8)], GenSettings(gen=8))
        for i in range(8)]
got = {}
run_lockstep(timed, lambda n: State(s.cfg, capacity=n), jobs, 8,
             lambda job, res: got.__setitem__(job.tag, res.generated_ids))
out["lockstep_decode_tokens_per_cpu_s"] = timed.decode_tokens / timed.decode_s
out["lockstep_ids"] = [got[i] for i in range(8)]
print(json.dumps(out))
"""


def extract(rev: str, name: str) -> Path:
    """``rev``'s source tree, extracted once into scratch/NAME (its numba cache kept)."""
    return base_tree(rev, name).parent / "src"


def one(tree: Path, ckpt: Path) -> dict:
    p = subprocess.run([sys.executable, "-c", _RUN, str(tree), str(ckpt)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"the run of {tree} failed ({p.returncode})")
    return json.loads(p.stdout.splitlines()[-1])


_RATES = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numba
numba.set_num_threads(1)
import numpy as np
from libk3.io import mxfp4 as io_mxfp4
from libk3.kernels import bf16, mla, mxfp4
rng = np.random.default_rng(0)
def best(fn, n=3):
    fn()
    t = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); t.append(time.perf_counter() - t0)
    return min(t)
out = {"bf16": {}, "mxfp4": {}}
O, I = 12288, 7168
W = (rng.standard_normal((O, I), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
for T in (1, 2, 8, 64, 256):
    X = rng.standard_normal((T, I), dtype=np.float32); Y = np.empty((T, O), np.float32)
    out["bf16"][T] = 2 * O * I * T / best(lambda: bf16.matmul(W, X, Y))
R, C = 3072, 3584
P, S = io_mxfp4.encode(rng.standard_normal((R, C)).astype(np.float32) * 0.02)
for T in (1, 2, 3, 4, 6, 8, 12, 16, 32):
    X = rng.standard_normal((T, C), dtype=np.float32); Y = np.empty((T, R), np.float32)
    out["mxfp4"][T] = 2 * R * C * T / best(lambda: mxfp4.matmul(P, S, X, Y))
H, nope, rope, vd, r, Tc, T = 96, 128, 64, 128, 512, 4096, 8
latent = rng.standard_normal((Tc, r), dtype=np.float32)
k_rope = rng.standard_normal((Tc, rope), dtype=np.float32)
kv_b = ((rng.standard_normal((H * (nope + vd), r), dtype=np.float32) * 0.05)
        .view(np.uint32) >> 16).astype(np.uint16)
qn = rng.standard_normal((T, H, nope), dtype=np.float32)
qr = rng.standard_normal((T, H, rope), dtype=np.float32)
pos = np.arange(Tc - T, Tc, dtype=np.int64)
oa = np.empty((T, H, vd), np.float32)
# attention only: the per-token kv_b work is priced with the dense matrices
out["mla_per_position"] = 2 * H * (2 * r + rope) * Tc * T / best(
    lambda: mla.mla_attention(qn, qr, pos, latent, k_rope, kv_b, (nope + rope) ** -0.5, oa))
print(json.dumps(out))
"""


def rates(tree: Path) -> dict:
    """FLOP/s of the kernels of ``tree`` at the widths the model prices (one thread)."""
    p = subprocess.run([sys.executable, "-c", _RATES, str(tree)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"the rate run of {tree} failed")
    got = json.loads(p.stdout.splitlines()[-1])
    return {"bf16": {int(k): v for k, v in got["bf16"].items()},
            "mxfp4": {int(k): v for k, v in got["mxfp4"].items()},
            "mla_per_position": got["mla_per_position"]}


def at(table_: dict, T: float) -> float:
    """The rate measured at the nearest width at or below T (the smallest above 0)."""
    keys = sorted(table_)
    below = [k for k in keys if k <= T]
    return table_[below[-1] if below else keys[0]]


def drive_rate(ckpt: Path) -> float:
    """Bytes/s of one sequential O_DIRECT pass over up to 2 GB of a real-dims shard."""
    import mmap
    import os
    import time
    shard = max(ckpt.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    fd = os.open(shard, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 8 << 20)
    total, t0 = 0, time.perf_counter()
    try:
        while total < (2 << 30):
            n = os.preadv(fd, [buf], total)
            if n <= 0:
                break
            total += n
    finally:
        os.close(fd)
    return total / (time.perf_counter() - t0)


def expert_seconds(r: dict, K: int, n_exp: int, k: int, flops: float) -> float:
    """Seconds per chunk token of one MoE layer's experts: each expert's token count n is
    Binomial(K, k / n_exp) (uniform routing), and an expert chosen by n tokens runs at
    the rate measured at the nearest width at or below n."""
    p = k / n_exp
    total, pmf = 0.0, (1 - p) ** K            # P(n = 0), then P(n) by the recurrence
    for n in range(1, K + 1):
        pmf *= (K - n + 1) / n * p / (1 - p)
        if pmf < 1e-12 and n > K * p:
            break
        total += pmf * n * flops / at(r, n)
    return n_exp * total / K


class K3Prefill:
    """Kimi K3's prefill at the laptop preset, priced from kernel rates (``rates``, one
    thread): the trunk's dense matrices at the chunk's width, each routed expert at the
    tokens a chunk gives it under uniform routing, MLA attention over the prompt's mean
    position; a pass reads the trunk the preset does not hold and its experts' union (no
    cache hits: an upper bound) while it computes, and takes the longer of the two."""

    def __init__(self):
        from libk3.budget import ModelSizes, prefill_chunk, resolve_budget
        from libk3.k3_dims import real_config
        cfg = self.cfg = real_config()
        sizes = ModelSizes.from_config(cfg)
        laptop = resolve_budget("laptop", model_sizes=sizes, mem=1 << 50)
        self.K = prefill_chunk(laptop, sizes, 64)[0]
        self.n_exp, self.k = cfg.num_experts, cfg.num_experts_per_token
        self.moe = len(cfg.moe_layers)
        mla_layers = sum(1 for L in range(cfg.num_hidden_layers) if cfg.is_mla(L))
        self.union = self.n_exp * (1 - (1 - self.k / self.n_exp) ** self.K)   # per layer, pass
        self.dense_flops = sizes.bf16_trunk_bytes        # 2 flops per BF16 weight (2 bytes)
        self.one_expert = 3 * 2 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size
        self.mla_flops = mla_layers * 2 * cfg.num_attention_heads * (2 * cfg.kv_lora_rank
                                                                     + cfg.qk_rope_head_dim)
        self.streamed = (max(0, sizes.trunk_bytes - laptop.trunk_bytes)
                         + self.union * self.moe * cfg.expert_bytes)

    def describe(self) -> str:
        return (f"Kimi K3 at the laptop preset: prefill chunk {self.K}, {self.union:.0f} "
                f"distinct experts per MoE layer per pass ({self.K * self.k / self.union:.2f} "
                f"tokens each on average, uniform routing), {self.streamed / 1e9:.0f} GB read "
                f"per pass (trunk not held + the experts' union, no cache hits); per token: "
                f"dense {self.dense_flops / 1e9:.1f} GFLOP, experts "
                f"{self.moe * self.k * self.one_expert / 1e9:.1f} GFLOP, MLA "
                f"{self.mla_flops / 1e6:.1f} MFLOP per earlier position")

    def cpu_per_token(self, r: dict, chunk: int, n_prompt: int) -> float:
        return (self.dense_flops / at(r["bf16"], chunk)
                + self.moe * expert_seconds(r["mxfp4"], chunk, self.n_exp, self.k,
                                            self.one_expert)
                + self.mla_flops * (n_prompt / 2) / r["mla_per_position"])

    def ttft(self, r: dict, n_prompt: int, cores: int, bps: float) -> tuple:
        """(seconds, of which compute alone) to prefill ``n_prompt`` rows on ``cores``
        cores (this core's rates on each) reading at ``bps`` bytes/s."""
        import math
        passes = math.ceil(n_prompt / self.K)
        comp = min(self.K, n_prompt) * self.cpu_per_token(r, self.K, n_prompt) / cores
        return passes * max(comp, self.streamed / bps), passes * comp


def model_section(a) -> None:
    import os
    m = K3Prefill()
    trees = {"base": extract(a.base, "arith-base"),
             "head": extract(a.head, "arith-head") if a.head else ROOT}
    measured = {name: rates(tree) for name, tree in trees.items()}
    here_bps = a.drive_gbps * 1e9 if a.drive_gbps else drive_rate(checkpoint("real-dims"))
    print(m.describe())
    K, n_exp, k = m.K, m.n_exp, m.k
    for name, r in measured.items():
        print(f"{name}: BF16 {at(r['bf16'], K) / 1e9:.1f} GFLOP/s at {K} tokens; MXFP4 "
              + ", ".join(f"{r['mxfp4'][n] / 1e9:.1f}" for n in (1, 2, 4, 8, 32))
              + f" GFLOP/s at 1, 2, 4, 8, 32 tokens; MLA {r['mla_per_position'] / 1e9:.1f} GFLOP/s")
    rows = []
    for chunk in sorted({K, 256, 1024}):
        b = m.cpu_per_token(measured["base"], chunk, 1000)
        h = m.cpu_per_token(measured["head"], chunk, 1000)
        rows.append([chunk, f"{chunk * k / (n_exp * (1 - (1 - k / n_exp) ** chunk)):.2f}",
                     f"{b:.2f}", f"{h:.2f}", f"{h / b:.2f}x"])
    print(table(rows, ["chunk", "tokens per expert", "CPU s/prompt token base",
                       "this tree", "ratio"]))
    print("(one thread, kernels only, a 1,000-token prompt's mean MLA position)\n")
    rows = []
    machines = (("this machine", os.cpu_count() or 1, here_bps), ("8 cores, 7 GB/s", 8, 7e9))
    for n_prompt in (100, 1000, 10000):
        row = [n_prompt]
        for _, cores, bps in machines:
            for name in ("base", "head"):
                total, comp = m.ttft(measured[name], n_prompt, cores, bps)
                row.append(f"{total / 60:.1f}")
            row.append(f"{comp / 60:.1f}")
        rows.append(row)
    heads = ["prompt tokens"]
    for label, cores, bps in machines:
        heads += [f"TTFT min base ({label})", "this tree", "its compute alone"]
    print(table(rows, heads))
    print(f"(this machine: {machines[0][1]} cores, drive {here_bps / 1e9:.2f} GB/s; a pass "
          f"takes the longer of its reads and its compute)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="49d9015")
    ap.add_argument("--head", default=None,
                    help="a commit to measure instead of the working tree (extracted like BASE)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", action="store_true", help="Kimi K3 modelled (see above)")
    ap.add_argument("--drive-gbps", type=float, default=None)
    a = ap.parse_args()
    if a.model:
        model_section(a)
        return
    ckpt = checkpoint("real-dims")
    trees = {"base": extract(a.base, "arith-base"),
             "head": extract(a.head, "arith-head") if a.head else ROOT}
    res = {"base": [], "head": []}
    for r in range(a.rounds + 1):
        order = ("base", "head") if r % 2 else ("head", "base")
        for name in order:
            got = one(trees[name], ckpt)
            print(f"[round {r} {name}] prefill {got['prefill_cpu_per_token']:.4f} CPU s/token, "
                  f"decode {got['decode_cpu_per_token']:.4f} CPU s/token, lockstep "
                  f"{got['lockstep_decode_tokens_per_cpu_s']:.3f} tokens/CPU s", flush=True)
            if r:
                res[name].append(got)
    rows = (("prefill CPU s per prompt token", "prefill_cpu_per_token", "<= 0.5x"),
            ("decode CPU s per token", "decode_cpu_per_token", "<= 0.7x"),
            ("lockstep width 8, decode tokens per CPU s", "lockstep_decode_tokens_per_cpu_s",
             ">= 1.6x"))
    print(f"\nreal-dims, resident, 1 thread; {a.base} vs this tree, median of {a.rounds} rounds")
    for label, key, target in rows:
        b = statistics.median(x[key] for x in res["base"])
        h = statistics.median(x[key] for x in res["head"])
        per = [f"{y[key] / x[key]:.3f}" for x, y in zip(res["base"], res["head"])]
        print(f"{label}: base {b:.4f}, this tree {h:.4f}: {h / b:.3f}x "
              f"(rounds {', '.join(per)}; target {target})")
    runs = res["base"] + res["head"]
    same = all(x["ids"] == runs[0]["ids"] and x["lockstep_ids"] == runs[0]["lockstep_ids"]
               for x in runs)
    print(f"same ids in every run of both trees: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
