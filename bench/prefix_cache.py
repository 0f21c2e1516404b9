"""The prefix cache (formats/prefix-cache.md): what a shared or cached prefix saves.

Prints, side by side in one run (arms interleaved round by round, medians of --rounds):

1. ``k3-run --batch`` on ``medium`` at the floor budget: LINES lines that share one
   PREAMBLE-token preamble (ids) and each end in a distinct TAIL-token tail, GEN tokens
   each. Arms: (a) ``--no-prefix-sharing`` (every line prefilled whole); (b) the default,
   the shared prefix prefilled once within the run; (c0) (b) with ``--prefix-cache DIR``
   on an empty DIR (fills it); (c) a second run on that DIR (warm). Prefill seconds of an
   arm = the sum of its lines' ``prefill_seconds`` + ``prefixes.build_seconds``; for (c)
   also the snapshot loads, which neither figure holds (the loads happen before a line's
   prefill starts): the hits the run reports times ``State.load`` of the snapshot timed
   here. Ratios (b)/(a) and (c)/(a), target <= 0.15, and whether every arm generated the
   same ids for every line (exit 1 if not). The lines run one at a time
   (``--batch-width 1``, by default): in lockstep the lines' prefills share passes, so
   summing the lines' prefill seconds would count a pass once per line in it. With fewer
   than 20 lines, the ratios are also projected to 20 lines from the measured parts.
   ``--baseline-lines N``: (a) runs the first N lines only, its figures scaled to all
   (each of its lines prefills the same length alone, so each costs the same); the other
   arms run every line.
2. ``k3-run --serve --prefix-cache DIR`` after a restart, same model and budget: a chat
   request (a SYSTEM-token system prompt + a user line, max_tokens 1) to a server started
   on an empty DIR (cold), then the server stopped (SIGINT) and started again on DIR, and
   a request with the same system prompt and another user line (warm). Seconds from
   sending the request to the whole 1-token response (server start-up not included),
   ratio warm / cold, target <= 0.1. Each round uses a fresh DIR and swaps the two user
   lines, so from 2 rounds on each request has a cold and a warm answer to compare.
3. Kimi K3, modelled: snapshot bytes of 2k / 20k / 100k-token prefixes (formats/state.md's
   arrays, ``libk3.model.state.array_layout`` on ``libk3.k3_dims.real_config()``), write
   and read seconds at this disk's rates measured here (a DISK_MB temporary file: buffered
   write + fsync, as ``State.save`` writes; O_DIRECT read, and buffered after dropping the
   file's pages with posix_fadvise, as ``State.load`` reads), ``State.save`` /
   ``State.load`` timed on a real-config 2k-token state (checksum and finiteness checks
   included) and scaled by bytes, beside the prefill seconds a snapshot saves at an
   ASSUMED K3 prefill rate (bench/README.md has no measured K3 prefill figure: the rate is
   derived from its figures and printed with its derivation).

    python bench/prefix_cache.py [--rounds 2] [--lines 20] [--baseline-lines N]
                                 [--sections 1,2,3] [--quick]

``--quick``: a smoke version on ``small`` (4 lines, 192-token preamble, 300-token system
prompt, 1 round, 256 MB disk probe). Generates scratch/medium (~5 GB) and its pack on
first use; everything else goes to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_throughput import floor_flags  # noqa: E402
from common import (checkpoint, drop_page_cache, free_port, packed, run, table,  # noqa: E402
                    wait_for_health)

from libk3.config import load_config  # noqa: E402
from libk3.engine.defaults import PREFILL_CHUNK  # noqa: E402
from libk3.k3_dims import EXPERT_BYTES, REAL, real_config  # noqa: E402
from libk3.model.state import State, array_layout, read_meta  # noqa: E402

TARGET_BATCH, TARGET_TTFT, SPEC_LINES = 0.15, 0.1, 20
med = statistics.median


# ---------------------------------------------------------------------------- section 1
def batch_lines(n: int, preamble: int, tail: int, gen: int, vocab: int) -> list:
    """n lines: the same ``preamble`` ids, then ``tail`` ids of their own (the first one
    differs from line to line), ``gen`` tokens each."""
    m = min(vocab - 512, 30000)
    pre = [(37 * j + 11) % m + 5 for j in range(preamble)]
    return [json.dumps({"id": i, "ids": pre + [(1009 * i + 13 * j + 1) % m + 5
                                               for j in range(tail)], "gen": gen})
            for i in range(n)]


def load_seconds(cfg, directory: Path, reps: int = 3) -> tuple:
    """(median seconds of State.load, bytes) of the largest snapshot in ``directory``,
    its pages dropped before each load (what a later run meets on disk)."""
    snaps = sorted(directory.glob("*.k3state"), key=lambda p: p.stat().st_size)
    if not snaps:
        return 0.0, 0
    path = snaps[-1]
    ident = read_meta(path)["weights"]
    got = []
    for _ in range(reps):
        drop_page_cache(path)
        t0 = time.perf_counter()
        State.load(cfg, path, ident)
        got.append(time.perf_counter() - t0)
    return med(got), path.stat().st_size


def batch_section(ckpt, pack, budget, args, tmp: Path) -> bool:
    cfg = load_config(ckpt)
    batch, batch_a = tmp / "batch.jsonl", tmp / "batch-a.jsonl"
    lines = batch_lines(args.lines, args.preamble, args.tail, args.gen, cfg.vocab_size)
    batch.write_text("\n".join(lines) + "\n")
    n_a = min(args.baseline_lines or args.lines, args.lines)
    batch_a.write_text("\n".join(lines[:n_a]) + "\n")   # (a)'s lines, scaled to all
    arms = [("a", "(a) --no-prefix-sharing"), ("b", "(b) sharing within the run"),
            ("c0", "(c0) sharing + --prefix-cache, empty DIR"),
            ("c", "(c) --prefix-cache DIR, warm")]
    got = {k: [] for k, _ in arms}
    outputs = {}
    for r in range(args.rounds):
        cache_dir = tmp / f"prefix-cache-{r}"
        order = [k for k, _ in arms]
        if r % 2:                                   # (c0) must come before (c)
            order = ["c0", "c", "b", "a"]
        for arm in order:
            out = tmp / f"out-{arm}-{r}.jsonl"
            extra = {"a": ["--no-prefix-sharing"], "b": [],
                     "c0": ["--prefix-cache", cache_dir], "c": ["--prefix-cache", cache_dir]}
            t0 = time.perf_counter()
            p = run(["k3-run", ckpt, "--pack", pack, *budget, "--batch",
                     batch_a if arm == "a" else batch, "--out", out,
                     "--batch-width", args.batch_width, "--json", "--quiet", *extra[arm]])
            wall = time.perf_counter() - t0
            s = json.loads(p.stdout)
            want = n_a if arm == "a" else args.lines
            assert s["done"] == want, f"arm {arm}: {s['done']} of {want} lines"
            # (a) prefills each line whole, alone: every line costs the same, so its first
            # n_a lines scale to all of them
            scale = args.lines / n_a if arm == "a" else 1.0
            pre = s["prefixes"]
            lines_prefill = sum(x["prefill_seconds"] for x in s["prompts"])
            fed = sum(x["prompt_tokens"] - x["reused_tokens"] for x in s["prompts"])
            hits = (pre.get("cache") or {}).get("hits", 0)
            loads, snap = (load_seconds(cfg, cache_dir) if arm == "c" else (0.0, 0))
            row = {"lines": lines_prefill * scale, "build": pre["build_seconds"],
                   "loads": hits * loads, "load1": loads, "snap": snap, "hits": hits,
                   "tokens": round((fed + pre["prefix_tokens_built"]) * scale),
                   "wall": wall * scale,
                   "reused": pre["tokens_reused"], "writes": (pre.get("cache") or {})
                   .get("writes", 0)}
            row["total"] = row["lines"] + row["build"] + row["loads"]
            got[arm].append(row)
            outputs[(arm, r)] = {json.loads(x)["id"]: json.loads(x)["generated_ids"]
                                 for x in out.read_text().splitlines()}
            print(f"[round {r + 1} arm {arm}: prefill {row['total']:.1f} s "
                  f"(lines {row['lines']:.1f} + build {row['build']:.1f} + loads "
                  f"{row['loads']:.2f}), {row['tokens']} tokens prefilled, "
                  f"{hits} snapshot hits, run {wall:.0f} s]", flush=True)
    a = med([x["total"] for x in got["a"]])
    rows = []
    for arm, name in arms:
        xs = got[arm]
        t = med([x["total"] for x in xs])
        rows.append([name, f"{med([x['lines'] for x in xs]):.1f}",
                     f"{med([x['build'] for x in xs]):.1f}",
                     f"{med([x['loads'] for x in xs]):.2f}", f"{t:.1f}",
                     " ".join(f"{x['total']:.0f}" for x in xs), xs[0]["tokens"],
                     xs[0]["hits"], f"{med([x['wall'] for x in xs]):.0f}", f"{t / a:.3f}"])
    print(f"{args.lines} lines x ({args.preamble} shared + {args.tail} own) ids, gen "
          f"{args.gen}, --batch-width {args.batch_width}; prefill seconds, medians of "
          f"{args.rounds} round(s)" + (f"; (a) ran the first {n_a} lines, its figures "
                                       f"scaled by {args.lines}/{n_a}" if n_a < args.lines
                                       else "") + ":")
    print(table(rows, ["arm", "lines' prefill", "prefix build", "snapshot loads", "total",
                       "each round", "tokens prefilled", "cache hits", "run wall s",
                       "/ (a)"]))
    b, c = (med([x["total"] for x in got[k]]) for k in ("b", "c"))
    print(f"(b)/(a) = {b / a:.3f}, (c)/(a) = {c / a:.3f}   target <= {TARGET_BATCH}: "
          f"{'met' if b / a <= TARGET_BATCH else 'NOT met'} / "
          f"{'met' if c / a <= TARGET_BATCH else 'NOT met'}")
    c_row = got["c"][0]
    print(f"snapshot: {c_row['snap'] / 1e6:.1f} MB, State.load {c_row['load1'] * 1e3:.0f} ms "
          f"(pages dropped), loaded {c_row['hits']} times in the warm run")
    if args.lines != SPEC_LINES:
        n = SPEC_LINES
        per_a = a / args.lines
        b_build = med([x["build"] for x in got["b"]])
        b_line = med([x["lines"] for x in got["b"]]) / args.lines
        c_line = c / args.lines
        print(f"projected to {n} lines from these parts ((a) {per_a:.1f} s a line; (b) "
              f"build {b_build:.1f} s once + {b_line:.1f} s a line; (c) {c_line:.1f} s a "
              f"line): (b)/(a) = {(b_build + n * b_line) / (n * per_a):.3f}, (c)/(a) = "
              f"{c_line / per_a:.3f}")
    ref = outputs[("b", 0)]
    same = all(o == {i: ref[i] for i in o} for o in outputs.values())
    print(f"same outputs: {'yes' if same else 'no'} ({len(outputs)} runs x {len(ref)} ids)")
    return same


# ---------------------------------------------------------------------------- section 2
def start_server(ckpt, pack, budget, cache_dir: Path, log: Path):
    port = free_port()
    err = open(log, "a")
    proc = subprocess.Popen(["k3-run", str(ckpt), "--pack", str(pack), *budget, "--serve",
                             f"127.0.0.1:{port}", "--prefix-cache", str(cache_dir), "--gen",
                             "1", "--quiet"], stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    return proc, url, wait_for_health(proc, url, log, timeout=7200)


def stop_server(proc) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def chat(url, system: str, user: str) -> tuple:
    body = json.dumps({"messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": user}],
                       "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=7200) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t0, out


def health(url) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        return json.loads(r.read())


def system_text(ckpt, tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens in the model's tokenizer."""
    from libk3.text.tokenizer import K3Tokenizer
    tok = K3Tokenizer.from_dir(ckpt, vocab_size=load_config(ckpt).vocab_size)
    words = ("You are a careful assistant who answers questions about geography, history "
             "and languages. Keep answers short, name your sources and say when you are "
             "not sure.").split()
    text = lambda n: " ".join(words[i % len(words)] for i in range(n))  # noqa: E731
    lo, hi = 1, 4 * tokens
    while lo < hi:                                  # fewest words reaching ``tokens``
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if len(tok.encode(text(mid))) < tokens else (lo, mid)
    return text(lo)


USERS = ("What is the capital of France?", "What is the longest river in Asia?")


def serve_section(ckpt, pack, budget, args, tmp: Path) -> bool:
    system = system_text(ckpt, args.system)
    got = {"cold": [], "warm": []}
    answers = {}
    for r in range(args.rounds):
        cache_dir = tmp / f"serve-cache-{r}"
        log = tmp / f"serve-{r}.log"
        for phase, user in (("cold", USERS[r % 2]), ("warm", USERS[(r + 1) % 2])):
            proc, url, up = start_server(ckpt, pack, budget, cache_dir, log)
            try:
                secs, out = chat(url, system, user)
                turns = health(url)["turn_reuse"] or {}
            finally:
                stop_server(proc)
            k3 = out["k3"]
            disk = (turns.get("prefix_cache") or {})
            got[phase].append({"seconds": secs, "prompt": len(k3["prompt_ids"]),
                               "reused": k3["reused_tokens"], "up": up,
                               "disk_hits": turns.get("disk_hits", 0),
                               "entries": disk.get("entries", 0),
                               "bytes": disk.get("bytes", 0)})
            answers.setdefault(user, {})[phase] = k3["generated_ids"]
            print(f"[round {r + 1} {phase}: {secs:.2f} s, prompt {len(k3['prompt_ids'])} "
                  f"tokens, {k3['reused_tokens']} reused, server up in {up:.0f} s, "
                  f"DIR {disk.get('entries', 0)} snapshot(s) "
                  f"{disk.get('bytes', 0) / 1e6:.1f} MB]", flush=True)
    rows = []
    for phase in ("cold", "warm"):
        xs = got[phase]
        rows.append([phase, xs[0]["prompt"], xs[0]["reused"],
                     f"{med([x['seconds'] for x in xs]):.2f}",
                     " ".join(f"{x['seconds']:.2f}" for x in xs),
                     f"{med([x['up'] for x in xs]):.0f}"])
    cold, warm = (med([x["seconds"] for x in got[k]]) for k in ("cold", "warm"))
    print(f"system prompt ~{args.system} tokens, one user line, max_tokens 1; seconds from "
          f"sending the request to the whole response, medians of {args.rounds} round(s):")
    print(table(rows, ["server", "prompt tokens", "reused", "seconds", "each round",
                       "start-up s (not counted)"]))
    print(f"warm / cold = {warm / cold:.3f}   target <= {TARGET_TTFT}: "
          f"{'met' if warm / cold <= TARGET_TTFT else 'NOT met'}")
    pairs = [v for v in answers.values() if len(v) == 2]
    if pairs:
        same = all(v["cold"] == v["warm"] for v in pairs)
        print(f"same outputs cold vs warm: {'yes' if same else 'no'} ({len(pairs)} request(s))")
        return same
    print("same outputs cold vs warm: not checked (each request needs a cold and a warm "
          "answer: 2 rounds)")
    return True


# ---------------------------------------------------------------------------- section 3
# Bench/README.md figures the assumed Kimi K3 prefill rate is derived from (none of them is
# a K3 prefill measurement): the trunk streamed per pass at the floor ("Whole model at true
# widths": 108.8 GB per token), the compute of a w-token pass extrapolated from real-dims
# ("Drafting", Kimi K3 modelled: 9.9 / 15.6 / 28.7 / 53.0 s at w = 1 / 2 / 4 / 8), and the
# expert union of w tokens priced as w^0.75 tokens' worth (k3-doctor --draft, same section).
TRUNK_BYTES = 108.8e9
COMPUTE_W8, COMPUTE_PER_TOKEN = 53.0, (53.0 - 28.7) / 4


def disk_rates(tmp: Path, mb: int, rounds: int) -> dict:
    """Buffered write + fsync, O_DIRECT read, buffered read after dropping the file's
    pages, of an ``mb`` MB file; medians in bytes/s."""
    from libk3.io.direct import DirectFile, aligned_empty
    path = tmp / "disk-probe.bin"
    piece = np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8).tobytes()
    n = max(1, mb * 10 ** 6 // len(piece))
    size = n * len(piece)
    w, rd, rb = [], [], []
    buf = aligned_empty(64 << 20)
    for _ in range(rounds):
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(n):
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        w.append(size / (time.perf_counter() - t0))
        drop_page_cache(path)
        df = DirectFile(path)
        t0 = time.perf_counter()
        for off in range(0, size, 64 << 20):
            df.read_window(off, min(64 << 20, size - off), buf)
        rd.append(size / (time.perf_counter() - t0))
        direct = df.direct
        df.close()
        drop_page_cache(path)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            while f.readinto(memoryview(buf)):
                pass
        rb.append(size / (time.perf_counter() - t0))
        path.unlink()
    return {"size": size, "write": med(w), "read_direct": med(rd), "read_buffered": med(rb),
            "direct": direct}


def state_path_rates(tmp: Path, tokens: int, reps: int) -> dict:
    """State.save and State.load (pages dropped) of a real-config state of ``tokens``
    positions: bytes/s of the whole path (serialisation, sha256, finiteness checks)."""
    cfg = real_config()
    st = State(cfg, capacity=tokens)
    st.pos, st.ids = tokens, [1] * tokens
    st.logits = np.zeros(cfg.vocab_size, np.float32)
    path = tmp / "k3-real.k3state"
    save, load = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        st.save(path, "bench")
        save.append(time.perf_counter() - t0)
        drop_page_cache(path)
        t0 = time.perf_counter()
        State.load(cfg, path, "bench")
        load.append(time.perf_counter() - t0)
    size = path.stat().st_size
    path.unlink()
    del st
    return {"size": size, "save": size / med(save), "load": size / med(load)}


def k3_section(args, tmp: Path) -> None:
    cfg = real_config()
    disk = disk_rates(tmp, args.disk_mb, max(1, min(args.rounds, 3)))
    print(f"disk, {disk['size'] / 1e9:.2f} GB temporary file, medians of "
          f"{max(1, min(args.rounds, 3))}: buffered write + fsync "
          f"{disk['write'] / 1e9:.2f} GB/s, read "
          f"{'O_DIRECT' if disk['direct'] else 'buffered (no O_DIRECT here)'} "
          f"{disk['read_direct'] / 1e9:.2f} GB/s, buffered read after dropping its pages "
          f"(posix_fadvise) {disk['read_buffered'] / 1e9:.2f} GB/s", flush=True)
    sp = state_path_rates(tmp, 2000, 2)
    print(f"State.save / State.load of a real-config 2,000-token state "
          f"({sp['size'] / 1e9:.2f} GB): {sp['save'] / 1e9:.2f} / {sp['load'] / 1e9:.2f} "
          "GB/s (whole path: serialisation, sha256, finiteness checks)", flush=True)
    # the assumed prefill rate: one 64-token pass at the laptop floor
    w = PREFILL_CHUNK
    moe_layers = REAL["num_hidden_layers"] - REAL["first_k_dense_replace"]
    expert_bytes = w ** 0.75 * REAL["num_experts_per_token"] * EXPERT_BYTES * moe_layers
    io = (TRUNK_BYTES + expert_bytes) / disk["read_direct"]
    compute = COMPUTE_W8 + (w - 8) * COMPUTE_PER_TOKEN
    tps_overlap, tps_series = w / max(io, compute), w / (io + compute)
    print(f"ASSUMED Kimi K3 prefill at the floor (not measured; bench/README.md has no K3 "
          f"prefill figure): a {w}-token pass = trunk {TRUNK_BYTES / 1e9:.1f} GB + expert "
          f"union {expert_bytes / 1e9:.0f} GB ({w}^0.75 tokens' worth x "
          f"{REAL['num_experts_per_token']} x {EXPERT_BYTES / 1e6:.1f} MB x {moe_layers} "
          f"layers) at {disk['read_direct'] / 1e9:.2f} GB/s = {io:.0f} s of reads, compute "
          f"{compute:.0f} s ({COMPUTE_W8} s at w=8 + {COMPUTE_PER_TOKEN:.2f} s a token); "
          f"{tps_overlap:.3f} tokens/s overlapped, {tps_series:.3f} in series. The saving "
          f"below uses the faster, {tps_overlap:.3f} tokens/s.")
    rows = []
    for n in (2000, 20000, 100000):
        size = sum(4 * int(np.prod(s, dtype=np.int64)) for _, s in array_layout(cfg, n))
        saved = n / tps_overlap
        write, read = size / disk["write"], size / disk["read_direct"]
        save, load = size / sp["save"], size / sp["load"]
        rows.append([f"{n:,}", f"{size / 1e9:.2f}", f"{write:.1f}", f"{read:.1f}",
                     f"{save:.1f}", f"{load:.1f}", f"{saved / 3600:.1f} h",
                     f"{load / saved:.1e}", f"{n / load:,.0f}"])
    print(table(rows, ["prefix tokens", "snapshot GB", "write s (disk)", "read s (disk)",
                       "State.save s", "State.load s", "prefill saved", "load / saved",
                       "break-even tokens/s"]))
    print("State.save / State.load s: the 2,000-token rates above scaled by bytes; "
          "break-even: the prefill rate at which loading the snapshot costs as much as "
          "prefilling its tokens.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, help="default 2 (--quick: 1)")
    ap.add_argument("--quick", action="store_true", help="small smoke version (small model)")
    ap.add_argument("--preset", help="synthetic model (default medium; --quick: small)")
    ap.add_argument("--lines", type=int, help=f"batch lines (default {SPEC_LINES})")
    ap.add_argument("--preamble", type=int, help="shared ids (default 1000)")
    ap.add_argument("--tail", type=int, default=20, help="each line's own ids")
    ap.add_argument("--baseline-lines", type=int,
                    help="run arm (a) on the first N lines only and scale it to all "
                         "(default: all lines)")
    ap.add_argument("--gen", type=int, default=4)
    ap.add_argument("--batch-width", default="1",
                    help="--batch-width of the batch runs (default 1: see the docstring)")
    ap.add_argument("--system", type=int, help="system prompt tokens (default 2000)")
    ap.add_argument("--disk-mb", type=int, help="disk probe file (default 1024 MB)")
    ap.add_argument("--sections", default="1,2,3")
    args = ap.parse_args()
    q = args.quick
    args.preset = args.preset or ("small" if q else "medium")
    args.lines = args.lines or (4 if q else SPEC_LINES)
    args.preamble = args.preamble or (192 if q else 1000)
    args.system = args.system or (300 if q else 2000)
    args.disk_mb = args.disk_mb or (256 if q else 1024)
    args.rounds = args.rounds or (1 if q else 2)
    ok = True
    with tempfile.TemporaryDirectory(prefix="k3-prefix-bench-") as tmp:
        tmp = Path(tmp)
        if "1" in args.sections or "2" in args.sections:
            ckpt, pack = checkpoint(args.preset), packed(args.preset)
            budget = floor_flags(ckpt)
            print(f"{args.preset} at the floor budget ({' '.join(budget)})", flush=True)
        t0 = time.perf_counter()
        if "1" in args.sections:
            print("== 1. a batch whose lines share a preamble", flush=True)
            ok &= batch_section(ckpt, pack, budget, args, tmp)
            print(f"[section 1: {time.perf_counter() - t0:.0f} s]", flush=True)
        if "2" in args.sections:
            t1 = time.perf_counter()
            print("== 2. the server after a restart", flush=True)
            ok &= serve_section(ckpt, pack, budget, args, tmp)
            print(f"[section 2: {time.perf_counter() - t1:.0f} s]", flush=True)
        if "3" in args.sections:
            t1 = time.perf_counter()
            print("== 3. Kimi K3, modelled", flush=True)
            k3_section(args, tmp)
            print(f"[section 3: {time.perf_counter() - t1:.0f} s]", flush=True)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
