"""Turn 2 of a chat through ``k3-run --serve``: prefill work when the server resumes turn
1's state, against the same conversation sent to a server that keeps no state
(``--reuse-gb 0``). Both servers run one after the other on loopback with the same model
and budgets; each first answers a one-token warm-up request (kernels, page cache), then
the first serves turn 1 and turn 2, the second turn 2 alone (the whole conversation
fresh: it keeps nothing, so turn 1 there would only cost time), and turn 2 is timed.

Prints the prompt tokens each server prefilled for turn 2 and the prefill seconds from
its log line, and their ratios (issue 14 asks for at most 0.3x on the medium model).

    python bench/turn_reuse.py [--preset medium] [--system-words 300] [--run-args ARGS]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import checkpoint  # noqa: E402


def start(model, log: Path, reuse_gb: str, run_args):
    err = open(log, "w")
    proc = subprocess.Popen(["k3-run", str(model), "--serve", "127.0.0.1:0", "--gen", "8",
                             "--reuse-gb", reuse_gb, *run_args], stderr=err,
                            stdout=subprocess.DEVNULL)
    while proc.poll() is None:
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text())
        if m:
            return proc, f"http://127.0.0.1:{m.group(1)}"
        time.sleep(0.5)
    raise SystemExit(log.read_text())


def chat(url, messages, max_tokens):
    body = json.dumps({"messages": messages, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def prefill_seconds(log: Path, requests: int) -> float:
    """Prefill seconds of the last request in a server log that must hold ``requests``
    request lines (the server logs a request before answering it)."""
    found = re.findall(r"^request: .*prefill ([0-9.]+) s", log.read_text(), re.M)
    assert len(found) == requests, f"{log}: {len(found)} request lines, not {requests}"
    return float(found[-1])


def serve_two_turns(model, reuse_gb, tmp: Path, system: str, run_args, reply=None):
    """Turn 2's response and prefill seconds, and turn 1's reply; turn 1 is run (and
    its reply taken) unless ``reply`` is given."""
    log = tmp / f"serve-{reuse_gb}.log"
    proc, url = start(model, log, reuse_gb, run_args)
    try:
        chat(url, [{"role": "user", "content": "Hi"}], 1)
        turn1 = [{"role": "system", "content": system},
                 {"role": "user", "content": "What is the capital of France?"}]
        requests = 2
        if reply is None:
            reply = chat(url, turn1, 8)["choices"][0]["message"]
            requests += 1
        r2 = chat(url, turn1 + [reply, {"role": "user", "content": "And of Italy?"}], 8)
        return r2, prefill_seconds(log, requests), reply
    finally:
        proc.terminate()
        proc.wait(timeout=300)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--run-args", default="--resident",
                    help="k3-run options of both servers (budgets), e.g. '--preset laptop'")
    args = ap.parse_args()
    run_args = args.run_args.split()
    model = checkpoint(args.preset)
    words = ("You are a careful assistant who answers questions about geography, "
             "history and languages. ").split()
    system = " ".join(words[i % len(words)] for i in range(args.system_words))
    with tempfile.TemporaryDirectory() as d:
        reuse, reuse_s, reply = serve_two_turns(model, "1", Path(d), system, run_args)
        fresh, fresh_s, _ = serve_two_turns(model, "0", Path(d), system, run_args, reply)
    assert reuse["k3"]["prompt_ids"] == fresh["k3"]["prompt_ids"]
    assert reuse["k3"]["generated_ids"] == fresh["k3"]["generated_ids"], "results differ"
    n = len(fresh["k3"]["prompt_ids"])
    fed = n - reuse["k3"]["reused_tokens"]
    print(f"model {args.preset} ({args.run_args}); turn 2 prompt {n} tokens; "
          "same generated ids: yes")
    print(f"{'':24}{'reuse':>10}{'fresh':>10}{'ratio':>8}")
    print(f"{'prefilled tokens':24}{fed:>10}{n - fresh['k3']['reused_tokens']:>10}"
          f"{fed / n:>8.3f}")
    print(f"{'prefill seconds':24}{reuse_s:>10.2f}{fresh_s:>10.2f}{reuse_s / fresh_s:>8.3f}")


if __name__ == "__main__":
    main()
