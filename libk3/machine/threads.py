"""The kernels' thread team: set up before numba loads, and what numba then runs with.

Owns: the environment numba and its OpenMP runtime read once, when they load: the team
size (``NUMBA_NUM_THREADS``: ``--threads``, else the CPUs this process may use,
``cpus.allowance``), how long an idle thread of the team spins before it sleeps
(``GOMP_SPINCOUNT``) and the order numba tries its threading layers in (OpenMP first);
a value the user put in the environment is kept. Then, while a tool runs, ``fit``: the
share of that team the kernels use, from what other processes take of our CPUs. Also
``in_force``: what numba actually runs with, for reports. Does not own: which kernel
calls use the whole team (``libk3.kernels.team``).

Why both: a parallel region waits for its slowest thread. When another process holds one
of our cores, a team thread there is descheduled for whole time slices and a token took
a hundred times longer (libgomp's default spin makes it worse: the spinning thread has
used its share by the time it is needed). So every ``FIT_EVERY`` seconds of forward
passes ``fit`` compares /proc/stat with our own CPU time and runs the kernels on as many
threads as there are CPUs nobody else keeps busy, back up when they are free again.
On a free machine a parallel region must be cheap: an idle thread spins briefly
(``SPIN_COUNT``) before it sleeps, since waking a sleeping thread costs tens of
microseconds (a wake-up of an idle virtual CPU more), and a token runs hundreds of
regions. Small kernel calls run on the calling thread alone (``libk3.kernels.team``).
The figures, and why OpenMP rather than TBB or numba's workqueue: bench/README.md
"Shared machines". The team's size never changes a result.

Call ``prepare`` before anything imports numba (each tool does it first thing); later,
only the team size can still change.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from . import cpus

SPIN_COUNT = 100_000             # libgomp's spins before an idle thread sleeps (its default: 300,000)
FIT_EVERY = 0.25                 # seconds between two looks at the machine's load
# numba's layers in the order to try: OpenMP where it loads, else TBB, else numba's own
LAYERS = "omp tbb workqueue"
_ENV_COUNT, _ENV_WAIT, _ENV_SPIN = "NUMBA_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"
_ENV_LAYER, _ENV_ORDER = "NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY"


# The user's own values, read when this module is first imported (a tool imports it
# before it writes any of them), so a second ``prepare`` does not take k3's writes as theirs.
_USER = {name: os.environ.get(name) or None
         for name in (_ENV_COUNT, _ENV_WAIT, _ENV_SPIN, _ENV_LAYER, _ENV_ORDER)}


@dataclasses.dataclass(frozen=True)
class Team:
    """The team a process runs its kernels with, and where each choice came from."""

    threads: int
    threads_from: str
    wait_policy: str
    wait_from: str
    layer: str          # the layer asked for, or the order they are tried in
    layer_from: str
    late: bool          # numba was loaded already: only the team size could be set

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def prepare(requested: int | None = None, *, environ=None, user=None, allowance=None) -> Team:
    """Set the team up for this process: ``requested`` threads (``--threads``), else the
    user's ``NUMBA_NUM_THREADS``, else ``allowance.count``; the wait policy and the layer
    unless the user chose them. May be called again (a tool's entry, then its
    ``--threads``): the last call before numba loads wins. ``environ`` (written) and
    ``user`` (the user's own values) let tests use dicts; with the real environment, a
    team sized from the allowance is then fitted to the load (``fit``)."""
    env = os.environ if environ is None else environ
    user = _USER if user is None else user
    allow = allowance or cpus.allowance()
    if requested is not None:
        n, n_from = int(requested), "--threads"
    elif user.get(_ENV_COUNT) is not None:
        n, n_from = _parse_count(user[_ENV_COUNT]), "environment"
    else:
        n, n_from = allow.count, allow.why
    wait, wait_from = _wait_policy(user), "environment"
    if wait is None:
        env[_ENV_SPIN] = str(SPIN_COUNT)
        wait, wait_from = _wait_policy(env), "k3"
    if user.get(_ENV_LAYER) or user.get(_ENV_ORDER):
        layer, layer_from = user.get(_ENV_LAYER) or user[_ENV_ORDER], "environment"
    else:
        layer, layer_from = LAYERS, "k3"
        env[_ENV_ORDER] = LAYERS
    late = "numba" in sys.modules
    if late:
        import numba
        n = min(n, numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(n)
    else:
        env[_ENV_COUNT] = str(n)
    global _fitting
    _fitting = _Fit(n, cpus.affinity_cpus()) if environ is None and n_from == allow.why else None
    return Team(n, n_from, wait, wait_from, layer, layer_from, late)


class _Fit:
    """The team share in use and the last look at the load (``fit``)."""

    def __init__(self, full: int, cpu_set, clock=time.monotonic, proc: str = "/proc",
                 own_seconds=None):
        self.full = self.n = full
        self.cpus, self.clock, self.proc = set(cpu_set), clock, proc
        self.own = {} if own_seconds is None else {"own_seconds": own_seconds}
        self.last = cpus.snapshot(self.cpus, proc, clock=clock, **self.own)
        self.calm = 0                  # looks in a row that would let the team grow

    def look(self) -> int | None:
        """The team size for what others took since the last look (None: too soon)."""
        if self.clock() - self.last.at < FIT_EVERY:
            return None
        now = cpus.snapshot(self.cpus, self.proc, clock=self.clock, **self.own)
        others, steal = cpus.others_between(self.last, now)
        self.last = now
        if others is None:
            return None
        want = max(1, min(self.full, self.full - int(others + steal + 0.5)))
        if want < self.n:
            self.n, self.calm = want, 0
        elif want > self.n:
            self.calm += 1
            if self.calm >= 2:            # two free looks in a row: grow back
                self.n, self.calm = want, 0
        else:
            self.calm = 0
        return self.n


_fitting: _Fit | None = None


def fit() -> None:
    """Fit the calling thread's team to the CPUs others leave free (cheap when called
    more often than every FIT_EVERY seconds: the forward pass calls it each pass). Does
    nothing when the team's size was given (``--threads``, ``NUMBA_NUM_THREADS``) or
    ``prepare`` did not run (the library used directly)."""
    if _fitting is None:
        return
    n = _fitting.look()
    if n is not None:
        import numba
        if numba.get_num_threads() != n:
            numba.set_num_threads(n)


def _parse_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        from ..errors import UsageError
        raise UsageError(f"{_ENV_COUNT}={text!r} in the environment is not a positive "
                         "integer", hint="unset it or give --threads")
    return n


def in_force() -> dict:
    """What numba runs with now: team size, threads available, the layer once a parallel
    region has run (else None), and the wait policy its OpenMP runtime was given."""
    import numba
    try:
        layer = numba.threading_layer()
    except ValueError:              # no parallel region has run yet
        layer = None
    return {"threads": numba.get_num_threads(), "max_threads": numba.config.NUMBA_NUM_THREADS,
            "layer": layer, "wait_policy": _wait_policy(os.environ)}


def _wait_policy(environ):
    """How ``environ`` tells OpenMP's idle threads to wait, as ``NAME=value`` (a wait
    policy before a spin count, as libgomp reads them), or None when it does not."""
    if environ.get(_ENV_WAIT):
        return f"{_ENV_WAIT}={environ[_ENV_WAIT]}"
    if environ.get(_ENV_SPIN):
        return f"{_ENV_SPIN}={environ[_ENV_SPIN]}"
    return None
