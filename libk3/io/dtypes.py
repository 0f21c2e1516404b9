"""Dtype facts and exact numpy conversions shared by reader, pack, synth, reference, tests.

Owns: safetensors dtype item sizes, BF16/F16 -> F32 widening, F32 -> BF16 rounding (for
writing synthetic checkpoints), and the one rule for handing a float matrix of any stored
dtype to the dense kernels (``matrix_operand``). Does not own: the numba kernels'
on-the-fly widening (``libk3.kernels``), which must agree with ``bf16_to_f32`` bit for bit.
"""

from __future__ import annotations

import numpy as np

# safetensors dtype -> item size in bytes. Only these appear in K3 (model.md §3.2); any other
# dtype is an error at header-parse time.
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1}
# float dtype -> (little-endian unsigned view, exponent bits): all of them set is NaN or Inf.
EXPONENT_MASK = {"BF16": ("<u2", 0x7F80), "F16": ("<u2", 0x7C00), "F32": ("<u4", 0x7F800000)}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen BF16 bit patterns (uint16) to float32 exactly: bits << 16 (model.md §5.0)."""
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


def matrix_operand(raw: np.ndarray, dtype: str, shape) -> np.ndarray:
    """A float matrix's little-endian bytes (uint8) as the dense kernels take it, exactly
    as stored: BF16 as uint16 bit patterns (widened inside the kernels), F32 as float32
    (never rounded to BF16), both views of ``raw`` when it is aligned for them, else
    copies; F16 widened to float32 (numba has no CPU float16; every F16 is exact in F32).
    ValueError for a dtype that is not a float."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if dtype == "F16":
        return raw.view("<f2").astype(np.float32).reshape(shape)
    view = {"BF16": np.uint16, "F32": np.float32}.get(dtype)
    if view is None:
        raise ValueError(f"{dtype} is not a float dtype")
    if raw.ctypes.data % np.dtype(view).itemsize:
        raw = raw.copy()
    return raw.view(view).reshape(shape)


def bound_extra_bytes(dtype: str, nbytes: int) -> int:
    """Bytes a float tensor of ``nbytes`` stored bytes costs in RAM beyond them once bound
    for the forward pass: an F16 tensor is held widened to F32 next to its stored bytes
    (2 more bytes per element); BF16 matrices and F32 tensors are used as stored. (BF16
    vectors are widened too; vectors are a few KB per layer, inside the fixed overhead.)"""
    return 2 * nbytes if dtype == "F16" else 0
