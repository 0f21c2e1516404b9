"""A pack striped over two drives against one, side by side in one run, on the medium
synthetic checkpoint at the floor budget (one trunk slot: the whole trunk is read every
token, so the trunk's drive is the bound).

Two directories of this machine's one disk play two drives of a known speed: every
drive queue of k3-run is throttled to R MB/s (``--io-throttle-mbps``), so the striped
pack reads its trunk through two queues of R, the plain pack through one, and the
experts through the shards' own queue of R in both. Which pack goes first alternates by
round; the s/token ratio is the median of the rounds' (striped / plain; target <= 0.6),
and the logits of every run must be the plain pack's, bit for bit.

    python bench/drives.py [--rate-mbps 150] [--rounds 3] [--gen 3] [--keep]

The checkpoint (about 5 GB) and the plain pack go to scratch/ (git-ignored, reused by the
other benches); the striped pack and its stripe directory are deleted at the end unless
--keep. With ``K3_BENCH_STRIPE_DIR`` the stripe directory goes there instead (a real
second drive: then run with a rate above both drives' speed, or none, ``--rate-mbps 0``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import DATA, checkpoint, drop_page_cache, k3_run_report, packed, run, table  # noqa: E402

from libk3.budget import ModelSizes, minimum_budget  # noqa: E402
from libk3.io.checkpoint import Checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--rate-mbps", type=float, default=150.0,
                    help="each drive queue's cap, MB/s (0: no throttle)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()

    ckpt = checkpoint(a.preset)
    plain = packed(a.preset)
    striped = DATA / f"{a.preset}.striped.pack"
    stripe_dir = Path(os.environ.get("K3_BENCH_STRIPE_DIR", DATA / f"{a.preset}.stripe1"))
    if not (striped / "trunk.json").exists():
        print(f"[setup] packing {ckpt} into {striped} + {stripe_dir} ...", flush=True)
        run(["k3-pack", ckpt, striped, "--stripe", stripe_dir, "--quiet"])
    with Checkpoint.open(ckpt) as c:
        sizes = ModelSizes.from_checkpoint(c)
    floor = minimum_budget(sizes)
    budget = ["--trunk-gb", f"{(floor.trunk_bytes + 1) / 1e9:.9f}",
              "--cache-gb", f"{(floor.cache_bytes + 1) / 1e9:.9f}"]
    throttle = ["--io-throttle-mbps", str(a.rate_mbps)] if a.rate_mbps > 0 else []
    print(f"{a.preset}: trunk {sizes.trunk_bytes / 1e9:.2f} GB read every token at the floor; "
          f"each drive queue at {a.rate_mbps or 'unthrottled'} MB/s; {a.rounds} rounds, "
          f"{a.gen} tokens", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="k3-drives-"))
    rows, spt, ratios, want = [], {"plain": [], "striped": []}, [], None
    try:
        for r in range(a.rounds):
            order = [("plain", plain), ("striped", striped)]
            if r % 2:
                order.reverse()
            got = {}
            for name, pk in order:
                for d in (ckpt, pk, stripe_dir):
                    drop_page_cache(d)
                lo = tmp / f"{name}{r}.npy"
                rep = k3_run_report([ckpt, "--pack", pk, "--ids", "1,2,3,4", "--gen", a.gen,
                                     *budget, *throttle, "--logits-out", lo, "--quiet"],
                                    tmp, f"{name}{r}")
                logits = np.load(lo).view(np.uint32)
                want = logits if want is None else want
                same = np.array_equal(logits, want)
                if not same:
                    raise SystemExit(f"round {r + 1} {name}: logits differ from the first run")
                got[name] = rep["seconds_per_token"]
                spt[name].append(rep["seconds_per_token"])
                rows.append([r + 1, name, f"{rep['seconds_per_token']:.3f}",
                             f"{rep['wall_seconds']:.1f}", "yes"])
            ratios.append(got["striped"] / got["plain"])
        print(table(rows, ["round", "pack", "s/token", "wall s", "same logits"]))
        med = statistics.median(ratios)
        print(f"s/token striped / plain: median {med:.3f} over rounds "
              f"({', '.join(f'{x:.3f}' for x in ratios)}); target <= 0.6: "
              f"{'met' if med <= 0.6 else 'NOT met'}; logits identical in every run")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not a.keep:
            shutil.rmtree(striped, ignore_errors=True)
            shutil.rmtree(stripe_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
