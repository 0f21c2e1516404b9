"""Progress where it is read (issue 30): a bar on a terminal, a plain line every
LOG_EVERY seconds in a pipe or log, nothing under --quiet; the summary always."""

from __future__ import annotations

import io
import subprocess

from libk3 import progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_log_gets_a_plain_line_per_interval_and_none_for_short_work():
    out, clock = io.StringIO(), Clock()
    bar = progress.bar(desc="pack", total=100, unit="B", stream=out, clock=clock)
    for _ in range(10):
        clock.t += 1.0
        bar.update(1)
    assert out.getvalue() == ""                         # short work: no line at all
    clock.t += progress.LOG_EVERY
    bar.set_postfix(tokens=7)
    bar.update(40)
    clock.t += progress.LOG_EVERY
    bar.update(50)
    lines = out.getvalue().split("\n")
    assert lines[-1] == "" and "\r" not in out.getvalue()
    assert lines[:2] == ["pack: 10 B of 100 B (10%), 40 s, tokens=7",
                         "pack: 100 B of 100 B (100%), 70 s, tokens=7"]


def test_terminal_gets_a_redrawn_bar_and_quiet_gets_nothing():
    tty = Tty()
    bar = progress.bar(desc="pack", total=3, stream=tty)
    bar.update(3)
    bar.close()
    assert "\r" in tty.getvalue()
    quiet = Tty()
    bar = progress.bar(desc="pack", total=3, stream=quiet, show=False)
    bar.update(3)
    bar.close()
    assert quiet.getvalue() == ""


def test_every_tool_takes_quiet():
    """Catches a tool (or subcommand) without --quiet."""
    commands = [["k3-run"], ["k3-doctor"], ["k3-pack", "synth"], ["k3-pack", "pack"],
                ["k3-pack", "compress"], ["k3-pack", "verify"], ["k3-trace", "record"],
                ["k3-trace", "replay"], ["k3-trace", "size"]]
    for cmd in commands:
        p = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (cmd, p.stderr)
        assert "--quiet" in p.stdout, cmd


def test_log_line_with_eta_gives_the_total_and_the_time_left():
    """Catches a batch's progress line without its total or ETA ('batch: 16 prompt, 31
    s, tokens=641'): done/total, the postfix, elapsed and the time left at the pace so
    far; control: before the first item the ETA is unknown, not a division by zero."""
    out, clock = io.StringIO(), Clock()
    bar = progress.bar(desc="batch", total=30, unit="prompts", stream=out, clock=clock,
                       eta=True)
    clock.t += progress.LOG_EVERY
    bar.set_postfix_str("0 tokens")
    clock.t += 1.0
    bar.set_postfix_str("641 tokens")
    bar.update(16)
    clock.t += progress.LOG_EVERY
    bar.update(0)
    assert out.getvalue().split("\n")[:2] == ["batch: 0/30 prompts, 0 tokens, 30 s, ETA ?",
                                              "batch: 16/30 prompts, 641 tokens, 61 s, ETA 53 s"]


def test_batch_progress_counts_against_the_prompts_this_run_means_to_run(tiny_dir, tmp_path,
                                                                         monkeypatch):
    """Catches a batch's progress total that counts lines already done, other shards'
    or past --max-prompts: 2 of 5 lines are done, --max-prompts 2 leaves 2 to run."""
    import json
    import re
    from .scripts import k3_here
    monkeypatch.setattr(progress, "LOG_EVERY", 0.0)
    batch, out = tmp_path / "b.jsonl", tmp_path / "r.jsonl"
    batch.write_text("".join(json.dumps({"id": i, "ids": [4, i + 1], "gen": 2}) + "\n"
                             for i in range(5)))
    first = k3_here(tiny_dir, "--batch", batch, "--out", out, "--max-prompts", 2)
    assert first.returncode == 0 and "/2 prompts" in first.stderr, first.stderr
    p = k3_here(tiny_dir, "--batch", batch, "--out", out, "--max-prompts", 2)
    lines = [ln for ln in p.stderr.splitlines() if re.match(r"batch: \d+/", ln)]
    assert lines and all("/2 prompts" in ln and " tokens, " in ln and "ETA" in ln
                         for ln in lines), p.stderr
    assert lines[-1].startswith("batch: 2/2 prompts, 4 tokens")
