"""Which threading layer numba loaded, found by running a parallel region.

Owns: a tiny parallel function and the check built on it. numba reports its layer only
after a parallel function has run. ``workqueue`` (neither OpenMP nor TBB loaded) is
flagged: it is slower and unsafe when two threads run parallel kernels at once.
Imports numba: never import this before ``threads.prepare``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, parallel=True)
def _prange_sum(x):
    """Sum of x via a prange loop: only to make numba pick its threading layer."""
    out = np.zeros_like(x)
    for i in prange(x.shape[0]):
        out[i] = x[i]
    return out.sum()


def layer_check() -> dict:
    """numba's threading layer and team size after a tiny parallel region, with a
    warning when the layer is ``workqueue``."""
    try:
        import numba

        _prange_sum(np.arange(64, dtype=np.float64))
        layer = numba.threading_layer()
        threads = numba.get_num_threads()
    except Exception as e:   # noqa: BLE001 - any failure here is a finding, not a crash
        return {"layer": None, "threads": None,
                "warning": f"numba could not run a parallel function: {type(e).__name__}: {e}"}
    warning = None
    if layer == "workqueue":
        warning = ("numba fell back to the 'workqueue' threading layer: parallel kernels "
                   "are slower and unsafe when called from two threads; install an OpenMP "
                   "runtime (libgomp) or TBB (pip install tbb)")
    return {"layer": layer, "threads": threads, "warning": warning}
