"""k3-run inside a memory budget on the `medium` checkpoint (issue: k3-run).

Prints, for a resident run and three streamed budgets (the smallest under a quarter of
the model's size): peak RSS from the OS next to budget + the documented fixed overhead,
whether the tokens equal the resident run's, s/token, and the share of time waiting on
I/O. Run: python bench/run_budgets.py  (generates scratch/medium, ~5 GB, on first use).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import checkpoint, k3_run_report, packed, table  # noqa: E402

from libk3.io.checkpoint import Checkpoint  # noqa: E402
from libk3.budget import ModelSizes, minimum_budget, overhead_bytes  # noqa: E402

GEN = 8
PROMPT = ",".join(str(7 * i % 30000 + 5) for i in range(32))


def main() -> None:
    ckpt_dir, pack_dir = checkpoint("medium"), packed("medium")
    with Checkpoint.open(ckpt_dir) as ckpt:
        sizes = ModelSizes.from_checkpoint(ckpt)
    model_bytes = sizes.trunk_bytes + sizes.experts_bytes + sizes.model_level_bytes
    overhead = overhead_bytes(sizes)
    floor = minimum_budget(sizes)
    budgets = [
        ("quarter-", floor.trunk_bytes * 1.15, max(floor.cache_bytes, 0.06 * model_bytes)),
        ("half", 0.5 * sizes.trunk_bytes, 0.25 * sizes.experts_bytes),
        ("all", sizes.trunk_bytes * 1.01, sizes.cache_all_bytes * 1.01),
    ]
    print(f"medium: {model_bytes / 1e9:.2f} GB (trunk {sizes.trunk_bytes / 1e9:.2f}, experts "
          f"{sizes.experts_bytes / 1e9:.2f}, model-level {sizes.model_level_bytes / 1e9:.2f}); "
          f"fixed overhead {overhead / 1e9:.2f} GB; smallest budget "
          f"{(floor.trunk_bytes + floor.cache_bytes) / 1e9:.2f} GB")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = k3_run_report([ckpt_dir, "--ids", PROMPT, "--gen", GEN, "--resident"], tmp, "res")
        rows.append(["resident", "-", "-", f"{base['peak_rss_bytes'] / 1e9:.2f}", "-", "yes",
                     f"{base['seconds_per_token']:.3f}", "-"])
        for name, tb, cb in budgets:
            r = k3_run_report([ckpt_dir, "--pack", pack_dir, "--ids", PROMPT, "--gen", GEN,
                               "--trunk-gb", f"{tb / 1e9:.6f}", "--cache-gb", f"{cb / 1e9:.6f}"],
                              tmp, name)
            budget = r["budget"]["trunk_bytes"] + r["budget"]["cache_bytes"]
            limit = budget + overhead
            wall = r["prefill_seconds"] + r["decode_seconds"]
            io = r["trunk_wait_seconds"] + r["expert_read_seconds"]
            rows.append([
                name, f"{budget / 1e9:.2f} ({budget / model_bytes:.0%} of model)",
                f"{limit / 1e9:.2f}", f"{r['peak_rss_bytes'] / 1e9:.2f}",
                "yes" if r["peak_rss_bytes"] <= limit else "NO",
                "yes" if r["generated_ids"] == base["generated_ids"] else "NO",
                f"{r['seconds_per_token']:.3f}", f"{io / wall:.0%}"])
    print(table(rows, ["run", "budget GB", "budget+overhead", "peak RSS GB", "within",
                       "same tokens", "s/token", "I/O wait share"]))


if __name__ == "__main__":
    main()
