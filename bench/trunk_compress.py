"""Compressed trunk (issue 16), side by side in one run, on the real-dims checkpoint:

* codec: stored fraction and decode rate of the chosen codec (a 4-bit exponent code
  with escapes, ``libk3.pack.codec``) against the zstd exponent plane k3 shipped
  first (``bench/zstd_candidate.py``) and a numba Huffman table decoder
  (``bench/huffman_candidate.py``), per core and on every core, on the same bytes (the
  largest BF16 tensor of real-dims layer 1, up to 64 MiB);
* pack: the whole real-dims trunk compressed (fraction of raw), decode rate of whole
  layers on every core, and the O_DIRECT sequential read rate of the raw trunk.bin;
* mxfp4-derived: the same codec figures on BF16 values built from the released MXFP4
  conformance bytes (``mxfp4.json`` of the conformance vectors, found by ``tests/conformance.py``
  and read in place, never copied):
  each of its 229,376 values is drawn uniformly inside the E2M1 rounding interval of its
  code, times its group's scale (section text says what that assumes);
* buffers: direct reads of the compressed trunk (4 MiB pieces, 4 in flight) into
  Python's default anonymous mapping (shared: shmem, 4 KiB pages wherever they fall) vs
  ``aligned_empty`` (private, huge pages), alternating, with the mean request size the
  disk saw (its /sys/dev/block stat);
* stream: the trunk streamer alone at the floor (every layer through one ring slot, no
  forward), raw vs compressed, which goes first alternating by round;
* run: ``k3-run --pack`` at the floor budget (one ring slot: the whole trunk read every
  token, with no read-ahead) raw vs compressed, which goes first alternating by round,
  same tokens required; the target is judged on the median of the rounds' ratios (each
  pair a minute apart, so the disk's drift within the run mostly cancels);
* base (with ``--base REV``): the same k3-run at the floor, raw pack, the tree at REV
  against this one, alternating (what this tree's floor changes are worth alone).

    python bench/trunk_compress.py [--rounds 3] [--gen 4] [--keep] [--base REV]
                                   [--sections run,base]

Models go to scratch/ (git-ignored); the compressed pack is a copy of the raw one and is
deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # tests.conformance
from common import DATA, ROOT, checkpoint, k3_run_report, packed, run, table  # noqa: E402

from libk3.machine.storage import sequential_read_rate  # noqa: E402
from libk3.io.checkpoint import Checkpoint  # noqa: E402
from libk3.pack.schema import open_pack  # noqa: E402
from libk3.budget import ModelSizes, minimum_budget  # noqa: E402
from libk3.pack.codec import Codec, plan_blocks  # noqa: E402
from tests.conformance import ROOT as CONFORMANCE_DIR  # noqa: E402  (where the vectors live)

SAMPLE_MAX = 64 << 20
CONFORMANCE = CONFORMANCE_DIR / "mxfp4.json"
# each E2M1 magnitude's rounding interval (the top code, 6, is taken as [5, 7))
E2M1_LO = np.array([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
E2M1_HI = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0])


def _best(fn, n=3) -> float:
    best = None
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return best


def sample_tensor(ckpt_dir: Path) -> tuple:
    """(name, uint8 BF16 bytes) of layer 1's largest BF16 trunk tensor, cut to SAMPLE_MAX."""
    with Checkpoint.open(ckpt_dir) as ck:
        run_ = ck.layer_trunk_run(1)
        name, (off, nb, dt, _) = max(((n, t) for n, t in run_.tensors.items() if t[2] == "BF16"),
                                     key=lambda x: x[1][1])
        n = min(nb, SAMPLE_MAX) // 2 * 2
        raw = np.frombuffer(bytes(ck.read_span(run_.path, run_.offset + off, n)), np.uint8)
    return name, raw.copy()


def mxfp4_derived(copies: int = 64) -> np.ndarray | None:
    """uint8 BF16 bytes: ``copies`` draws over the released MXFP4 sample (module doc)."""
    if not CONFORMANCE.is_file():
        return None
    d = json.loads(CONFORMANCE.read_text())
    packed = np.array(d["packed"]["data"], np.uint8).reshape(d["packed"]["shape"])
    scales = np.array(d["scales"]["data"], np.int64).reshape(d["scales"]["shape"])
    nib = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    nib[:, 0::2], nib[:, 1::2] = packed & 15, packed >> 4
    mag, sign = nib & 7, np.where(nib & 8, -1.0, 1.0)
    scale = 2.0 ** (np.repeat(scales, d["group_size"], axis=1) - 127)
    rng = np.random.default_rng(0)
    out = []
    for _ in range(copies):
        f = (rng.uniform(E2M1_LO[mag], E2M1_HI[mag]) * sign * scale).astype(np.float32)
        u = f.view(np.uint32).astype(np.uint64)
        out.append(((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16))   # round to BF16
    return np.concatenate([o.ravel() for o in out]).view(np.uint8)


def codec_section(raw: np.ndarray, name: str) -> None:
    import huffman_candidate as hc
    import zstd_candidate as zc

    rows = []
    plan = plan_blocks([("w", 0, raw.size, "BF16")])
    for threads in (1, 2):
        c = Codec(threads)
        blob, rec = c.encode(raw, plan)
        p = plan.with_index(rec)
        src, out = np.frombuffer(blob, np.uint8), np.empty_like(raw)
        c.decode(p, 0, len(p), src, 0, out, True, "x", 0)
        assert out.tobytes() == raw.tobytes()
        t = _best(lambda: c.decode(p, 0, len(p), src, 0, out, False, "x", 0))
        tc = _best(lambda: c.decode(p, 0, len(p), src, 0, out, True, "x", 0))
        c.close()
        rows.append(["4-bit exponent code (chosen)", threads, f"{len(blob) / raw.size:.4f}",
                     f"{raw.size / t / 1e9:.2f}", f"{raw.size / tc / 1e9:.2f}"])
    for label, mod in (("zstd exponent plane (shipped first)", zc),
                       ("numba Huffman table (candidate)", hc)):
        enc = mod.encode_all(raw.view(np.uint16))
        for threads in (1, 2):
            out16 = np.empty(raw.size // 2, np.uint16)
            mod.decode_all(enc, out16, threads)
            assert out16.view(np.uint8).tobytes() == raw.tobytes()
            t = _best(lambda: mod.decode_all(enc, out16, threads))
            rows.append([label, threads, f"{enc.stored / raw.size:.4f}",
                         f"{raw.size / t / 1e9:.2f}", "-"])
    ent = _exponent_entropy(raw)
    print(f"\n== codec, {raw.size / 2**20:.0f} MiB of {name} (exponent entropy {ent:.2f} bits: "
          f"entropy bound {(8 + ent) / 16:.4f} of raw)")
    print(table(rows, ["codec", "threads", "stored / raw", "decode GB/s (output)",
                       "with CRC check"]))


def _exponent_entropy(raw: np.ndarray) -> float:
    e = (raw.view(np.uint16) >> 7) & 0xFF
    p = np.bincount(e, minlength=256) / e.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def pack_section(raw_pack: Path, kz_pack: Path) -> dict:
    pk = open_pack(kz_pack)
    man = pk.manifest
    raw_bytes = sum(l["nbytes"] for l in man["layers"])
    stored = sum(l["stored"] for l in man["layers"])
    trunk = raw_pack / "trunk.bin"
    seq = sequential_read_rate([(str(trunk), 0, trunk.stat().st_size)], seconds=3.0)
    codec = Codec(2)
    rates = []
    for lay, plan in zip(man["layers"], pk.blocks):
        with open(kz_pack / "trunk.kz", "rb") as f:
            f.seek(lay["file_off"])
            src = np.frombuffer(f.read(lay["stored"]), np.uint8)
        out = np.empty(lay["nbytes"], np.uint8)
        t = _best(lambda: codec.decode(plan, 0, len(plan), src, 0, out, False, "x", 0), 2)
        tc = _best(lambda: codec.decode(plan, 0, len(plan), src, 0, out, True, "x", 0), 2)
        rates.append((lay["layer"], lay["nbytes"], lay["stored"], lay["nbytes"] / t,
                      lay["nbytes"] / tc))
    codec.close()
    dec = sum(r[1] for r in rates) / sum(r[1] / r[3] for r in rates)
    dec_crc = sum(r[1] for r in rates) / sum(r[1] / r[4] for r in rates)
    print(f"\n== real-dims trunk: {raw_bytes / 1e9:.3f} GB raw -> {stored / 1e9:.3f} GB "
          f"stored = {stored / raw_bytes:.4f} of raw (target <= 0.78)")
    print(table([[L, f"{nb / 1e6:.0f}", f"{st / nb:.4f}", f"{r / 1e9:.2f}", f"{rc / 1e9:.2f}"]
                 for L, nb, st, r, rc in rates],
                ["layer", "raw MB", "stored / raw", "decode GB/s, 2 threads",
                 "with CRC (first read)"]))
    print(f"decode (all layers, 2 threads) {dec / 1e9:.2f} GB/s of output ({dec_crc / 1e9:.2f} "
          f"with the CRC) vs O_DIRECT sequential read of trunk.bin {seq / 1e9:.2f} GB/s = "
          f"{dec / seq:.2f}x ({dec_crc / seq:.2f}x) (target >= 2x); compressed bytes arrive "
          f"at {seq / (stored / raw_bytes) / 1e9:.2f} GB/s of output")
    return {"fraction": stored / raw_bytes, "decode_bps": dec, "seq_bps": seq}


def _disk_stat(path: Path):
    """(requests, sectors) read so far by the block device holding ``path``, or None."""
    st = os.stat(path)
    f = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
    if not f.exists():
        return None
    x = f.read_text().split()
    return int(x[0]), int(x[2])


def buffer_section(kz_pack: Path, rounds: int, piece: int = 4 << 20, depth: int = 4) -> None:
    """Direct reads of trunk.kz, ``depth`` pieces in flight, into two kinds of buffer."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    from libk3.io.direct import aligned_empty

    path = kz_pack / "trunk.kz"
    kinds = {"mmap.mmap(-1, n) (shared)":
             [memoryview(mmap.mmap(-1, piece)) for _ in range(depth + 2)],
             "aligned_empty (private, huge pages)":
             [memoryview(aligned_empty(piece)) for _ in range(depth + 2)]}
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    size = os.fstat(fd).st_size // piece * piece
    rows, rate = [], {k: [] for k in kinds}
    with ThreadPoolExecutor(max_workers=depth) as pool:
        for r in range(rounds):
            for name, bufs in kinds.items():
                s0, t0, flight = _disk_stat(path), time.perf_counter(), {}
                for k, off in enumerate(range(0, size, piece)):
                    if k - depth in flight:
                        flight.pop(k - depth).result()
                    flight[k] = pool.submit(os.preadv, fd, [bufs[k % len(bufs)]], off)
                for f in flight.values():
                    f.result()
                dt, s1 = time.perf_counter() - t0, _disk_stat(path)
                req = (f"{(s1[1] - s0[1]) * 512 / max(1, s1[0] - s0[0]) / 1024:.0f}"
                       if s0 and s1 else "-")
                rate[name].append(size / dt)
                rows.append([r + 1, name, f"{size / dt / 1e9:.2f}", req])
    os.close(fd)
    print(f"\n== direct reads of trunk.kz ({size / 1e9:.2f} GB), {piece >> 20} MiB pieces, "
          f"{depth} in flight")
    print(table(rows, ["round", "buffers", "GB/s", "mean request KiB"]))
    a, b = (float(np.median(v)) for v in rate.values())
    print(f"median: aligned_empty {b / 1e9:.2f} GB/s = {b / a:.2f}x the shared mapping's "
          f"{a / 1e9:.2f}")


def in_turn(items, r: int):
    """``items`` in order on even rounds, reversed on odd ones: which goes first
    alternates, so the disk's drift within a run hits both sides alike."""
    return items if r % 2 == 0 else items[::-1]


def per_round(num: list, den: list) -> str:
    """Each round's ratio num/den and their median, as printed (the target is judged on
    the median)."""
    ratios = np.array(num) / np.array(den)
    return (f"within each round: {' '.join(f'{x:.3f}' for x in ratios)}, median "
            f"{float(np.median(ratios)):.3f}x")


def stream_section(ck: Path, raw_pack: Path, kz_pack: Path, rounds: int, passes: int = 4) -> None:
    """The trunk streamer alone at the floor (one ring slot, no forward): every layer read
    (and decoded) ``passes`` times per round, raw and compressed alternating; the first
    pass (page faults, CRC) apart from the rest."""
    from libk3.io.direct import FileSet
    from libk3.stream.trunk import runs_from_pack
    from libk3.stream.trunk_modes import open_trunk

    rows, steady = [], {"raw": [], "compressed": []}
    with Checkpoint.open(ck) as c:
        slot = minimum_budget(ModelSizes.from_checkpoint(c)).trunk_bytes + 1
        for r in range(rounds):
            for name, pk_dir in in_turn((("raw", raw_pack), ("compressed", kz_pack)), r):
                pk = open_pack(pk_dir, c)
                ts = open_trunk(c.config, runs_from_pack(pk_dir, pk.manifest, pk.blocks),
                                slot, FileSet(use_direct=True))
                times = []
                for _ in range(passes):
                    t0 = time.perf_counter()
                    for L in range(len(ts.runs)):
                        ts.layer(L)
                        ts.release(L)
                    times.append(time.perf_counter() - t0)
                st = dict(ts.stats)
                ts.close()
                steady[name].append(float(np.median(times[1:])))
                rows.append([r + 1, name, f"{times[0]:.2f}", f"{steady[name][-1]:.2f}",
                             f"{st['bytes_read'] / 1e9:.2f}", f"{st['read_seconds']:.1f}",
                             f"{st['decode_seconds']:.1f}"])
    print(f"\n== trunk streamer alone at the floor (one slot, no forward), {passes} passes a round")
    print(table(rows, ["round", "pack", "first pass s", "later passes s (median)",
                       "GB read", "read s", "decode s"]))
    a, b = float(np.median(steady["raw"])), float(np.median(steady["compressed"]))
    print(f"median later pass: raw {a:.2f} s, compressed {b:.2f} s = {b / a:.3f}x; "
          f"{per_round(steady['compressed'], steady['raw'])}")


def run_section(ck: Path, raw_pack: Path, kz_pack: Path, rounds: int, gen: int) -> None:
    flags, reason = floor_flags(ck)
    rows, spt, ids = [], {"raw": [], "compressed": []}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, pk in in_turn((("raw", raw_pack), ("compressed", kz_pack)), r):
                rep = k3_run_report([ck, "--pack", pk, "--ids", "1,2,3,4", "--gen", gen, *flags],
                                    Path(tmp), f"{name}{r}")
                ids.setdefault(name, rep["generated_ids"])
                spt[name].append(rep["seconds_per_token"])
                rows.append([r + 1, name, f"{rep['seconds_per_token']:.3f}",
                             f"{rep['trunk_bytes_read'] / 1e9:.2f}",
                             f"{rep['trunk_read_seconds']:.1f}",
                             f"{rep['trunk_decode_seconds']:.1f}",
                             f"{rep['trunk_wait_seconds']:.1f}",
                             f"{rep['peak_rss_bytes'] / 1e9:.2f}"])
    print(f"\n== k3-run real-dims at the floor budget ({reason}), "
          f"--ids 1,2,3,4 --gen {gen}")
    print(table(rows, ["round", "pack", "s/token", "trunk GB read", "read s", "decode s",
                       "wait s", "peak RSS GB"]))
    a, b = float(np.median(spt["raw"])), float(np.median(spt["compressed"]))
    print(f"median s/token: raw {a:.3f}, compressed {b:.3f} = {b / a:.3f}x; compressed / raw "
          f"{per_round(spt['compressed'], spt['raw'])} (target <= 0.85x); same tokens: "
          f"{ids['raw'] == ids['compressed']}")


def floor_flags(ck: Path) -> tuple:
    """(k3-run flags of the floor budget, its reason) for checkpoint ``ck``."""
    with Checkpoint.open(ck) as c:
        sizes = ModelSizes.from_checkpoint(c)
    floor = minimum_budget(sizes)
    return (["--trunk-gb", f"{(floor.trunk_bytes + 1) / 1e9:.9f}", "--cache-gb",
             f"{sizes.expert_slot_bytes * (sizes.top_k + 1) / 1e9:.9f}"], floor.reasons[0])


def base_section(ck: Path, raw_pack: Path, base: str, rounds: int, gen: int) -> None:
    """k3-run at the floor on the raw pack: the tree at ``base`` vs this one, alternating
    which goes first."""
    from startup import base_tree, tool, tree_shim

    flags, _ = floor_flags(ck)
    args = [ck, "--pack", raw_pack, "--ids", "1,2,3,4", "--gen", gen, *flags]
    trees = {"base": base_tree(base),
             "this tree": tree_shim(ROOT, DATA / "startup-head")}
    spt = {name: [] for name in trees}
    rows, ids = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name in in_turn(list(trees), r):
                _, rep_ = tool(trees[name], "k3-run", args, Path(tmp) / f"{name}{r}.json")
                ids.setdefault(name, rep_["generated_ids"])
                spt[name].append(rep_["seconds_per_token"])
                rows.append([r + 1, name, f"{rep_['seconds_per_token']:.3f}",
                             f"{rep_['trunk_read_seconds']:.1f}",
                             f"{rep_['trunk_wait_seconds']:.1f}",
                             f"{rep_['peak_rss_bytes'] / 1e9:.3f}"])
    print(f"\n== k3-run real-dims at the floor, raw pack: {base} vs this tree, --gen {gen}")
    print(table(rows, ["round", "tree", "s/token", "read s", "wait s", "peak RSS GB"]))
    print(f"this tree / base {per_round(spt['this tree'], spt['base'])}; same tokens: "
          f"{ids['base'] == ids['this tree']}")


SECTIONS = ("codec", "pack", "buffers", "stream", "run", "base")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="keep the compressed pack")
    ap.add_argument("--skip-run", action="store_true")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"which of {','.join(SECTIONS)} to run (base needs --base)")
    ap.add_argument("--base", help="also run k3-run at the floor from the tree at this "
                                   "revision against this one (raw pack)")
    args = ap.parse_args()
    want = set(args.sections.split(","))
    if want - set(SECTIONS):
        ap.error(f"--sections: unknown {sorted(want - set(SECTIONS))}")
    if args.skip_run:
        want.discard("run")
    ck = checkpoint("real-dims")
    raw_pack = packed("real-dims")
    kz = DATA / "real-dims.kz.pack"
    if not (kz / "trunk.kz").exists():
        shutil.rmtree(kz, ignore_errors=True)
        shutil.copytree(raw_pack, kz)
        t0 = time.perf_counter()
        run(["k3-pack", "compress", kz, "--quiet"])
        print(f"[setup] k3-pack compress: {time.perf_counter() - t0:.1f} s", flush=True)
    if "codec" in want:
        name, raw = sample_tensor(ck)
        codec_section(raw, name)
        derived = mxfp4_derived()
        if derived is None:
            print("\n== mxfp4-derived: the conformance data is not present; skipped")
        else:
            codec_section(derived, "BF16 drawn from the released MXFP4 sample (64 draws)")
    if "pack" in want:
        pack_section(raw_pack, kz)
    if "buffers" in want:
        buffer_section(kz, args.rounds)
    if "stream" in want:
        stream_section(ck, raw_pack, kz, args.rounds)
    if "run" in want:
        run_section(ck, raw_pack, kz, args.rounds, args.gen)
    if args.base and "base" in want:
        base_section(ck, raw_pack, args.base, args.rounds, args.gen)
    if not args.keep:
        shutil.rmtree(kz)


if __name__ == "__main__":
    main()
