"""Dtype facts and exact numpy conversions shared by reader, pack, synth, reference, tests.

Owns: safetensors dtype item sizes, BF16/F16 -> F32 widening, F32 -> BF16 rounding (for
writing synthetic checkpoints). Does not own: the numba kernels' on-the-fly widening
(``libk3.kernels``), which must agree with ``bf16_to_f32`` bit for bit.
"""

from __future__ import annotations

import numpy as np

# safetensors dtype -> item size in bytes. Only these appear in K3 (spec 3.2); any other
# dtype is an error at header-parse time.
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1}
# float dtype -> (little-endian unsigned view, exponent bits): all of them set is NaN or Inf.
EXPONENT_MASK = {"BF16": ("<u2", 0x7F80), "F16": ("<u2", 0x7C00), "F32": ("<u4", 0x7F800000)}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen BF16 bit patterns (uint16) to float32 exactly: bits << 16 (spec 5.0)."""
    bits = np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to BF16 bit patterns (uint16), round-to-nearest-even; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def widen(raw: np.ndarray, dtype: str, shape) -> np.ndarray:
    """Interpret little-endian raw bytes (uint8) as ``dtype`` and return float32 of
    ``shape`` (BF16/F16/F32), or the uint8 bytes reshaped for U8."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if dtype == "U8":
        return raw.reshape(shape)
    if dtype == "BF16":
        return bf16_to_f32(raw.view("<u2")).reshape(shape)
    if dtype == "F16":
        return raw.view("<f2").astype(np.float32).reshape(shape)
    if dtype == "F32":
        return raw.view("<f4").astype(np.float32).reshape(shape)
    raise ValueError(f"unknown dtype {dtype}")
