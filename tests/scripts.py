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
