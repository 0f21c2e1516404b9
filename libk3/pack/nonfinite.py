"""Finding NaN and Inf in a layer's trunk tensors as their bytes stream past.

Owns: ``RunScan``, fed one layer run's bytes in consecutive pieces of any size (k3-pack's
copy pieces, ``k3-pack verify``'s reads), which records each float tensor's first
non-finite element; an element split between two pieces is joined. Does not own: the
scan loop (``libk3.kernels.finite``), the masks (``libk3.io.dtypes``), or what to do
about a finding (k3-pack and verify refuse unless ``--allow-nonfinite``).
"""

from __future__ import annotations

import numpy as np

from ..io.dtypes import EXPONENT_MASK


class RunScan:
    """``feed`` the run's bytes in order; ``found`` maps suffix -> first bad element."""

    def __init__(self, tensors: dict):
        """``tensors``: suffix -> {off, nbytes, dtype, ...} inside the run (trunk.json's
        tensor table)."""
        self._tensors = sorted((t["off"], t["nbytes"], t["dtype"], sfx)
                               for sfx, t in tensors.items()
                               if t["dtype"] in EXPONENT_MASK and t["nbytes"])
        self._seen: dict = {}        # suffix -> elements already scanned
        self._carry: dict = {}       # suffix -> bytes of an element cut by a piece boundary
        self.found: dict = {}
        self.pos = 0

    def feed(self, piece: np.ndarray) -> None:
        """The next ``piece`` (1-D uint8) of the run."""
        start, end = self.pos, self.pos + piece.size
        for off, nbytes, dtype, sfx in self._tensors:
            a, b = max(off, start), min(off + nbytes, end)
            if a < b and sfx not in self.found:
                self._scan(sfx, dtype, piece[a - start:b - start])
        self.pos = end

    def _scan(self, sfx: str, dtype: str, chunk: np.ndarray) -> None:
        view, mask = EXPONENT_MASK[dtype]
        item = np.dtype(view).itemsize
        from ..kernels.finite import first_special   # numba: only when a pack is scanned
        seen = self._seen.get(sfx, 0)
        carry = self._carry.pop(sfx, b"")
        if carry:
            head = carry + chunk[:item - len(carry)].tobytes()
            chunk = chunk[item - len(carry):]
            if len(head) < item:
                self._carry[sfx] = head
                return
            if first_special(np.frombuffer(head, view).copy(), mask) >= 0:
                self.found[sfx] = seen
                return
            seen += 1
        n = chunk.size // item
        if n:
            bits = chunk[:n * item].view(view)
            if not bits.flags.aligned:
                bits = bits.copy()
            k = first_special(bits, mask)
            if k >= 0:
                self.found[sfx] = seen + k
                return
        if chunk.size > n * item:
            self._carry[sfx] = chunk[n * item:].tobytes()
        self._seen[sfx] = seen + n
