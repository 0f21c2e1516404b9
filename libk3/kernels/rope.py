"""Rotary position embedding in interleaved pairs (formats/model/dspark.md §5.4).

Owns: ``rope_interleaved``, the rotation of the DSpark draft's q_pe and k_pe. Does not own
the frequencies or the amplitude (``libk3.draft.config``: DeepSeek-style YaRN), nor which
slices of q and of the kv_a projection are rotated (``libk3.draft.forward``). K3 itself
never rotates (its MLA is NoPE, model.md §5.6); only the draft does.

WHY interleaved: the draft was trained with GPT-J / DeepSeek pairs (x[2i], x[2i+1]); the
half-split NeoX pairing (x[i], x[i + half]) loads, runs and accepts almost nothing
(formats/model/dspark.md §5.4), so the convention is fixed here and tested against its rival.

Numerics (formats/model/numerics.md section 10): the angle, cos and sin in float64 (libm),
scaled by the amplitude in float64 and rounded to float32 once; the rotation itself in
float32, one rounding per operation. Rows (token, head) are independent, so ``prange``
over them cannot change a result, and a T-token call equals T one-token calls.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import team


@njit(cache=True, parallel=True)
def rope_interleaved(x, positions, inv_freq, amplitude, out):
    """Rotate each interleaved pair of x[t, h] by position[t] * inv_freq[i].

    x, out: [T, H, 2 * half] float32 (out may be x). positions: [T] int64, absolute.
    inv_freq: [half] float64. amplitude: float (YaRN's cos/sin multiplier, 1.0 for the
    published draft). For pair i of row (t, h), with a = x[t, h, 2i], b = x[t, h, 2i + 1]:
      angle = f64(positions[t]) * inv_freq[i]                 (f64)
      c = f32(cos(angle) * amplitude), s = f32(sin(angle) * amplitude)
      out[t, h, 2i]     = f32(f32(a * c) - f32(b * s))
      out[t, h, 2i + 1] = f32(f32(a * s) + f32(b * c))
    Must not become: half-split pairs (x[i], x[i + half]), an angle or cos/sin in float32
    (float32 numbers near 10^6 are 1/16 apart: the fast pairs would turn by noise), the
    amplitude applied after rounding, pair frequencies indexed by 2i instead of i, or a
    fused multiply-add in the rotation (another rounding)."""
    T, H, D = x.shape
    half = inv_freq.shape[0]
    if D != 2 * half or positions.shape[0] != T or out.shape[0] != T \
            or out.shape[1] != H or out.shape[2] != D:
        raise ValueError("rope_interleaved: x and out are [T, H, 2 * half], positions [T], "
                         "inv_freq [half]")
    amp = np.float64(amplitude)
    nt = team.narrow(T * H * half * 2 * team.TRANSCENDENTAL)
    for row in prange(T * H):
        t = row // H
        h = row - t * H
        pos = np.float64(positions[t])
        for i in range(half):
            angle = pos * inv_freq[i]
            c = np.float32(math.cos(angle) * amp)
            s = np.float32(math.sin(angle) * amp)
            a = x[t, h, 2 * i]
            b = x[t, h, 2 * i + 1]
            out[t, h, 2 * i] = a * c - b * s
            out[t, h, 2 * i + 1] = a * s + b * c
    team.widen(nt)
