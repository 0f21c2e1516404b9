"""The kernels' thread team: set up before numba loads, and what numba then runs with.

Owns: the environment numba and its OpenMP runtime read once, when they load: the team
size (``NUMBA_NUM_THREADS``: ``--threads``, else the CPUs this process may use,
``cpus.allowance``), how an idle thread of the team waits (``OMP_WAIT_POLICY``) and
the order numba tries its threading layers in (OpenMP first); a value the user put in
the environment is kept. Also ``in_force``: what numba actually runs with, for reports. Does not own: which
kernel calls use the whole team (``libk3.kernels.team``).

Why threads that sleep: a team whose idle threads spin looks like a CPU hog to the
scheduler; when another process holds one of our cores, the spinning thread is
descheduled for whole time slices while the next parallel region waits for it, and a
token took a hundred times longer. A thread that sleeps between regions is woken
promptly instead. Waking costs tens of microseconds, which is why small kernel calls
run on the calling thread alone (``libk3.kernels.team``). Why OpenMP rather than TBB or
numba's workqueue, and the figures: bench/README.md "Shared machines".

Call ``prepare`` before anything imports numba (each tool does it first thing); later,
only the team size can still change.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from . import cpus

WAIT_POLICY = "PASSIVE"          # an idle team thread sleeps (futex) instead of spinning
# numba's layers in the order to try: OpenMP where it loads, else TBB, else numba's own
LAYERS = "omp tbb workqueue"
_ENV_COUNT, _ENV_WAIT = "NUMBA_NUM_THREADS", "OMP_WAIT_POLICY"
_ENV_LAYER, _ENV_ORDER = "NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY"


# The user's own values, read when this module is first imported (a tool imports it
# before it writes any of them), so a second ``prepare`` does not take k3's writes as theirs.
_USER = {name: os.environ.get(name) or None for name in (_ENV_COUNT, _ENV_WAIT, _ENV_LAYER, _ENV_ORDER)}


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
    ``user`` (the user's own values) let tests use dicts."""
    env = os.environ if environ is None else environ
    user = _USER if user is None else user
    allow = allowance or cpus.allowance()
    if requested is not None:
        n, n_from = int(requested), "--threads"
    elif user.get(_ENV_COUNT) is not None:
        n, n_from = _parse_count(user[_ENV_COUNT]), "environment"
    else:
        n, n_from = allow.count, allow.why
    wait, wait_from = (user[_ENV_WAIT], "environment") if user.get(_ENV_WAIT) else (WAIT_POLICY, "k3")
    env[_ENV_WAIT] = wait
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
    return Team(n, n_from, wait, wait_from, layer, layer_from, late)


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
            "layer": layer, "wait_policy": os.environ.get(_ENV_WAIT)}
