"""Verifying a finished pack (formats/pack.md, invariants 3, 5, 7 and 8): ``k3-pack verify``.

Owns: re-reading every trunk layer once (raw, or decoded block by block from a
compressed trunk, from one file or from the stripe files of a striped one), checking its
CRC and scanning its float tensors for NaN/Inf, and with the checkpoint comparing the
source bytes too; the one refusal of NaN/Inf trunk tensors. Does not own: the checks
every pack passes before anything reads it (``libk3.pack.schema.open_pack``) or writing a
pack (``libk3.pack.writer``).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from .. import names
from ..errors import FormatError
from ..io.direct import aligned_empty
from ..io.dtypes import ITEMSIZE
from . import codec as trunk_codec, stripes
from .nonfinite import RunScan
from .schema import REPACK_HINT, crc_mismatch, open_pack

COPY_BLOCK = 16 << 20                # 16 MiB reads


def preadv(src, bufs, off: int) -> int:
    """``os.preadv`` on a descriptor, or a striped trunk's own ``preadv``."""
    return os.preadv(src, bufs, off) if isinstance(src, int) else src.preadv(bufs, off)


def crc_of_file_range(src, off: int, n: int, scan: RunScan | None = None,
                      path=None) -> int:
    """CRC-32 of ``n`` bytes at ``off`` of ``src`` (a descriptor or a striped trunk),
    feeding them to ``scan`` as well."""
    crc, buf = 0, aligned_empty(COPY_BLOCK)
    mv = memoryview(buf)
    while n > 0:
        k = preadv(src, [mv[:min(n, COPY_BLOCK)]], off)
        if k <= 0:
            raise FormatError("pack file ends early", path=path, expected=f"{n} more bytes "
                              f"at offset {off}", hint=REPACK_HINT)
        crc = zlib.crc32(mv[:k], crc)
        if scan is not None:
            scan.feed(buf[:k])
        off += k
        n -= k
    return crc


def nonfinite_error(path, tensors: list, where: str | None = None) -> FormatError:
    """The one refusal of trunk tensors holding NaN or Inf (k3-pack and verify);
    ``where``: the first one's place (layer, tensor, element, block)."""
    return FormatError(f"{len(tensors)} trunk tensor(s) hold NaN or Inf"
                       + (f", the first at {where}" if where else ""), path=path,
                       tensor=tensors[0],
                       hint="a released checkpoint has none: fetch the shard again, or pass "
                            "--allow-nonfinite to accept them")




def verify(out_dir, ckpt=None, progress: bool = True, allow_nonfinite: bool = False,
           stripe_dirs=None) -> dict:
    """Check a pack the way k3-run opens it (``open_pack``: the schema, the stored config's
    inventory, and with ``ckpt`` the identity, every layer row, tensor entry and expert
    record), then read every layer once: its CRC, NaN/Inf in its float tensors, and with
    ``ckpt`` the CRC of its source bytes. A compressed trunk's layers are decoded, each
    block checked against its own CRC first (a bad block is named). Raises FormatError
    naming the first bad file, field, layer or block (NaN/Inf: after the whole pass,
    naming the first value's layer, tensor and, compressed, block, and the count of
    tensors, unless ``allow_nonfinite``); returns a summary. A striped trunk is read
    from its stripe files (``stripe_dirs``: where they are now), a bad layer naming them."""
    from .. import progress as _progress

    d = Path(out_dir)
    pk = open_pack(d, ckpt, stripe_dirs)
    man = pk.manifest
    trunk = d / man["trunk_file"]
    nonfinite: list = []
    first_at = None                 # where the first NaN/Inf is
    fd = os.open(trunk, os.O_RDONLY) if pk.stripes is None else \
        stripes.open_reader(pk.stripes, trunk, use_direct=False)
    src_fds = {}
    decoded = _DecodedLayers(pk, fd, trunk) if pk.compressed else None
    try:
        bar = _progress.bar(total=sum(l["nbytes"] for l in man["layers"]), unit="B",
                            unit_scale=True, desc="verify", show=progress)
        for lay in man["layers"]:
            L = lay["layer"]
            scan = RunScan(lay["tensors"])
            if decoded is not None:
                crc = decoded.crc(L, scan)
            else:
                crc = crc_of_file_range(fd, lay["file_off"], lay["nbytes"], scan, path=trunk)
            if crc != lay["crc32"]:
                raise crc_mismatch(trunk if pk.stripes is None else pk.stripes.holding(
                    lay["file_off"], lay["padded"]), L, lay["crc32"], crc)
            nonfinite += [names.layer(L, sfx) for sfx in sorted(scan.found)]
            if scan.found and first_at is None:           # the tensor nonfinite[0] names
                sfx = min(scan.found)
                first_at = _nonfinite_at(lay, sfx, scan.found[sfx],
                                         pk.blocks[L] if pk.compressed else None)
            if ckpt is not None:
                src = ckpt.model_dir / lay["shard"]        # a plain name (open_pack)
                if src not in src_fds:
                    src_fds[src] = os.open(src, os.O_RDONLY)
                if crc_of_file_range(src_fds[src], lay["run_start"], lay["nbytes"],
                                      path=src) != lay["crc32"]:
                    raise FormatError(f"layer {L}: trunk bytes differ from the source "
                                      "checkpoint", path=trunk, hint=REPACK_HINT)
            bar.update(lay["nbytes"])
        bar.close()
    finally:
        os.close(fd) if isinstance(fd, int) else fd.close()
        for sfd in src_fds.values():
            os.close(sfd)
        if decoded is not None:
            decoded.codec.close()
    if nonfinite and not allow_nonfinite:
        raise nonfinite_error(trunk, nonfinite, first_at)
    return {"pack": str(d), "layers": len(man["layers"]), "experts": int(pk.records.size),
            "trunk_bytes": man["trunk_bytes"], "against_checkpoint": ckpt is not None,
            "compressed": pk.compressed, "nonfinite": nonfinite, "ok": True}


def _nonfinite_at(lay: dict, sfx: str, element: int, plan=None) -> str:
    """The place of NaN/Inf ``element`` of tensor ``sfx`` of layer row ``lay``: layer,
    tensor and element, and in a compressed trunk (``plan``: the layer's BlockPlan) the
    block holding it."""
    L, t = lay["layer"], lay["tensors"][sfx]
    if plan is None:
        return f"layer {L} tensor {sfx} element {element}"
    b = plan.block_at(t["off"] + element * ITEMSIZE[t["dtype"]])
    return f"{plan.where(L, b)} (element {element} of the tensor)"


class _DecodedLayers:
    """verify's reader of a compressed trunk: COPY_BLOCK of stored bytes at a time, every
    block checked against its CRC, decoded, and its output fed on in run order."""

    def __init__(self, pk, fd: int, path):
        import numba

        self.pk, self.fd, self.path = pk, fd, path
        self.codec = trunk_codec.Codec(numba.get_num_threads())
        self.groups = [pl.groups(COPY_BLOCK) for pl in pk.blocks]
        spans = [(pl.span(lo, hi)[1], pl.span(lo, hi, stored=False)[1])
                 for pl, gs in zip(pk.blocks, self.groups) for lo, hi in gs]
        self.stored = aligned_empty(max(s for s, _ in spans))
        self.out = aligned_empty(max(o for _, o in spans) + 1)

    def crc(self, L: int, scan: RunScan) -> int:
        """CRC-32 of layer L's decoded run (fed to ``scan`` too)."""
        lay, plan, crc = self.pk.manifest["layers"][L], self.pk.blocks[L], 0
        for lo, hi in self.groups[L]:
            a, n = plan.span(lo, hi)
            got = preadv(self.fd, [memoryview(self.stored)[:n]], lay["file_off"] + a)
            if got != n:
                raise FormatError(f"layer {L}: the compressed trunk ends early",
                                  path=self.path, expected=f"{n} bytes at offset "
                                  f"{lay['file_off'] + a}", found=got, hint=REPACK_HINT)
            oa, on = plan.span(lo, hi, stored=False)
            base = oa - oa % 2                    # coded blocks sit at even run offsets
            self.codec.decode(plan, lo, hi, self.stored, 0, self.out, True, self.path, L,
                              out_base=base)
            piece = self.out[oa - base:oa - base + on]
            scan.feed(piece)
            crc = zlib.crc32(piece, crc)
        return crc
