"""Splitting BF16 bit patterns into an exponent plane and a sign+mantissa plane, and back.

Owns: the two byte-exact plane kernels the trunk codec uses (formats/pack.md
"trunk.kz"). Does not own: entropy coding, blocks or checksums
(``libk3.stream.trunk_codec``).

BF16 value v (uint16): sign v >> 15, exponent (v >> 7) & 0xff, mantissa v & 0x7f. The
exponent plane holds the exponent byte; the sign+mantissa plane ``(v >> 8 & 0x80) |
(v & 0x7f)``. Why split: in trained (near-Gaussian) weights the exponent byte carries
~2.5 bits and compresses; the other byte is close to uniform and is stored raw.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def split_planes(u16, exponent, sign_mantissa):
    """exponent[i] = (u16[i] >> 7) & 0xff; sign_mantissa[i] = (u16[i] >> 8 & 0x80) |
    (u16[i] & 0x7f). Shapes (k,), uint16 in, uint8 out."""
    for i in range(u16.shape[0]):
        v = u16[i]
        exponent[i] = (v >> 7) & 0xFF
        sign_mantissa[i] = ((v >> 8) & 0x80) | (v & 0x7F)


@njit(cache=True, nogil=True)
def merge_planes(exponent, sign_mantissa, out):
    """The inverse of ``split_planes``: out[i] = (m & 0x80) << 8 | e << 7 | m & 0x7f, with
    e = exponent[i], m = sign_mantissa[i]; shapes (k,), uint8 in, uint16 out. Must not
    become: a merge that drops the exponent's low bit (it is bit 7 of the low byte)."""
    for i in range(exponent.shape[0]):
        m = np.uint16(sign_mantissa[i])
        out[i] = ((m & 0x80) << 8) | (np.uint16(exponent[i]) << 7) | (m & 0x7F)
