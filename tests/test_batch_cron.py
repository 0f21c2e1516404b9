"""Cron-safe batch runs: one run per results file (an OS lock that dies with its process),
--wait, --max-prompts and --deadline; every id exactly once in the end (issue: cron)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from libk3.run import batch_run, runner
from libk3.io.filelock import FileLock, holder_pid
from .scripts import k3, k3_here


def start_k3(*args):
    return subprocess.Popen(["k3-run", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def write_batch(path, n, gen=3):
    path.write_text("".join(json.dumps({"id": f"p{i}", "ids": [1 + i, 2, 3], "gen": gen}) + "\n"
                            for i in range(n)))
    return path


def result_ids(path):
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def wait_for(cond, timeout=120.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.02)


def locked_by(path):
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        return holder_pid(fd)
    finally:
        os.close(fd)


HOLDER = ("import fcntl, os, sys, time\n"
          "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
          "fcntl.flock(fd, fcntl.LOCK_EX)\n"
          "print('locked', flush=True)\n"
          "time.sleep(float(sys.argv[2]))\n")


def hold_lock(path, seconds):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), str(seconds)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_filelock_names_holder_and_refuses_second_taker(tmp_path):
    """Catches a lock that is advisory only in name (a second taker gets it) or a busy
    message that cannot tell the user which process to look at."""
    r = tmp_path / "r.jsonl"
    holder = hold_lock(r, 60)
    try:
        assert locked_by(r) == holder.pid
        with pytest.raises(Exception) as e:
            FileLock(r).acquire()
        assert e.value.exit_code == 6 and f"pid {holder.pid}" in str(e.value)
        assert str(r) in str(e.value)
    finally:
        holder.kill()
        holder.wait()
    lock = FileLock(r)                  # control: the dead holder's lock is gone with it
    assert lock.acquire() is True
    lock.release()


def test_batch_second_run_on_same_results_exits_6_naming_holder(tiny_dir, tmp_path):
    """Catches two runs on one results file both running every prompt (every id twice)."""
    batch, r = write_batch(tmp_path / "b.jsonl", 3), tmp_path / "r.jsonl"
    holder = hold_lock(r, 120)
    try:
        t0 = time.monotonic()
        p = k3_here(tiny_dir, "--batch", batch, "--out", r)
        took = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    assert p.returncode == 6, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and str(r) in lines[0] and f"pid {holder.pid}" in lines[0]
    assert "Traceback" not in p.stderr and r.read_text() == ""
    assert took < 30                    # refused before opening the model, not after
    ok = k3_here(tiny_dir, "--batch", batch, "--out", r)     # control: free again
    assert ok.returncode == 0, ok.stderr
    assert result_ids(r) == ["p0", "p1", "p2"]


def test_batch_wait_finishes_remainder_with_no_duplicate_id(tiny_dir, tmp_path):
    """Catches a waiting run that reads finished ids before the lock is free (it would redo
    what the holder finished after it started)."""
    batch, r = write_batch(tmp_path / "b.jsonl", 6, gen=40), tmp_path / "r.jsonl"
    a = start_k3(tiny_dir, "--batch", batch, "--out", r, "--max-prompts", 4)
    try:
        wait_for(lambda: locked_by(r) == a.pid)
        b = k3(tiny_dir, "--batch", batch, "--out", r, "--wait", "--json")
    finally:
        a_err = a.communicate(timeout=600)[1]
    assert a.returncode == 0, a_err
    assert b.returncode == 0, b.stderr
    assert f"locked by pid {a.pid}; waiting" in b.stderr
    summary = json.loads(b.stdout)
    assert (summary["done"], summary["skipped"]) == (2, 4)
    assert sorted(result_ids(r)) == [f"p{i}" for i in range(6)]


def test_batch_kill_9_leaves_no_stale_lock(tiny_dir, tmp_path):
    """Catches a lock file that outlives its process (cron would refuse forever)."""
    batch, r = write_batch(tmp_path / "b.jsonl", 12, gen=60), tmp_path / "r.jsonl"
    a = start_k3(tiny_dir, "--batch", batch, "--out", r)
    wait_for(lambda: r.exists() and r.read_text().count("\n") >= 1)
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    assert a.returncode == -signal.SIGKILL
    p = k3(tiny_dir, "--batch", batch, "--out", r, "--json")      # at once, no --wait
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["skipped"] >= 1
    assert sorted(result_ids(r)) == sorted(f"p{i}" for i in range(12))


def test_batch_max_prompts_then_rerun_completes(tiny_dir, tmp_path):
    """Catches --max-prompts counting skipped ids as done, or a summary that hides what is
    left."""
    batch, r = write_batch(tmp_path / "b.jsonl", 5), tmp_path / "r.jsonl"
    p = k3_here(tiny_dir, "--batch", batch, "--out", r, "--max-prompts", 2)
    assert p.returncode == 0, p.stderr
    assert "stopped at max-prompts, 3 left for the next run" in p.stderr
    assert result_ids(r) == ["p0", "p1"]
    p = k3_here(tiny_dir, "--batch", batch, "--out", r, "--max-prompts", 2, "--json")
    s = json.loads(p.stdout)
    assert (s["done"], s["skipped"], s["remaining"], s["stopped"]) == (2, 2, 1, "max-prompts")
    p = k3_here(tiny_dir, "--batch", batch, "--out", r, "--json")
    s = json.loads(p.stdout)
    assert (s["done"], s["skipped"], s["remaining"], s["stopped"]) == (1, 4, 0, None)
    assert result_ids(r) == [f"p{i}" for i in range(5)]


def test_batch_deadline_passed_at_start_runs_nothing(tiny_dir, tmp_path):
    """Catches a deadline that is only checked after the first prompt."""
    batch, r = write_batch(tmp_path / "b.jsonl", 3), tmp_path / "r.jsonl"
    p = k3_here(tiny_dir, "--batch", batch, "--out", r, "--deadline", "0.00001", "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert (s["done"], s["remaining"], s["stopped"]) == (0, 3, "deadline")
    assert r.read_text() == ""


class Clock:
    """Seconds that pass only in forward passes: 1 s each, 6 s each from the tenth on (the
    machine became busy), so prompts admitted at the first pace are still in flight at
    the deadline."""

    def __init__(self):
        self.t, self.passes = 0.0, 0

    def __call__(self):
        return self.t

    def tick(self):
        self.passes += 1
        self.t += 1.0 if self.passes < 10 else 6.0


@pytest.mark.parametrize("width", [None, 2])
def test_batch_deadline_abandons_prompt_in_flight_and_rerun_completes(tiny_dir, tmp_path,
                                                                       width, monkeypatch):
    """Catches a deadline that writes a half-generated result (or skips it forever, or, in
    lockstep, loses count of the prompts in flight): every prompt in flight is dropped,
    the next run redoes it, every id once, each result equal to an undisturbed run."""
    from libk3.model import forward as forward_mod
    batch, r = write_batch(tmp_path / "b.jsonl", 4, gen=8), tmp_path / "r.jsonl"
    opts = runner.RunOptions(model=str(tiny_dir), resident=True, batch_width=width)
    base = runner.settings_from(gen=8, temperature=0.0, top_p=1.0, seed=0)
    warn = [].append
    clock = Clock()
    real = forward_mod.Forward.run

    def timed(self, segments):
        clock.tick()
        return real(self, segments)
    monkeypatch.setattr(forward_mod.Forward, "run", timed)
    limits = batch_run.BatchLimits(deadline=30.0, clock=clock, started=0.0)
    s = batch_run.run_batch(opts, batch, r, base, warn, limits)
    assert s["stopped"] == "deadline" and 0 < s["done"] < 4 and s["cut_off"] > 0
    assert s["done"] + s["remaining"] == 4
    monkeypatch.setattr(forward_mod.Forward, "run", real)
    first = result_ids(r)
    assert sorted(first) == [f"p{i}" for i in range(s["done"])]
    s2 = batch_run.run_batch(opts, batch, r, base, warn)
    assert (s2["done"], s2["skipped"], s2["stopped"]) == (4 - len(first), len(first), None)
    ref = tmp_path / "ref.jsonl"
    batch_run.run_batch(opts, batch, ref, base, warn)
    gen_ids = lambda p: {json.loads(x)["id"]: json.loads(x)["generated_ids"]  # noqa: E731
                         for x in p.read_text().splitlines()}
    assert gen_ids(r) == gen_ids(ref)


def _documented_cron_line(prefix: str) -> str:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "batch.md").read_text()
    lines = [ln for ln in doc.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, f"docs/batch.md: one crontab line starting {prefix!r}"
    return lines[0]


CRON_PATH = "/usr/bin:/bin"             # what cron gives a job (Debian's and Vixie cron)


@pytest.mark.parametrize("prefix", ["*/10 * * * *", "0 * * * *"])
def test_documented_crontab_line_runs_under_cron_environment(tiny_dir, tmp_path, prefix):
    """Catches a documented crontab line that only works in an activated shell (the walk
    that found issue 30: `k3-run: not found` from cron): the documented line (docs/batch.md), with its
    placeholders filled in, run by sh under `env -i` with cron's PATH, finishes the batch."""
    line = _documented_cron_line(prefix)
    command = line.split(None, 5)[5]
    venv_bin = Path(sys.executable).parent
    if not (venv_bin / "k3-run").exists():
        pytest.skip("k3-run is not beside this interpreter")
    work = tmp_path / "data"
    work.mkdir()
    shared = tmp_path / "shared"
    shared.mkdir()
    write_batch(work / "q.jsonl", 3)
    write_batch(shared / "prompts.jsonl", 3)
    command = (command.replace("/opt/k3/.venv/bin/", f"{venv_bin}/")
               .replace("/data/k3", str(work)).replace("/shared/", f"{shared}/")
               .replace("--pack PACKDIR ", "").replace("MODEL", str(tiny_dir))
               .replace("--shard K/8", "--shard 1/1").replace("results.K.", "results.1."))
    assert "k3-run " in command and "/opt/" not in command
    p = subprocess.run(["env", "-i", f"PATH={CRON_PATH}", f"HOME={tmp_path}", "sh", "-c",
                        command], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (command, p.stdout, p.stderr)
    out = work / "q.out" if "q.out" in command else shared / "results.1.jsonl"
    assert sorted(result_ids(out)) == ["p0", "p1", "p2"]
    if "q.log" in command:
        log = (work / "q.log").read_text()
        assert "\r" not in log and log.splitlines()[-2].startswith("batch: 3 done"), log


def test_open_results_reads_a_large_results_file_a_line_at_a_time(tmp_path):
    """Catches the results file read and parsed whole before a rerun (20 MB of results
    then take several times that): every id is found and a torn last line dropped
    (control), with Python's peak near one line's size."""
    import tracemalloc
    from libk3.run import batch as batchfile
    out = tmp_path / "r.jsonl"
    row = {"line": 1, "prompt_ids": [1], "generated_ids": list(range(10_000))}
    with open(out, "w") as f:
        for i in range(400):
            f.write(json.dumps(dict(row, id=i)) + "\n")
        f.write('{"id": 400, "line": 1, "prompt_')                 # a crash tore it
    tracemalloc.start()
    done = batchfile.open_results(out)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert done == {str(i) for i in range(400)}
    assert out.read_bytes().endswith(b'"id": 399}\n')
    assert out.stat().st_size > 20 * 2 ** 20 and peak < 8 * 2 ** 20, peak
