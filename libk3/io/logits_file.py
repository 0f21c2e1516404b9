"""Saved logits files (formats/logits.md): the scored positions of a perplexity run, their
targets and float32 logits, for a later run's KL divergence.

Owns: writing the file (temporary name, fsync, rename: ``atomic.replacing``) row block by
row block as windows are scored, and reading it back with every invariant of
formats/logits.md checked. Does not own: which positions are scored or what is computed
from them (``libk3.run.perplexity``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import struct
import zlib

import numpy as np

from ..errors import FormatError, K3IOError
from . import atomic

MAGIC = b"K3LOGITS"
VERSION = 1
HEADER = struct.Struct("<8sIIIIQQ")          # magic, version, V, C, K, W, reserved
CRC = struct.Struct("<I")


def scored_per_window(ctx: int) -> int:
    """K: positions ctx // 2 .. ctx - 2 of a window are scored (invariant 2)."""
    return ctx - 1 - ctx // 2


@dataclasses.dataclass(frozen=True)
class LogitsHeader:
    vocab: int
    ctx: int
    per_window: int
    windows: int

    @property
    def rows(self) -> int:
        return self.per_window * self.windows

    def size(self) -> int:
        """The file's exact length in bytes (invariant 3)."""
        return HEADER.size + 4 * self.rows + 4 * self.rows * self.vocab + CRC.size


class LogitsWriter:
    """Rows of one logits file being written (``writing``): ``add(rows)`` per window."""

    def __init__(self, f, header: LogitsHeader, targets):
        self.f, self.header, self.crc, self.written = f, header, 0, 0
        targets = np.ascontiguousarray(targets, dtype="<i4")
        if targets.shape != (header.rows,):
            raise ValueError("one target per scored position")
        self._write(HEADER.pack(MAGIC, VERSION, header.vocab, header.ctx,
                                header.per_window, header.windows, 0))
        self._write(targets.tobytes())

    def _write(self, data: bytes) -> None:
        self.crc = zlib.crc32(data, self.crc)
        self.f.write(data)

    def add(self, rows: np.ndarray) -> None:
        """The logits of one window's scored positions, (K, V)."""
        rows = np.ascontiguousarray(rows, dtype="<f4")
        if rows.shape != (self.header.per_window, self.header.vocab):
            raise ValueError("one row of V logits per scored position")
        self._write(rows.tobytes())
        self.written += len(rows)


@contextlib.contextmanager
def writing(path, header: LogitsHeader, targets):
    """A ``LogitsWriter`` on a temporary name beside ``path``: the header and every target
    (known before any window is scored) first; when the block ends with every row added,
    the CRC, fsync and rename. Nothing at ``path`` changes otherwise."""
    with atomic.replacing(path) as f:
        w = LogitsWriter(f, header, targets)
        yield w
        if w.written != header.rows:
            raise ValueError(f"{w.written} of {header.rows} rows written")
        f.write(CRC.pack(w.crc))


class LogitsReader:
    """A logits file, checked (formats/logits.md): ``header``, ``targets`` and
    ``window(i)`` -> (K, V) float32 read in order; ``finish()`` checks the CRC over
    everything read (call it after the last window, before reporting)."""

    def __init__(self, path):
        self.path = path
        try:
            self._f = open(path, "rb")
            size = os.fstat(self._f.fileno()).st_size
            head = self._f.read(HEADER.size)
        except OSError as e:
            raise K3IOError(f"cannot read the logits file: {e.strerror}", path=path) from None
        if len(head) < HEADER.size:
            self._bad("shorter than its header", f">= {HEADER.size} bytes", f"{size} bytes")
        magic, version, vocab, ctx, per_window, windows, _ = HEADER.unpack(head)
        if magic != MAGIC:
            self._bad("not a k3 logits file (formats/logits.md)", MAGIC, magic)
        if version != VERSION:
            self._bad("unsupported version", VERSION, version)
        if vocab < 1 or ctx < 2 or windows < 1 or per_window != scored_per_window(ctx):
            self._bad("inconsistent header", f"V >= 1, C >= 2, W >= 1, K = "
                      f"{scored_per_window(max(ctx, 2))}", f"V={vocab} C={ctx} K="
                      f"{per_window} W={windows}")
        self.header = LogitsHeader(vocab, ctx, per_window, windows)
        if size != self.header.size():
            self._bad("wrong length for its header", f"{self.header.size()} bytes",
                      f"{size} bytes")
        raw = self._f.read(4 * self.header.rows)
        self.crc = zlib.crc32(raw, zlib.crc32(head))
        self.targets = np.frombuffer(raw, dtype="<i4").astype(np.int64)
        if self.targets.min() < 0 or self.targets.max() >= vocab:
            self._bad("a target outside the vocabulary", f"0 .. {vocab - 1}",
                      int(self.targets.max() if self.targets.max() >= vocab
                          else self.targets.min()))
        self.read = 0

    def _bad(self, what, expected, found):
        self.close()
        raise FormatError(what, path=self.path, expected=expected, found=found)

    def window(self, i: int) -> np.ndarray:
        """Window ``i``'s rows (windows are read in order, once)."""
        if i != self.read:
            raise ValueError("windows are read in order")
        h = self.header
        raw = self._f.read(4 * h.per_window * h.vocab)
        self.crc = zlib.crc32(raw, self.crc)
        self.read += 1
        return np.frombuffer(raw, dtype="<f4").reshape(h.per_window, h.vocab)

    def finish(self) -> None:
        """FormatError unless every window was read and the CRC matches."""
        while self.read < self.header.windows:
            self.window(self.read)
        stored = CRC.unpack(self._f.read(CRC.size))[0]
        if stored != self.crc:
            self._bad("CRC-32 mismatch: the file is damaged", f"{stored:#010x}",
                      f"{self.crc:#010x}")
        self.close()

    def close(self) -> None:
        self._f.close()
