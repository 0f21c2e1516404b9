"""Deterministic value streams for synthetic tensors, shared by targets and drafts.

Owns: each tensor's own generator, seeded by (seed, crc32(name)); the row-chunked draw of
normal values; their encoding into stored bytes (BF16 or F32). Does not own: which
recipe (scale, offsets) a tensor gets: that is the writer's (``libk3.synth.checkpoint``
for targets, ``libk3.synth.draft`` for drafts).

Why one generator per tensor, drawn in fixed row chunks: the same seed then gives the
same bytes whatever order the tensors are written in, and a big tensor never has to be
held whole.
"""

from __future__ import annotations

import zlib

import numpy as np

from ..io.dtypes import f32_to_bf16

CHUNK_ELEMS = 1 << 22          # rows are generated in chunks of about 4M values


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """The generator of tensor ``name``: independent of every other tensor's."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def normal_rows(rng: np.random.Generator, shape: tuple, scale: float):
    """Yield (first row, float32 values) chunks of N(0, scale^2) in row-major order, whole
    rows per chunk (a 1-D tensor is one row)."""
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return
    row = shape[-1] if len(shape) >= 2 else n
    rows_per_chunk = max(1, CHUNK_ELEMS // row)
    total_rows = n // row
    for r0 in range(0, total_rows, rows_per_chunk):
        r1 = min(total_rows, r0 + rows_per_chunk)
        yield r0, rng.standard_normal((r1 - r0) * row, dtype=np.float32) * np.float32(scale)


def encode(chunks, dtype: str):
    """Yield the uint8 bytes of float32 ``chunks`` stored as ``dtype`` (BF16 rounded to
    nearest even, or F32)."""
    for v in chunks:
        if dtype == "BF16":
            yield f32_to_bf16(v).view(np.uint8)
        else:
            yield v.astype("<f4").view(np.uint8)
