"""What the server's newer request fields cost a request that uses none of them.

The server gained structured output, tool choice, logprobs, the sampling fields, ``n``,
the Anthropic endpoint and metrics; a plain request must not pay for them. This starts
``k3-run MODEL --resident --serve`` from this checkout (head) and from BASE (default
399d42c, the commit before any of that work), both at once on their own ports, and sends
each the same plain requests one at a time, alternating which server goes first round by
round: a chat completion, the same streamed, and a text completion, ``max_tokens``
TOKENS, greedy, no other field. Prints, per model and kind, the median latency of each
(request sent to response read whole) and head / base (target: within 3 %, <= 1.03),
and whether both answered the same tokens (exit 1 if not).

    python bench/serve_overhead.py [--base 399d42c] [--models tiny,small] [--rounds 30]
                                   [--tokens 16]

A resident run's forward is fast, so what the server does around it is as large a share
of a request as it gets. Generates scratch/small on first use; BASE is extracted into
scratch/serve-base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (DATA, ROOT, base_tree, checkpoint, free_port, table,  # noqa: E402
                    tree_shim, wait_for_health)

LAUNCH = "import sys; from k3_run.cli import main; sys.argv[0] = 'k3-run'; main()"
MESSAGES = [{"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France, and why?"}]
PROMPT = "The quick brown fox jumps over the lazy dog. Then it"
KINDS = ("chat", "chat streamed", "completion")


def start(shim: Path, model: Path, log: Path):
    """A resident server from the tree at ``shim``; (process, url) once /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, str(model), "--resident", "--serve",
                             f"127.0.0.1:{port}", "--quiet"],
                            env=dict(os.environ, PYTHONPATH=str(shim)), cwd=shim,
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    wait_for_health(proc, url, log)
    return proc, url


def request(url: str, kind: str, tokens: int) -> tuple:
    """(seconds, the answer's text) of one plain request of ``kind``."""
    if kind == "completion":
        path, body = "/v1/completions", {"prompt": PROMPT}
    else:
        path, body = "/v1/chat/completions", {"messages": MESSAGES}
    body.update(max_tokens=tokens, temperature=0)
    streamed = kind == "chat streamed"
    if streamed:
        body["stream"] = True
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        raw = r.read()
    seconds = time.perf_counter() - t0
    if not streamed:
        choice = json.loads(raw)["choices"][0]
        return seconds, choice["text"] if kind == "completion" else choice["message"]["content"]
    text = ""
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                text += c.get("delta", {}).get("content") or ""
    return seconds, text


def measure(trees: dict, model: Path, rounds: int, tokens: int, tmp: Path) -> tuple:
    servers = {name: start(shim, model, tmp / f"{name}.log") for name, shim in trees.items()}
    try:
        for name, (_, url) in servers.items():        # first requests: caches, first reads
            for kind in KINDS:
                request(url, kind, tokens)
        times = {(name, kind): [] for name in servers for kind in KINDS}
        texts = {(name, kind): set() for name in servers for kind in KINDS}
        names = list(servers)
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for kind in KINDS:
                for name in order:
                    s, text = request(servers[name][1], kind, tokens)
                    times[name, kind].append(s)
                    texts[name, kind].add(text)
    finally:
        for proc, _ in servers.values():
            proc.kill()
            proc.wait()
    return times, texts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="399d42c")
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    trees = {"base": base_tree(args.base, "serve-base"),
             "head": tree_shim(ROOT, DATA / "serve-head")}
    print(f"[{time.strftime('%Y-%m-%d %H:%M')}] {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}; base {args.base}; {args.rounds} rounds, "
          f"{args.tokens} tokens a request", flush=True)
    rows, same = [], True
    for name in args.models.split(","):
        model = ROOT / "fixtures" / "tiny" if name == "tiny" else checkpoint(name)
        tmp = DATA / "serve-overhead"
        tmp.mkdir(parents=True, exist_ok=True)
        times, texts = measure(trees, model, args.rounds, args.tokens, tmp)
        for kind in KINDS:
            b, h = (statistics.median(times[t, kind]) for t in ("base", "head"))
            ratios = [x / y for x, y in zip(times["head", kind], times["base", kind])]
            agree = texts["base", kind] == texts["head", kind] and len(texts["head", kind]) == 1
            same &= agree
            rows.append([name, kind, f"{b * 1000:.1f}", f"{h * 1000:.1f}", f"{h / b:.3f}",
                         f"{statistics.median(ratios):.3f}", "yes" if agree else "NO"])
        print(f"[{name} done]", flush=True)
    print(table(rows, ["model", "request", "base ms", "head ms", "head / base",
                       "median of paired ratios", "same text"]))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
