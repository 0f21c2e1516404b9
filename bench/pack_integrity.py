"""What the pack integrity checks cost (issue 13), measured side by side in one run on the
`medium` checkpoint (generated into scratch/ on first use; packed on first use).

1. k3-run at the floor budget (ring of two slots, top_k + 1 expert slots: every layer is
   read every token) with the trunk CRC check: none (the same run with the manifest's
   CRCs dropped in-process), `--verify-reads first` (the default) and `every`; rounds
   interleaved, medians of s/token (decode) and of the prefill, which holds `first`'s
   one pass. Tokens must be equal in all three.
2. The non-finite checks of the forward: np.isfinite(...).all() on the arrays one decode
   token checks (every layer output, every MoE layer's router scores and bias, the
   logits), timed here and set against the s/token of 1.
3. Opening a pack: the sampled-content identity of every shard and the whole
   ``open_pack`` (schema, identity, layout, expert records) against the checkpoint.
4. Scan rates on a 256 MiB buffer: zlib.crc32, the NaN/Inf scan (numba) and the numpy
   expression it replaces; and how long the main thread stalls while crc32 runs on
   another thread (it releases the GIL on large buffers).
5. k3-pack MB/s with and without the NaN/Inf scan (same code, the scan turned off
   in-process), alternating, to the source's own disk.
Run: python bench/pack_integrity.py [--rounds 2] [--gen 8]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, checkpoint, packed, table  # noqa: E402

from libk3.engine.generate import GenSettings, generate  # noqa: E402
from libk3.engine.session import Reads, open_session  # noqa: E402
from libk3.io.checkpoint import Checkpoint  # noqa: E402
from libk3.kernels.finite import first_special  # noqa: E402
from libk3.budget import ModelSizes, minimum_budget  # noqa: E402
from libk3.stream import trunk as trunk_mod  # noqa: E402

_runs_from_pack = trunk_mod.runs_from_pack

PROMPT = [7 * i % 30000 + 5 for i in range(8)]


def _without_crcs(pack_dir, manifest):
    runs = _runs_from_pack(pack_dir, manifest)
    for run in runs:
        run.crc32 = None
    return runs


def _run(ck, pk, trunk_bytes, cache_bytes, mode, gen):
    trunk_mod.runs_from_pack = _without_crcs if mode == "none" else _runs_from_pack
    try:
        s = open_session(ck, pack=pk, trunk_bytes=trunk_bytes, cache_bytes=cache_bytes,
                         reads=Reads(verify_reads="first" if mode == "none" else mode))
    finally:
        trunk_mod.runs_from_pack = _runs_from_pack
    try:
        r = generate(s.forward, s.new_state(), PROMPT, GenSettings(gen=gen))
        st = s.weights.trunk.stats
        return {"ids": r.generated_ids, "spt": r.seconds_per_token, "prefill": r.prefill_seconds,
                "crc_checks": st["crc_checks"], "crc_s": st["crc_seconds"],
                "wait_s": st["wait_seconds"]}
    finally:
        s.weights.close()
        s.ckpt.close()


def section_run(ck, pk, rounds, gen):
    with Checkpoint.open(ck) as ckpt:
        sizes = ModelSizes.from_checkpoint(ckpt)
    floor = minimum_budget(sizes)
    tb, cb = floor.trunk_bytes + 1, sizes.expert_slot_bytes * (sizes.top_k + 1)
    modes = ("none", "first", "every")
    res = {m: [] for m in modes}
    _run(ck, pk, tb, cb, "none", 1)                       # warm-up: kernels loaded
    for k in range(rounds):
        for m in (modes if k % 2 == 0 else modes[::-1]):
            res[m].append(_run(ck, pk, tb, cb, m, gen))
    base = statistics.median(r["spt"] for r in res["none"])
    rows = []
    for m in modes:
        rs = res[m]
        spt = statistics.median(r["spt"] for r in rs)
        rows.append([m, " ".join(f"{r['spt']:.3f}" for r in rs), f"{spt:.3f}", f"{spt / base:.3f}",
                     f"{statistics.median(r['prefill'] for r in rs):.2f}",
                     rs[0]["crc_checks"], f"{statistics.median(r['crc_s'] for r in rs):.2f}",
                     f"{statistics.median(r['wait_s'] for r in rs):.2f}",
                     "yes" if all(r["ids"] == res["none"][0]["ids"] for r in rs) else "NO"])
    print(f"k3-run, medium at the floor budget (trunk {tb / 1e9:.3f} GB, cache "
          f"{cb / 1e9:.3f} GB), {len(PROMPT)}-token prompt, {gen} tokens, {rounds} rounds "
          f"(medians)")
    print(table(rows, ["CRC check", "s/token per round", "median", "vs none", "prefill s",
                       "CRC checks", "CRC s (reader)", "trunk wait s", "same tokens"]))
    return base


def section_finite(ck, spt):
    with Checkpoint.open(ck) as ckpt:
        cfg = ckpt.config
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((1, cfg.hidden_size), np.float32)] * cfg.num_hidden_layers
    arrays += [rng.standard_normal((1, cfg.num_experts), np.float32),
               rng.standard_normal(cfg.num_experts, np.float32)] * len(cfg.moe_layers)
    arrays.append(rng.standard_normal((1, cfg.vocab_size), np.float32))
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        for a in arrays:
            np.isfinite(a).all()
    per_token = (time.perf_counter() - t0) / reps
    print(f"\nnon-finite checks of one decode token: {len(arrays)} reductions, "
          f"{per_token * 1e6:.0f} us = {per_token / spt:.5%} of {spt:.3f} s/token")


def section_open(ck, pk):
    from libk3.io.identity import source_identity
    from libk3.pack.schema import open_pack
    with Checkpoint.open(ck) as ckpt:
        t0 = time.perf_counter()
        source_identity(ckpt)
        t1 = time.perf_counter()
        open_pack(pk, ckpt)
        t2 = time.perf_counter()
    print(f"\nopening the pack: sampled identity of {len(ckpt.shards)} shards "
          f"{(t1 - t0) * 1e3:.0f} ms; whole open_pack (schema, identity, layout, "
          f"{ckpt.config.num_experts * len(ckpt.config.moe_layers)} expert records) "
          f"{(t2 - t1) * 1e3:.0f} ms")


def section_rates():
    buf = np.random.default_rng(1).integers(0, 256, 256 << 20, dtype=np.uint8)
    bits = buf.view(np.uint16) & np.uint16(0xBFFF)          # no NaN/Inf: full scan
    first_special(bits[:16], np.uint16(0x7F80))              # compiled / loaded
    rows = []
    for name, fn in (("zlib.crc32", lambda: zlib.crc32(buf)),
                     ("NaN/Inf scan, numba (first_special)",
                      lambda: first_special(bits, np.uint16(0x7F80))),
                     ("NaN/Inf scan, numpy ((bits & m) == m).any()",
                      lambda: ((bits & np.uint16(0x7F80)) == np.uint16(0x7F80)).any())):
        best = min(_timed(fn) for _ in range(3))
        rows.append([name, f"{buf.nbytes / best / 1e9:.2f}"])
    print("\nrates on 256 MiB (best of 3)")
    print(table(rows, ["pass", "GB/s"]))
    done, gap = [False], 0.0

    def crc():
        zlib.crc32(buf)
        zlib.crc32(buf)
        done[0] = True
    th = threading.Thread(target=crc)
    t_start = last = time.perf_counter()
    th.start()
    while not done[0]:
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    th.join()
    print(f"main thread's longest stall while another thread ran crc32 over 2 x 256 MiB: "
          f"{gap * 1e3:.1f} ms of {(last - t_start) * 1e3:.0f} ms (the GIL is released)")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def section_pack(ck, rounds):
    import libk3.pack.nonfinite as nf
    from libk3.pack.writer import pack
    real = nf.RunScan.feed
    rows = {"with scan": [], "without scan": []}
    with Checkpoint.open(ck) as ckpt:
        for k in range(rounds):
            for name in (("with scan", "without scan") if k % 2 == 0 else
                         ("without scan", "with scan")):
                out = Path(tempfile.mkdtemp(prefix="k3pack-bench", dir=DATA))
                try:
                    if name == "without scan":
                        nf.RunScan.feed = lambda self, piece: None
                    res = pack(ckpt, out / "p", progress=False)
                    rows[name].append(res.mb_per_s)
                finally:
                    nf.RunScan.feed = real
                    shutil.rmtree(out)
    print(f"\nk3-pack of medium's trunk to the source's disk, {rounds} rounds alternating")
    print(table([[n, " ".join(f"{v:.0f}" for v in vs), f"{statistics.median(vs):.0f}"]
                 for n, vs in rows.items()], ["pack", "MB/s per run", "median"]))


def main(argv) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gen", type=int, default=8)
    a = ap.parse_args(argv)
    ck, pk = checkpoint("medium"), packed("medium")
    spt = section_run(ck, pk, a.rounds, a.gen)
    section_finite(ck, spt)
    section_open(ck, pk)
    section_rates()
    section_pack(ck, a.rounds)


if __name__ == "__main__":
    main(sys.argv[1:])
