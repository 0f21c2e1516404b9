"""How many threads one kernel call uses: the whole team, or the calling thread alone.

Owns: ``PARALLEL_MIN_WORK`` and the pair ``narrow`` / ``widen`` every parallel kernel
calls around its ``prange``. Does not own: the team's size or how its threads wait
(``libk3.machine.threads``).

Why: a parallel region costs a hand-off to every thread in the team and a wait for the
slowest, and a thread that has gone to sleep since the last region (it spins only
briefly, ``libk3.machine.threads``) takes tens of microseconds to wake: more than a
small kernel's whole work, and a decode token runs hundreds of small kernels. Below
``PARALLEL_MIN_WORK`` a call runs on the calling thread only. Each row's arithmetic is
the same whichever thread computes it, so this never changes a result; the figures that
set the threshold are in bench/README.md "Shared machines".

Work is counted in the units of ``bf16.matvec``'s weight bytes: a kernel whose elements
cost more (a transcendental per element) counts each element as several bytes.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _launch_threads

PARALLEL_MIN_WORK = 1 << 16
TRANSCENDENTAL = 32          # work units of one element that calls exp or tanh


# numba's own get_num_threads / set_num_threads call their runtime through ctypes
# pointers inside jitted code, which numba cannot cache; these call the same two symbols
# of the threading layer by name, as numba's parallel loops themselves do.
@intrinsic
def _team_size(typingctx):
    _launch_threads()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []),
                                            "get_num_threads")
        return builder.call(fn, [])
    return types.int32(), codegen


@intrinsic
def _set_team_size(typingctx, n):
    _launch_threads()
    if not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(32)]), "set_num_threads")
        builder.call(fn, [context.cast(builder, args[0], signature.args[0], types.int32)])
        return context.get_dummy_value()
    return types.void(n), codegen


def launch() -> None:
    """Load the threading layer now. Why: ``narrow`` and ``widen`` call its symbols by
    name; when they come from numba's cache their typing (which loads the layer) does not
    run, and a kernel compiled beside them then fails to link (LLVM aborts the process:
    "Symbol not found: get_num_threads"). Called once below, when this module is
    imported, so no import order or cache state can reach that abort."""
    _launch_threads()


@njit(cache=True)
def narrow(work):
    """The calling thread's team size, after narrowing it to itself when ``work`` is
    below PARALLEL_MIN_WORK; pass the result to ``widen`` after the prange."""
    n = _team_size()
    if n > 1 and work < PARALLEL_MIN_WORK:
        _set_team_size(1)
    return n


@njit(cache=True)
def widen(n):
    """Restore the team size ``narrow`` returned."""
    if n > 1:
        _set_team_size(n)


launch()
