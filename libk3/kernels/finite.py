"""Finding NaN and Inf in raw float bit patterns (IEEE 754: exponent bits all ones).

Owns: ``first_special``, the scan k3-pack and ``k3-pack verify`` run over every trunk
tensor's bytes, and k3-run over every decoded block of a compressed trunk. Does not own:
which mask a dtype has (``libk3.io.dtypes.EXPONENT_MASK``) or how bytes reach it
(``libk3.pack.nonfinite``, ``libk3.pack.codec``).

Why a kernel: numpy's ``((bits & mask) == mask).any()`` makes two temporaries and runs
far below the pack's copy rate; this loop ORs flags over 4096-element blocks
(vectorised by LLVM) and rescans only a block that has one (bench/README.md "Pack
integrity").
"""

from __future__ import annotations

from numba import njit

BLOCK = 4096


@njit(cache=True, nogil=True)        # k3-run's decode threads scan blocks side by side
def first_special(bits, mask):
    """Index of the first element of ``bits`` (1-D uint16 or uint32 bit patterns) whose
    ``mask`` bits are all set, or -1. With the exponent mask of the dtype that is the
    first NaN or +-Inf. Must not become: a check of the NaN payload only (misses Inf), or
    an isnan on widened values (needs a widening pass and misses nothing more)."""
    n = bits.shape[0]
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        hit = False
        for i in range(start, stop):
            hit |= (bits[i] & mask) == mask
        if hit:
            for i in range(start, stop):
                if (bits[i] & mask) == mask:
                    return i
    return -1
