"""k3-pack throughput on the `medium` checkpoint next to the disk's raw sequential read
speed, both measured in this run (issue: k3-pack; target: pack >= 70% of raw read).

Page caches are dropped (posix_fadvise DONTNEED) on the shards before each measurement,
so neither figure is served from RAM. The pack is written twice to the source's own disk
and, when /dev/shm has room, twice to RAM (the source disk then is the only limit).

A copy onto the source's own disk moves every byte twice through one device, so the
benchmark also times, in the same run, a plain copy of 1 GiB of the shards onto that disk
(O_DIRECT reads and writes in flight together, no checksums): the disk's own limit for a
copy, next to which the same-disk packs are also shown.
Run: python bench/pack_throughput.py
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import queue
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, checkpoint, drop_page_cache, run, table  # noqa: E402

from libk3.machine.storage import measure_reads, o_direct_check  # noqa: E402
from libk3.io.direct import aligned_empty  # noqa: E402

BLOCK = 16 << 20


def raw_copy(shards, dest: Path, nbytes: int, depth: int = 2) -> float:
    """B/s of a plain copy of the shards' first ``nbytes`` into a fallocated file in
    ``dest``: ``depth`` O_DIRECT readers and ``depth`` O_DIRECT writers of 16 MiB blocks
    joined by a small queue (no checksums, no alignment work: the disk's own limit for a
    copy, the reference for a pack written to the source's own disk)."""
    jobs = [(p, off) for p in shards for off in range(0, p.stat().st_size - BLOCK, BLOCK)]
    jobs = jobs[:max(1, nbytes // BLOCK)]
    scratch = dest / "raw-copy.tmp"
    fd_w = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    os.posix_fallocate(fd_w, 0, len(jobs) * BLOCK)
    todo = iter(enumerate(jobs))
    lock = threading.Lock()
    full: queue.Queue = queue.Queue(maxsize=2 * depth)

    def reader():
        while True:
            with lock:
                job = next(todo, None)
            if job is None:
                full.put(None)
                return
            k, (path, off) = job
            buf = aligned_empty(BLOCK)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                os.preadv(fd, [memoryview(buf)], off)
            finally:
                os.close(fd)
            full.put((k, buf))

    def writer():
        while True:
            item = full.get()
            if item is None:
                return
            k, buf = item
            os.pwrite(fd_w, memoryview(buf), k * BLOCK)

    threads = [threading.Thread(target=f) for f in [reader] * depth + [writer] * depth]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads[:depth]:
        th.join()
    for th in threads[depth:]:
        th.join()
    os.fsync(fd_w)
    dt = time.perf_counter() - t0
    os.close(fd_w)
    scratch.unlink()
    return len(jobs) * BLOCK / dt


def main() -> None:
    src = checkpoint("medium")
    shards = sorted(src.glob("*.safetensors"))
    files = [(p, p.stat().st_size) for p in shards]
    direct = o_direct_check(shards[0])[0]
    drop_page_cache(src)
    raw = measure_reads(files, direct=direct, seq_seconds=6.0, rand_seconds=0.5)
    raw_bps = raw["seq_best_bps"]
    drop_page_cache(src)
    ceiling = raw_copy(shards, DATA, 1 << 30) if direct else None
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
                p = run(["k3-pack", src, out, "--json", "--quiet", "--no-source-probe"])
                info = json.loads(p.stdout)
                rows.append([where, f"#{attempt + 1}", f"{info['bytes_written'] / 1e9:.2f}",
                             f"{info['seconds']:.2f}", f"{info['mb_per_s']:.0f}",
                             f"{info['mb_per_s'] * 1e6 / raw_bps:.0%}",
                             f"{info['mb_per_s'] * 1e6 / ceiling:.0%}"
                             if ceiling and where == "same disk" else "-"])
                shutil.rmtree(out)
    print(f"raw sequential read of the shards ({'O_DIRECT' if direct else 'buffered, cache dropped'}, "
          f"8 MiB blocks, best depth): {raw_bps / 1e6:.0f} MB/s")
    if ceiling:
        print(f"raw copy of 1 GiB of the shards onto the same disk (O_DIRECT, 16 MiB blocks, "
              f"2 reads + 2 writes in flight): {ceiling / 1e6:.0f} MB/s "
              f"({ceiling / raw_bps:.0%} of the raw read)")
    print(table(rows, ["destination", "run", "GB written", "seconds", "MB/s",
                       "of raw read (target 70%)", "of raw same-disk copy"]))
    print("A destination on the source's own disk shares its bandwidth (a copy moves twice "
          "the bytes of a read); the RAM destination shows what the packer does when the "
          "source disk is the only limit.")


if __name__ == "__main__":
    main()
