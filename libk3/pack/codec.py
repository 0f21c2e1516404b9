"""The compressed trunk's blocks (formats/pack.md "trunk.kz"): which bytes of a layer run
form which block, encoding a run into blocks, and decoding blocks back into the exact run.

Owns: the codec's name and constants, the block plan a layer's tensor table implies,
encoding (k3-pack) and decoding with the per-block checksum (k3-run, ``k3-pack verify``),
and the one error naming a bad block. Does not own: files, reads or the manifest
(``libk3.pack.writer``, ``libk3.pack.schema``, ``libk3.stream.trunk``) or the plane kernels
(``libk3.kernels.bf16_planes``).

A layer run is cut tensor by tensor (in run order) into blocks of at most BLOCK_BYTES of
output. A block of a BF16 tensor of at least MIN_CODED_BYTES (at an even offset) is
CODED (``libk3.kernels.bf16_planes``: a 4-bit exponent code with escapes); every other
block is RAW (its bytes as they are). Blocks are independent, so any split of a layer's
blocks across threads decodes the same bytes.
"""

from __future__ import annotations

import dataclasses
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import names
from ..errors import FormatError
from ..io.dtypes import EXPONENT_MASK, ITEMSIZE
from ..kernels.bf16_block import HEADER_BYTES, PROBLEMS, coded_range

CODEC = "bf16-exponent-nibble"
BLOCK_BYTES = 256 << 10            # output bytes per block (the last of a tensor: fewer)
MIN_CODED_BYTES = 64 << 10         # smaller BF16 tensors stay raw
RAW, CODED = 0, 1
INDEX_RECORD = np.dtype([("stored", "<u4"), ("crc32", "<u4")])     # trunk.blocks, per block
DAMAGED_HINT = "the pack is damaged: re-pack (k3-pack verify names every bad block)"
NONFINITE_HINT = ("a released checkpoint has none: re-pack from a good copy (k3-pack verify "
                  "names every such tensor)")


def codec_params() -> dict:
    """trunk.json's ``trunk_codec`` fields that fix the block plan."""
    return {"name": CODEC, "block_bytes": BLOCK_BYTES, "min_coded_bytes": MIN_CODED_BYTES}


@dataclasses.dataclass
class BlockPlan:
    """One layer's blocks in run order. ``in_off``/``in_len``/``crc32`` (where each block
    is stored inside the layer's stored span) come from trunk.blocks (``with_index``)."""

    kind: np.ndarray               # uint8, RAW or CODED
    out_off: np.ndarray            # int64, offset in the run
    out_len: np.ndarray            # int64
    tensor: list                   # suffix of each block's tensor
    dtype: list                    # dtype of each block's tensor
    part: np.ndarray               # int64, the block's number inside its tensor
    parts: np.ndarray              # int64, blocks of its tensor
    in_off: np.ndarray | None = None
    in_len: np.ndarray | None = None
    crc32: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.kind.size)

    def with_index(self, rec: np.ndarray) -> "BlockPlan":
        """This plan with its stored lengths and checksums (``rec``: INDEX_RECORD rows)."""
        in_len = rec["stored"].astype(np.int64)
        in_off = np.zeros_like(in_len)
        np.cumsum(in_len[:-1], out=in_off[1:])
        return dataclasses.replace(self, in_off=in_off, in_len=in_len,
                                   crc32=rec["crc32"].astype(np.uint32))

    def stored_problem(self):
        """(block, problem) of the first stored length the plan cannot hold, or None."""
        k = self.out_len // 2
        raw = self.kind == RAW
        bad_raw = raw & (self.in_len != self.out_len)
        fewest, most = coded_range(k)
        bad_coded = ~raw & ((self.in_len < fewest) | (self.in_len > most))
        bad = np.flatnonzero(bad_raw | bad_coded)
        if not bad.size:
            return None
        b = int(bad[0])
        return b, ("a raw block's stored length is not its length" if raw[b] else
                   "a coded block's stored length is outside what its values can take")

    def in_place(self, align: int) -> int:
        """Where the layer's stored bytes start in a buffer it is decoded into from offset
        0 (a multiple of ``align``): far enough in that every block's output ends at or
        before its own stored bytes begin, so decoding blocks in order never overwrites a
        block not yet decoded (``libk3.stream.piece_reader``). A coded block stores at most
        8 bytes more than its values, so this plus the stored bytes exceeds the decoded
        run by at most one block's stored bytes plus 8 bytes a block (and alignment)."""
        if not len(self):
            return 0
        reach = int(np.max(self.out_off + self.out_len - self.in_off))
        return max(0, -(-reach // align) * align)

    def groups(self, max_bytes: int, stored: bool = True) -> list:
        """(first, end) block ranges in order whose stored bytes (or, with ``stored``
        False, output bytes) are at most ``max_bytes`` (or one block)."""
        off, size = (self.in_off, self.in_len) if stored else (self.out_off, self.out_len)
        out, lo = [], 0
        for b in range(1, len(self) + 1):
            if b == len(self) or off[b] + size[b] - off[lo] > max_bytes:
                out.append((lo, b))
                lo = b
        return out

    def span(self, lo: int, hi: int, stored: bool = True) -> tuple:
        """(offset, length) of blocks lo..hi-1's stored bytes (or output bytes)."""
        off, size = (self.in_off, self.in_len) if stored else (self.out_off, self.out_len)
        return int(off[lo]), int(off[hi - 1] + size[hi - 1] - off[lo])

    def where(self, layer: int, b: int) -> str:
        return (f"layer {layer} tensor {self.tensor[b]} block {int(self.part[b])} of "
                f"{int(self.parts[b])}")

    def block_at(self, offset: int) -> int:
        """The block holding byte ``offset`` of the decoded run."""
        return int(np.searchsorted(self.out_off, offset, side="right")) - 1


def plan_blocks(tensors, block_bytes: int = BLOCK_BYTES,
                min_coded_bytes: int = MIN_CODED_BYTES) -> BlockPlan:
    """The blocks of a layer run whose tensors are ``tensors``: (suffix, off, nbytes,
    dtype) rows, tiling the run. (Other sizes than the format's: tests only; an even
    ``block_bytes`` of at most BLOCK_BYTES.)"""
    kind, out_off, out_len, tensor, dtypes, part, parts = [], [], [], [], [], [], []
    for sfx, off, nbytes, dtype in sorted(tensors, key=lambda t: (t[1], t[0])):
        coded = dtype == "BF16" and nbytes >= min_coded_bytes and off % 2 == 0
        n = -(-nbytes // block_bytes)
        for j in range(n):
            kind.append(CODED if coded else RAW)
            out_off.append(off + j * block_bytes)
            out_len.append(min(block_bytes, nbytes - j * block_bytes))
            tensor.append(sfx)
            dtypes.append(dtype)
            part.append(j)
            parts.append(n)
    return BlockPlan(np.array(kind, np.uint8), np.array(out_off, np.int64),
                     np.array(out_len, np.int64), tensor, dtypes, np.array(part, np.int64),
                     np.array(parts, np.int64))


def block_error(path, layer: int, plan: BlockPlan, b: int, problem: str, expected=None,
                found=None, hint: str = DAMAGED_HINT) -> FormatError:
    """The one error for a compressed block that fails its checksum, does not decode, or
    decodes to NaN or Inf."""
    return FormatError(f"{plan.where(layer, b)}: {problem}", path=path,
                       tensor=names.layer(layer, plan.tensor[b]), expected=expected,
                       found=found, hint=hint)


class Codec:
    """Encodes and decodes blocks on ``threads`` threads (the block kernels and zlib
    release the GIL)."""

    def __init__(self, threads: int = 1):
        self.threads = max(1, int(threads))
        self._pool = (ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="k3-decode")
                      if self.threads > 1 else None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _map(self, fn, n_items: int, weights: np.ndarray) -> list:
        """fn(lo, hi) over contiguous ranges of about equal weight, one per thread."""
        if self._pool is None or n_items < 2:
            return [fn(0, n_items)]
        cum = np.cumsum(weights)
        cuts = [0] + [int(np.searchsorted(cum, cum[-1] * t / self.threads, side="right"))
                      for t in range(1, self.threads)] + [n_items]
        cuts = sorted(set(min(max(c, 0), n_items) for c in cuts))
        return list(self._pool.map(lambda r: fn(*r), zip(cuts[:-1], cuts[1:])))

    # ---- encoding (k3-pack) --------------------------------------------------------
    def encode(self, src: np.ndarray, plan: BlockPlan, lo: int = 0, hi: int | None = None,
               src_at: int = 0) -> tuple:
        """(stored bytes of blocks ``lo..hi-1`` concatenated, their INDEX_RECORD rows).
        Block b's bytes are at ``src[src_at + out_off[b] - out_off[lo]]`` (default: ``src``
        is the whole run)."""
        from ..kernels.bf16_planes import encode_block  # numba: not for manifest checks

        hi = len(plan) if hi is None else hi
        blobs: list = [None] * (hi - lo)
        base = src_at - (int(plan.out_off[lo]) if hi > lo else 0)

        def work(a, z_hi):
            scratch = np.empty(HEADER_BYTES + BLOCK_BYTES, np.uint8)
            for b in range(lo + a, lo + z_hi):
                o, n = base + int(plan.out_off[b]), int(plan.out_len[b])
                raw = src[o:o + n]
                if plan.kind[b] == RAW:
                    blobs[b - lo] = raw.tobytes()
                    continue
                blobs[b - lo] = scratch[:encode_block(raw.view(np.uint16), scratch)].tobytes()

        self._map(work, hi - lo, plan.out_len[lo:hi])
        rec = np.zeros(hi - lo, INDEX_RECORD)
        rec["stored"] = [len(x) for x in blobs]
        rec["crc32"] = [zlib.crc32(x) for x in blobs]
        return b"".join(blobs), rec

    # ---- decoding (k3-run, verify) --------------------------------------------------
    def decode(self, plan: BlockPlan, lo: int, hi: int, src: np.ndarray, src_at: int,
               out: np.ndarray, check: bool, path, layer: int, out_base: int = 0,
               finite: bool = False) -> None:
        """Decode blocks ``lo..hi-1`` of ``plan`` into ``out`` (uint8; ``out[0]`` is the
        run's byte ``out_base``, an even offset). Block b's stored bytes are at
        ``src[src_at + in_off[b] - in_off[lo]]``. With ``check``, each block's CRC-32 is
        compared first; with ``finite``, a decoded block of a float tensor holding NaN or
        Inf is refused too (k3-run; verify scans the decoded run itself so that
        --allow-nonfinite can pass it). Raises ``block_error`` for the first bad block
        (in block order) after every thread has stopped."""
        from ..kernels.bf16_planes import decode_blocks  # numba: not for manifest checks

        if hi <= lo:
            return
        # blocks lo..hi-1 only, indexed from 0: a piece of a layer costs its own blocks
        kind, in_len, out_len = plan.kind[lo:hi], plan.in_len[lo:hi], plan.out_len[lo:hi]
        in_off = plan.in_off[lo:hi] + (src_at - int(plan.in_off[lo]))
        out_off = plan.out_off[lo:hi] - out_base
        if (in_off[0] < 0 or in_off[-1] + in_len[-1] > src.size
                or out_off[0] < 0 or out_off[-1] + out_len[-1] > out.size):
            raise ValueError("blocks outside the buffers they are decoded from or into")

        def work(a, z):
            if check:
                for i in range(a, z):
                    crc = zlib.crc32(src[in_off[i]:in_off[i] + in_len[i]])
                    if crc != plan.crc32[lo + i]:
                        return lo + i, "stored bytes do not match their checksum (crc32)", \
                            f"{int(plan.crc32[lo + i]):#010x}", f"{crc:#010x}"
            b, status = decode_blocks(src, kind, in_off, in_len, out, out_off, out_len, a, z)
            if b >= 0:
                return lo + int(b), PROBLEMS[int(status)], None, None
            for i in range(a, z) if finite else ():
                k = _first_nonfinite(out[out_off[i]:out_off[i] + out_len[i]],
                                     plan.dtype[lo + i])
                if k >= 0:
                    return lo + i, None, None, k
            return None

        errs = [e for e in self._map(work, hi - lo, plan.in_len[lo:hi]) if e]
        if errs:
            b, problem, want, got = min(errs, key=lambda e: e[0])
            if problem is None:                      # got: the value's index in the block
                raise nonfinite_block_error(path, layer, plan, b, got)
            raise block_error(path, layer, plan, b, problem, want, got)


def nonfinite_block_error(path, layer: int, plan: BlockPlan, b: int, k: int) -> FormatError:
    """The error for block ``b`` whose decoded value ``k`` is NaN or Inf, naming the
    value's place in its tensor."""
    first = b - int(plan.part[b])                    # the tensor's first block
    at = (int(plan.out_off[b] - plan.out_off[first]) // ITEMSIZE[plan.dtype[b]]) + k
    return block_error(path, layer, plan, b, "decoded values hold NaN or Inf",
                       found=f"element {at} of the tensor", expected="finite values",
                       hint=NONFINITE_HINT)


def _first_nonfinite(block: np.ndarray, dtype: str) -> int:
    """Index of the first NaN or Inf among a decoded block's values (``block``: its
    bytes), -1 when there is none or the tensor is not a float one."""
    if dtype not in EXPONENT_MASK:
        return -1
    from ..kernels.finite import first_special       # numba: only when blocks are decoded

    view, mask = EXPONENT_MASK[dtype]
    bits = block.view(view) if block.ctypes.data % np.dtype(view).itemsize == 0 \
        else block.copy().view(view)                 # an odd-placed tensor's block
    return int(first_special(bits, mask))
