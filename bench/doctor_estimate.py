"""Benchmark: k3-doctor's s/token estimate against a measured k3-run (issue 6, target 30 %).

What it does:
1. Runs the doctor (disk and kernel measurements included) on MODEL and takes the preset
   it picks (or --preset) and its estimated seconds per decoded token.
2. If k3-run accepts ``--preset`` (budgets, issue 5), runs
   ``k3-run MODEL [--pack PACK] --preset NAME --ids ... --gen N --json`` and reads the
   measured decode ``seconds_per_token`` from its report; prints both, their ratio, and
   whether they agree within 30 %. Until then it prints the estimate and says plainly
   that the measurement is PENDING.

Intended input: the ``medium`` synthetic checkpoint (~5 GB; never inside the repo):

    k3-pack synth --preset medium /data/k3-medium
    k3-pack /data/k3-medium /data/k3-medium-pack
    python bench/doctor_estimate.py /data/k3-medium --pack /data/k3-medium-pack

On medium the laptop preset pins the whole 1.0 GB trunk and caches 238 of 2,304
experts, so the comparison exercises the expert-read path. Read the result against the
noise floor: single runs of the C engine spread 33 % (its published measurements), so use --gen >= 16.
The estimate is for the steady state; after an 8-token prompt the decode still fills a
cold expert cache (measured 0.120 s/token against 0.108 after a 64-token prompt), so the
default prompt is 64 tokens.
The doctor's hit rate assumes uniform routing; a measured run that beats the estimate
by a wide margin usually means routing is skewed (more hits), not that I/O got faster.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys


def k3_run_supports_presets() -> bool:
    exe = shutil.which("k3-run")
    if exe is None:
        return False
    res = subprocess.run([exe, "--help"], capture_output=True, text=True)
    return "--preset" in res.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="checkpoint directory (the medium synthetic one)")
    ap.add_argument("--pack", help="its pack directory")
    ap.add_argument("--preset", help="compare at this preset instead of the doctor's pick")
    ap.add_argument("--gen", type=int, default=16, help="tokens k3-run decodes")
    ap.add_argument("--ids", default=",".join(str((37 * i + 11) % 30000 + 5) for i in range(64)),
                    help="prompt token ids for k3-run (default: 64 tokens, whose chunked "
                         "prefill warms the expert cache, so decode is in the steady state "
                         "the estimate describes)")
    ap.add_argument("--assume-memory-gb", type=float, help="simulate a smaller machine")
    ap.add_argument("--probe-size-mb", type=float, default=1000.0)
    args = ap.parse_args(argv)

    from libk3.machine import memory as hwprobe
    from libk3.doctor import report as doctor

    mem = hwprobe.probe_memory(None if args.assume_memory_gb is None
                               else int(args.assume_memory_gb * 1e9))
    diag = doctor.diagnose(args.model, args.pack, memory=mem,
                           disk=doctor.DiskProbe(probe_bytes=int(args.probe_size_mb * 1e6)),
                           progress=True)
    dec = diag.report["decision"]
    preset = args.preset or dec["pick"]
    if preset is None:
        print("the doctor finds no preset that fits: " + "; ".join(diag.report["problems"]))
        return 1
    est = dec["presets"][preset]["estimate"]
    if est is None:
        print("no estimate (disk or kernels not measured); see k3-doctor's report")
        return 1
    kern = diag.report["kernels"]["source"]
    print(f"preset {preset}: doctor estimate {est['seconds_per_token']:.3f} s/token "
          f"(trunk I/O {est['trunk_io_s']:.3f} s, expert I/O {est['expert_io_s']:.3f} s, "
          f"compute {est['compute_s']:.3f} s; hit rate {est['expert_hit_rate']:.1%}, "
          f"kernels: {kern})")
    if not k3_run_supports_presets():
        print("k3-run measurement: PENDING (k3-run does not accept --preset yet; rerun this "
              "script once issue 5 lands)")
        return 0
    cmd = ["k3-run", args.model, "--preset", preset, "--ids", args.ids,
           "--gen", str(args.gen), "--json"]
    if args.pack:
        cmd[2:2] = ["--pack", args.pack]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        print(f"k3-run failed ({res.returncode}): {res.stderr.strip()[-500:]}")
        return 1
    measured = json.loads(res.stdout)["seconds_per_token"]
    ratio = est["seconds_per_token"] / measured if measured else float("inf")
    verdict = "within" if 1 / 1.3 <= ratio <= 1.3 else "OUTSIDE"
    print(f"k3-run measured {measured:.3f} s/token at preset {preset}; estimate/measured = "
          f"{ratio:.2f} ({verdict} the 30 % target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
