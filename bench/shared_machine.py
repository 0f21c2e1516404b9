"""k3 on a shared machine (issue 30), side by side in one run: this tree against a BASE
commit (default: the last commit before threads that sleep), each run in a fresh process,
with and without another process busy on one core.

* ``load``: s/token of ``tiny``, ``small`` and ``medium`` (one prompt, 32 tokens), idle
  and with a single-threaded busy loop pinned to CPU 0 in its own session; this tree's
  idle time against BASE's idle time, and its loaded time against its own idle time
  (BASE loaded, 8 tokens, for the figure it replaces);
* ``layers``: this tree's s/token on ``tiny`` and ``small`` idle and loaded with each of
  numba's threading layers (``NUMBA_THREADING_LAYER=omp|tbb|workqueue``; tbb only where
  its library loads), the measurement behind the order ``machine/threads.py`` asks for;
* ``waits``: this tree's s/token on ``small`` idle and loaded with an idle thread that
  sleeps at once (``OMP_WAIT_POLICY=PASSIVE``), k3's short spin, and libgomp's default
  spin (``GOMP_SPINCOUNT=300000``), each given through the environment (which k3 keeps);
* ``two``: two ``k3-run small`` started together against one alone;
* ``serve``: median latency of 20 sequential chat requests to ``k3-run tiny --serve``,
  alone and while a ``--batch`` run of ``small`` works beside it;
* ``deadline``: ``small``, 30 prompts x 40 tokens, ``--deadline`` set to 1.3 times the
  time of a run of 10 of them: done, cut off and discarded tokens per tick, four ticks.

Every run starts from the environment without k3's thread settings (``OMP_WAIT_POLICY``,
``NUMBA_NUM_THREADS``, ``NUMBA_THREADING_LAYER*``), so each tree chooses its own.

    python bench/shared_machine.py [--base 94fed5d] [--rounds 3]
                                   [--sections load,layers,waits,two,serve,deadline]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (DATA, ROOT, base_tree, checkpoint, free_port, table, tool,  # noqa: E402
                    tree_shim, wait_for_health)

TINY = ROOT / "fixtures" / "tiny"
K3_ENV = ("OMP_WAIT_POLICY", "NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER",
          "NUMBA_THREADING_LAYER_PRIORITY")
ENV = {k: v for k, v in os.environ.items() if k not in K3_ENV}
LAUNCH = "import sys; from k3_run.cli import main; sys.argv[0] = 'k3-run'; main()"
PROMPT = "The quick brown fox jumps over the lazy dog"


@contextlib.contextmanager
def busy_core(cpu: int = 0):
    """A single-threaded busy loop pinned to ``cpu``, in its own session (as a separate
    login's process would be)."""
    p = subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"],
                         start_new_session=True)
    time.sleep(0.5)
    try:
        yield
    finally:
        p.kill()
        p.wait()


def model_of(preset: str) -> Path:
    return TINY if preset == "tiny" else checkpoint(preset)


def s_per_token(shim, args, tmp: Path, env=None) -> float:
    rep = tmp / "rep.json"
    _, out = tool(shim, "k3-run", args, rep, env=ENV if env is None else env)
    return out["seconds_per_token"]


def idle_and_loaded(shim, args, tmp, env, rounds) -> tuple:
    """Median s/token of ``rounds`` runs idle and as many beside a busy core, alternated."""
    idle, loaded = [], []
    for _ in range(rounds):
        idle.append(s_per_token(shim, args, tmp, env))
        with busy_core():
            loaded.append(s_per_token(shim, args, tmp, env))
    return statistics.median(idle), statistics.median(loaded)


def layer_env(layer: str) -> dict:
    """ENV choosing ``layer``; a TBB from PyPI (``pip install tbb``, not a k3 dependency)
    keeps its library in the venv's lib/, off the loader's path."""
    env = dict(ENV, NUMBA_THREADING_LAYER=layer)
    if layer == "tbb":
        env["LD_LIBRARY_PATH"] = ":".join(x for x in (str(Path(sys.prefix) / "lib"),
                                                     ENV.get("LD_LIBRARY_PATH")) if x)
    return env


def layer_loads(layer: str) -> bool:
    code = ("import numba, numpy as np\n@numba.njit(parallel=True)\ndef f(a):\n"
            "    s = 0.0\n    for i in numba.prange(a.size):\n        s += a[i]\n    return s\n"
            "f(np.ones(10)); print(numba.threading_layer())")
    p = subprocess.run([sys.executable, "-c", code], env=layer_env(layer),
                       capture_output=True, text=True)
    return p.returncode == 0 and p.stdout.strip() == layer


def layers_section(trees, rounds, tmp):
    rows = []
    for layer in ("omp", "tbb", "workqueue"):
        if not layer_loads(layer):
            rows.append([layer, "-", "-", "-", "-", "-", "-"])
            continue
        env = layer_env(layer)
        row = [layer]
        for preset in ("tiny", "small"):
            args = [model_of(preset), "--prompt", PROMPT, "--gen", "32"]
            i, b = idle_and_loaded(trees["head"], args, tmp, env, rounds)
            row += [f"{i:.4f}", f"{b:.4f}", f"{b / i:.2f}"]
        rows.append(row)
    print(table(rows, ["layer", "tiny idle", "tiny loaded", "ratio", "small idle",
                       "small loaded", "ratio"]))


def load_section(trees, presets, rounds, tmp):
    rows = []
    for preset in presets:
        args = [model_of(preset), "--prompt", PROMPT, "--gen", "32"]
        got = {k: [] for k in ("base idle", "head idle", "head loaded")}
        for _ in range(rounds):
            got["base idle"].append(s_per_token(trees["base"], args, tmp))
            got["head idle"].append(s_per_token(trees["head"], args, tmp))
            with busy_core():
                got["head loaded"].append(s_per_token(trees["head"], args, tmp))
        with busy_core():
            base_loaded = s_per_token(trees["base"], [*args[:-1], "8"], tmp)
        med = {k: statistics.median(v) for k, v in got.items()}
        rows.append([preset, f"{med['base idle']:.4f}", f"{med['head idle']:.4f}",
                     f"{med['head idle'] / med['base idle']:.3f}",
                     f"{med['head loaded']:.4f}", f"{med['head loaded'] / med['head idle']:.2f}",
                     f"{base_loaded:.4f}", f"{base_loaded / med['base idle']:.0f}"])
        print(f"  {preset}: " + ", ".join(f"{k} {[round(x, 4) for x in v]}"
                                          for k, v in got.items()), flush=True)
    print(table(rows, ["model", "base idle", "head idle", "head/base", "head loaded",
                       "loaded/idle", "base loaded", "base loaded/idle"]))


def waits_section(trees, rounds, tmp):
    args = [model_of("small"), "--prompt", PROMPT, "--gen", "32"]
    rows = []
    for label, extra in (("sleep at once (PASSIVE)", {"OMP_WAIT_POLICY": "PASSIVE"}),
                         ("k3: spin 100000, then sleep", {}),
                         ("libgomp default: spin 300000", {"GOMP_SPINCOUNT": "300000"})):
        i, b = idle_and_loaded(trees["head"], args, tmp, dict(ENV, **extra), rounds)
        rows.append([label, f"{i:.4f}", f"{b:.4f}", f"{b / i:.2f}"])
    print(table(rows, ["idle thread", "small idle", "small loaded", "ratio"]))


def two_section(trees, rounds, tmp):
    args = [model_of("small"), "--prompt", PROMPT, "--gen", "32"]
    alone, pair = [], []
    for r in range(rounds):
        alone.append(s_per_token(trees["head"], args, tmp))
        procs = []
        for i in range(2):
            rep = tmp / f"pair{i}.json"
            cmd = [sys.executable, "-c", LAUNCH, *map(str, args), "--report-json", str(rep)]
            procs.append((subprocess.Popen(cmd, env=dict(ENV, PYTHONPATH=str(trees["head"])),
                                           cwd=trees["head"], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL), rep))
        for p, rep in procs:
            assert p.wait() == 0, "a k3-run of the pair failed"
            pair.append(json.loads(rep.read_text())["seconds_per_token"])
    a, b = statistics.median(alone), statistics.median(pair)
    print(f"  alone {[round(x, 4) for x in alone]}, two at once {[round(x, 4) for x in pair]}")
    print(table([["small", f"{a:.4f}", f"{b:.4f}", f"{b / a:.2f}"]],
                ["model", "alone s/token", "each of two", "ratio"]))


def chat_latencies(port: int, n: int) -> list:
    body = json.dumps({"max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": PROMPT}]}).encode()
    out = []
    for _ in range(n):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as resp:
            resp.read()
        out.append(time.perf_counter() - t0)
    return out


def batch_file(path: Path, n: int, gen: int) -> Path:
    path.write_text("".join(json.dumps({"id": i, "prompt": f"{PROMPT} number {i}", "gen": gen})
                            + "\n" for i in range(n)))
    return path


def serve_section(trees, tmp):
    port = free_port()
    cmd = [sys.executable, "-c", LAUNCH, str(TINY), "--serve", f"127.0.0.1:{port}"]
    server = subprocess.Popen(cmd, env=dict(ENV, PYTHONPATH=str(trees["head"])),
                              cwd=trees["head"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_for_health(server, f"http://127.0.0.1:{port}")
        chat_latencies(port, 2)                     # warm
        quiet = chat_latencies(port, 20)
        batch = batch_file(tmp / "serve-batch.jsonl", 200, 40)
        bcmd = [sys.executable, "-c", LAUNCH, str(model_of("small")), "--batch", str(batch),
                "--out", str(tmp / "serve-batch.out")]
        worker = subprocess.Popen(bcmd, env=dict(ENV, PYTHONPATH=str(trees["head"])),
                                  cwd=trees["head"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        time.sleep(3.0)                             # its start-up done, decoding
        busy = chat_latencies(port, 20)
        alive = worker.poll() is None
        worker.kill()
        worker.wait()
    finally:
        server.kill()
        server.wait()
    a, b = statistics.median(quiet), statistics.median(busy)
    print(f"  the batch was still running at the end: {alive}")
    print(table([["tiny", f"{a * 1000:.0f}", f"{b * 1000:.0f}", f"{b / a:.2f}"]],
                ["model", "alone ms", "beside a --batch ms", "ratio"]))


def deadline_section(trees, tmp):
    small = model_of("small")
    batch = batch_file(tmp / "dl.jsonl", 30, 40)

    def tick(out: Path, minutes=None):
        args = [small, "--batch", batch, "--out", out, "--json"]
        if minutes is not None:
            args += ["--deadline", f"{minutes:.4f}"]
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", LAUNCH, *map(str, args)],
                           env=dict(ENV, PYTHONPATH=str(trees["head"])), cwd=trees["head"],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        return time.perf_counter() - t0, json.loads(p.stdout)

    third = batch_file(tmp / "dl-third.jsonl", 10, 40)
    args = [small, "--batch", third, "--out", tmp / "dl-third.out", "--json"]
    t0 = time.perf_counter()
    s = json.loads(subprocess.run([sys.executable, "-c", LAUNCH, *map(str, args)],
                                  env=dict(ENV, PYTHONPATH=str(trees["head"])),
                                  cwd=trees["head"], capture_output=True, text=True,
                                  check=True).stdout)
    whole = time.perf_counter() - t0
    minutes = whole * 1.3 / 60          # a third of the prompts, with room for the stretch
    print(f"  10 of the 30 prompts in one run: {whole:.1f} s ({s['seconds']:.1f} s of batch, "
          f"width {s['width']}); deadline {minutes * 60:.1f} s")
    out, rows, generated = tmp / "dl.out", [], 0
    for i in range(4):
        wall, s = tick(out, minutes)
        generated += s["generated_tokens"]
        rows.append([i + 1, f"{wall:.1f}", s["done"], s["cut_off"], s["discarded_tokens"],
                     s["remaining"], s["max_in_flight"]])
    lines = out.read_text().splitlines()
    print(table(rows, ["tick", "wall s", "done", "cut off", "discarded tokens", "left",
                       "max in flight"]))
    print(f"  after four ticks: {len(lines)} of 30 prompts done; tokens generated "
          f"{generated} for {sum(len(json.loads(x)['generated_ids']) for x in lines)} kept")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="94fed5d")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--presets", default="tiny,small,medium")
    ap.add_argument("--sections", default="load,layers,waits,two,serve,deadline")
    a = ap.parse_args()
    trees = {"base": base_tree(a.base, "shared-base"), "head": tree_shim(ROOT, DATA / "shared-head")}
    sections = a.sections.split(",")
    print(f"[{time.strftime('%Y-%m-%d %H:%M')}] {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}; base {a.base}")
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        if "load" in sections:
            print("== load: s/token idle and beside a busy loop on CPU 0", flush=True)
            load_section(trees, a.presets.split(","), a.rounds, tmp)
        if "layers" in sections:
            print("== threading layers, idle and beside a busy loop", flush=True)
            layers_section(trees, a.rounds, tmp)
        if "waits" in sections:
            print("== how an idle team thread waits (small)", flush=True)
            waits_section(trees, a.rounds, tmp)
        if "two" in sections:
            print("== two k3-run at once", flush=True)
            two_section(trees, a.rounds, tmp)
        if "serve" in sections:
            print("== server latency beside a batch run", flush=True)
            serve_section(trees, tmp)
        if "deadline" in sections:
            print("== --deadline ticks", flush=True)
            deadline_section(trees, tmp)


if __name__ == "__main__":
    main()
