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
