"""One logistic unit, sigmoid(w . x + b) in float64: the DSpark draft's confidence head
(formats/model/dspark.md §5.7).

Owns: ``logistic_unit``. Does not own: what the features x are (``libk3.draft.forward``
concatenates the final-normed row and the Markov W1 row), the summation order
(``_dot.dot16``, formats/model/numerics.md section 2; the unit's own steps are section 11).

WHY float64 to the end: the confidence is a probability the speculative loop multiplies
over proposals to price a verify width; it is one row, so rounding it to float32 would
save nothing, and no other kernel's float32 sigmoid has to be matched. One row is one sum,
so nothing runs in parallel and the thread count cannot change it.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ._dot import dot16


@njit(cache=True)
def logistic_unit(w, x, bias):
    """1 / (1 + exp(-z)) with z = dot16(w, x) + f64(bias), all float64 (libm exp).

    w: [n] float32 or uint16 BF16 bits, C-contiguous. x: [n] float32, C-contiguous.
    bias: float. Returns a float64; exp(-z) overflowing gives +0.0, not an error.
    Must not become: a float32 sum or sigmoid, numpy's dot (its order is the BLAS
    library's), or two dots added (the hidden part and the W1 part summed apart: another
    order)."""
    if x.shape[0] != w.shape[0]:
        raise ValueError("logistic_unit: w and x must have the same length")
    z = dot16(w, x) + np.float64(bias)
    return 1.0 / (1.0 + math.exp(-z))
