"""k3-pack throughput on the `medium` checkpoint next to the disk's raw sequential read
speed, both measured in this run (issue: k3-pack; target: pack >= 70% of raw read).

Page caches are dropped (posix_fadvise DONTNEED) on the shards before each measurement,
so neither figure is served from RAM. The pack is written twice to the source's own disk
and, when /dev/shm has room, twice to RAM (the source disk then is the only limit).
Run: python bench/pack_throughput.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, checkpoint, drop_page_cache, run, table  # noqa: E402

from libk3.hwprobe import measure_reads, o_direct_check  # noqa: E402


def main() -> None:
    src = checkpoint("medium")
    shards = sorted(src.glob("*.safetensors"))
    files = [(p, p.stat().st_size) for p in shards]
    direct = o_direct_check(shards[0])[0]
    drop_page_cache(src)
    raw = measure_reads(files, direct=direct, seq_seconds=6.0, rand_seconds=0.5)
    raw_bps = raw["seq_best_bps"]
    rows = []
    dests = [("same disk", DATA)]
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 3 * sum(s for _, s in files) // 4:
        dests.append(("RAM (/dev/shm)", shm))
    for where, base in dests:
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            for attempt in range(2):
                out = Path(tmp) / f"p{attempt}"
                drop_page_cache(src)
                p = run(["k3-pack", src, out, "--json", "--quiet"])
                info = json.loads(p.stdout)
                rows.append([where, f"#{attempt + 1}", f"{info['bytes_written'] / 1e9:.2f}",
                             f"{info['seconds']:.2f}", f"{info['mb_per_s']:.0f}",
                             f"{info['mb_per_s'] * 1e6 / raw_bps:.0%}"])
                shutil.rmtree(out)
    print(f"raw sequential read of the shards ({'O_DIRECT' if direct else 'buffered, cache dropped'}, "
          f"8 MiB blocks, best depth): {raw_bps / 1e6:.0f} MB/s")
    print(table(rows, ["destination", "run", "GB written", "seconds", "MB/s",
                       "of raw read (target 70%)"]))
    print("A destination on the source's own disk shares its bandwidth (a copy moves twice "
          "the bytes of a read); the RAM destination shows what the packer does when the "
          "source disk is the only limit.")


if __name__ == "__main__":
    main()
