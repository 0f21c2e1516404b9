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


def k3_here(*args, input: str | None = None) -> subprocess.CompletedProcess:
    """k3-run with ``args`` in this process (click's CliRunner): the same front end and
    exit codes without a process start and numba's load, for runs that differ only in
    options read after start-up (not --threads, which must be set before numba loads);
    ``input``: the text on its stdin (not a terminal). An exception the front end lets
    through is raised here (a traceback, not an exit code)."""
    from k3_run.cli import main
    return _here("k3-run", main, args, input)


def k3pack_here(*args, input: str | None = None) -> subprocess.CompletedProcess:
    """k3-pack with ``args`` in this process, as ``k3_here``."""
    from k3_pack.cli import main
    return _here("k3-pack", main, args, input)


def _here(name: str, main, args, input) -> subprocess.CompletedProcess:
    from click.testing import CliRunner

    argv = [str(a) for a in args]
    res = CliRunner().invoke(main, argv, input=input)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception          # what the console script would print as a traceback
    return subprocess.CompletedProcess([name, *argv], res.exit_code, res.stdout, res.stderr)
