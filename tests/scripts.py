"""Running the console scripts from tests: one helper, so every end-to-end test starts a
tool the same way (captured text output, a timeout that turns a hang into a failure)."""

from __future__ import annotations

import subprocess

TIMEOUT = 600


def tool(name: str, *args, **kw) -> subprocess.CompletedProcess:
    """``name`` (a console script on PATH) with ``args`` as strings; keywords go to
    ``subprocess.run`` (cwd, input, env, ...)."""
    return subprocess.run([name, *map(str, args)], capture_output=True, text=True,
                          timeout=kw.pop("timeout", TIMEOUT), **kw)


def k3(*args, **kw) -> subprocess.CompletedProcess:
    """k3-run with ``args``."""
    return tool("k3-run", *args, **kw)


def k3pack(*args, **kw) -> subprocess.CompletedProcess:
    """k3-pack with ``args``."""
    return tool("k3-pack", *args, **kw)


def k3trace(*args, **kw) -> subprocess.CompletedProcess:
    """k3-trace with ``args``."""
    return tool("k3-trace", *args, **kw)


def k3_here(*args) -> subprocess.CompletedProcess:
    """k3-run with ``args`` in this process (click's CliRunner): the same front end and
    exit codes without a process start and numba's load, for runs that differ only in
    options read after start-up (not --threads, which must be set before numba loads)."""
    from click.testing import CliRunner
    from k3_run.cli import main

    argv = [str(a) for a in args]
    res = CliRunner().invoke(main, argv)
    return subprocess.CompletedProcess(["k3-run", *argv], res.exit_code, res.stdout,
                                       res.stderr)
