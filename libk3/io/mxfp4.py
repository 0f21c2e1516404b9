"""MXFP4 (OCP MX FP4, E2M1 values with E8M0 group scales) in plain numpy.

Owns: the E2M1 table, decoding packed experts to float32 (for the float64 reference,
tests and debugging) and encoding float weights (for synthetic checkpoints), following
model.md §4.2. Does not own: multiplying from packed bytes, which the
numba kernels do without materialising a float copy (an f32 expert is 132 MB).

Traps this module exists to get right once: the LOW nibble is the EVEN element; scale
byte 255 (NaN in the MX spec) makes its whole 32-group zero; the exponent bias is 127.
"""

from __future__ import annotations

import numpy as np

from ..config import MXFP4_GROUP

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
SCALE_NAN = 255


def scale_multipliers(scales: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float32 multipliers 2^(s-127); s = 255 -> 0 (group contributes 0)."""
    s = np.asarray(scales, dtype=np.uint8).astype(np.int32)
    m = np.ldexp(np.float32(1.0), s - 127).astype(np.float32)
    m[s == SCALE_NAN] = 0.0
    return m


def decode(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """packed [R, C/2] uint8, scales [R, C/32] uint8 -> float32 [R, C], exact.

    A group with scale 255 decodes to +0.0 (the MX NaN scale; model.md §4.2)."""
    packed = np.asarray(packed, dtype=np.uint8)
    R, half = packed.shape
    C = half * 2
    if scales.shape != (R, C // MXFP4_GROUP):
        raise ValueError(f"scale shape {scales.shape} does not match packed {packed.shape}")
    codes = np.empty((R, C), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    vals = E2M1[codes]
    mult = np.repeat(scale_multipliers(scales), MXFP4_GROUP, axis=1)
    out = vals * mult
    nan_groups = np.repeat(np.asarray(scales) == SCALE_NAN, MXFP4_GROUP, axis=1)
    out[nan_groups] = 0.0
    return out.astype(np.float32)


def encode(w: np.ndarray):
    """float [R, C] -> (packed [R, C/2] uint8, scales [R, C/32] uint8).

    model.md §4.2 encoding rule: exponent = floor(log2(max|w| of the group)) - 2, stored + 127;
    nibble = nearest E2M1 magnitude of w / 2^exponent (ties to the lower code), sign bit
    for negatives. An all-zero group gets exponent 0 (stored 127)."""
    w = np.asarray(w, dtype=np.float64)
    R, C = w.shape
    if C % MXFP4_GROUP:
        raise ValueError(f"width {C} is not a multiple of {MXFP4_GROUP}")
    g = w.reshape(R, C // MXFP4_GROUP, MXFP4_GROUP)
    amax = np.abs(g).max(axis=2)
    with np.errstate(divide="ignore"):
        exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, 0)
    exp = np.clip(exp, -127, 127).astype(np.int32)
    scaled = g / np.ldexp(1.0, exp)[:, :, None]
    mags = E2M1[:8].astype(np.float64)
    idx = np.abs(np.abs(scaled)[..., None] - mags).argmin(axis=-1).astype(np.uint8)
    codes = (idx | np.where(scaled < 0, 8, 0).astype(np.uint8)).reshape(R, C)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scales = (exp + 127).astype(np.uint8)
    return packed, scales
