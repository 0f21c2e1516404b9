"""Shared machinery of the hostile-input suite (tests/test_hostile_*.py).

Owns: running a tool in-process (click's CliRunner, exceptions not caught) or a library
call through the front ends' error wrapper, running a console script as a real process
with its peak RSS, and the one check every refused input must pass: a documented exit
code, exactly one stderr line naming the file (or option), no traceback.

A failed check says which category of defect it found, as ``HOSTILE[category]`` at the
start of the message, so a run of the suite can be tallied by category:

* ``traceback``  an exception escaped (or "Traceback" on stderr)
* ``exit0``      the bad input was accepted: exit 0 or a silently wrong result
* ``wrong-exit`` refused, but with an exit code other than the documented one
* ``message``    refused, but not as one stderr line naming the file or option
* ``data-lost``  user data was destroyed or a half-written file was left behind
* ``unbounded``  time or memory grew with a number read from the input
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
from typing import NamedTuple

import pytest

PEAK_RSS_LIMIT = 500 * 10**6          # every refused case stays under 0.5 GB
ADDRESS_SPACE_LIMIT = 6 << 30          # a runaway allocation fails instead of swapping


def fail(category: str, what: str):
    pytest.fail(f"HOSTILE[{category}] {what}", pytrace=False)


class Outcome(NamedTuple):
    code: int | None
    stderr: str
    stdout: str = ""
    exc: BaseException | None = None


class Unbounded(Exception):
    """Raised by ``time_limit`` in the main thread when a call runs too long."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Interrupt the enclosed Python code after ``seconds`` (work that grows with a number
    read from the input never returns on its own)."""
    def on_alarm(signum, frame):
        raise Unbounded(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def invoke(main, args, *, input=None, seconds: float = 60) -> Outcome:
    """Run a click command in-process as its console script would (exceptions escape)."""
    from click.testing import CliRunner

    try:
        with time_limit(seconds):
            r = CliRunner().invoke(main, [str(a) for a in args], input=input,
                                   catch_exceptions=False)
    except Exception as e:               # noqa: BLE001 (classified by the caller)
        return Outcome(None, "", "", e)
    return Outcome(r.exit_code, r.stderr, r.stdout)


def call(fn, *args, seconds: float = 30, **kwargs) -> Outcome:
    """Call a library function through the front ends' error wrapper (``handle_errors``),
    as a tool's callback would, capturing stderr and the exit code."""
    from k3cli.support import handle_errors

    err = io.StringIO()
    code = 0
    try:
        with time_limit(seconds), contextlib.redirect_stderr(err):
            handle_errors(fn)(*args, **kwargs)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception as e:               # noqa: BLE001 (classified by the caller)
        return Outcome(None, err.getvalue(), "", e)
    return Outcome(code, err.getvalue())


def check_refused(out: Outcome, code: int, *names: str) -> str:
    """The documented refusal: exit ``code``, one stderr line naming every ``names``."""
    if out.exc is not None:
        cat = "unbounded" if isinstance(out.exc, (Unbounded, MemoryError)) else "traceback"
        fail(cat, f"{type(out.exc).__name__}: {str(out.exc)[:300]}")
    if "Traceback" in out.stderr:
        fail("traceback", out.stderr[-300:])
    if out.code == 0:
        fail("exit0", f"accepted (exit 0); stdout {out.stdout[:200]!r}")
    if out.code != code:
        fail("wrong-exit", f"exit {out.code}, documented {code}: {out.stderr.strip()[:300]}")
    lines = out.stderr.rstrip("\n").split("\n")
    if len(lines) != 1 or not all(str(n) in lines[0] for n in names):
        fail("message", f"want one line naming {names}, got {out.stderr!r}"[:400])
    return lines[0]


def check_clean(out: Outcome, codes=(0,)) -> None:
    """Not refused badly: one of ``codes``, no traceback, at most one stderr line when the
    code is an error."""
    if out.exc is not None:
        cat = "unbounded" if isinstance(out.exc, (Unbounded, MemoryError)) else "traceback"
        fail(cat, f"{type(out.exc).__name__}: {str(out.exc)[:300]}")
    if "Traceback" in out.stderr:
        fail("traceback", out.stderr[-300:])
    if out.code not in codes:
        fail("wrong-exit", f"exit {out.code}, expected one of {codes}: {out.stderr[:300]}")
    if out.code and len(out.stderr.rstrip("\n").split("\n")) != 1:
        fail("message", f"not one line: {out.stderr!r}"[:400])


class Process(NamedTuple):
    code: int
    stdout: str
    stderr: str
    peak_rss: int                      # bytes (ru_maxrss of this child alone)


_SPAWNER = None


def run_script(args, *, timeout: float = 120, fsize: int | None = None,
               address_space: int = ADDRESS_SPACE_LIMIT, cwd=None, stdin=None,
               env=None) -> Process:
    """Run a console script as a real process; its own peak RSS comes from wait4's
    rusage (not shared with other children). ``fsize`` caps every file it writes (a full
    disk: writes past it fail with EFBIG, SIGXFSZ ignored); ``stdin``: the path of a file
    fed on its standard input.

    Why through a forkserver: a child's ru_maxrss includes the memory of the process it
    was forked from (Linux keeps the pre-exec high-water mark), and pytest grows past
    0.5 GB once the chat oracle (transformers) is loaded; the forkserver stays small."""
    global _SPAWNER
    if _SPAWNER is None:
        import multiprocessing
        _SPAWNER = multiprocessing.get_context("forkserver").Pool(1)
    return _SPAWNER.apply(_run_script_here, (args, timeout, fsize, address_space, cwd,
                                             None if stdin is None else str(stdin), env))


def _run_script_here(args, timeout, fsize, address_space, cwd, stdin, env) -> Process:
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard != resource.RLIM_INFINITY:
        address_space = min(address_space, hard)

    def limits():
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            open(os.devnull if stdin is None else stdin, "rb") as inp:
        p = subprocess.Popen([str(a) for a in args], stdout=out, stderr=err, cwd=cwd,
                             stdin=inp, env=env, preexec_fn=limits)
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Process(p.returncode, out.read().decode(errors="replace"),
                       err.read().decode(errors="replace"), usage.ru_maxrss * 1024)


def script(name: str) -> str:
    """The console script ``name`` of this environment (next to the interpreter)."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else name


def check_process_refused(p: Process, code: int, *names: str) -> str:
    """check_refused for a real process, plus the peak RSS bound."""
    if p.code < 0:
        fail("unbounded", f"killed by signal {-p.code} (time or address-space limit)")
    line = check_refused(Outcome(p.code, p.stderr, p.stdout), code, *names)
    if p.peak_rss > PEAK_RSS_LIMIT:
        fail("unbounded", f"peak RSS {p.peak_rss / 1e9:.2f} GB > 0.5 GB")
    return line
