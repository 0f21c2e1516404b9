"""Reading a file a user names (``-f``, ``--system @FILE``, ``--response-format @FILE``,
the lines of ``--batch``) in bounded time and memory.

Owns: refusing what is not a regular file before opening it (a FIFO would block the
open, ``/dev/zero`` never ends), refusing a file larger than the caller's bound from its
size, and reading at most the bound plus one byte (a file growing meanwhile is caught
there); for a file of lines, reading one line at a time and measuring a line over the
bound in chunks that are dropped as they are read, so no line longer than the bound is
ever held. Does not own: decoding the bytes, or what the bound is (the callers: the
context for prompts and batch lines, the schema size for schemas).
"""

from __future__ import annotations

import dataclasses
import os
import stat

from ..errors import FormatError, K3IOError


def read_bounded(path, max_bytes: int, what: str) -> bytes:
    """The bytes of ``path``: FormatError naming ``what`` and the file when it is not a
    regular file or holds more than ``max_bytes``; K3IOError when it cannot be read."""
    try:
        st = os.stat(path)                # follows links; never opens, so never blocks
    except OSError as e:
        raise K3IOError(f"cannot read {what}: {e.strerror or e}", path=path) from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory"
                if stat.S_ISDIR(st.st_mode) else "a device or socket")
        raise FormatError(f"{what} is {kind}, not a regular file: give a file", path=path)
    too_big = f"{what} is larger than k3 reads"
    if st.st_size > max_bytes:
        raise FormatError(too_big, path=path, expected=f"<= {max_bytes} bytes",
                          found=f"{st.st_size} bytes")
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise K3IOError(f"cannot read {what}: {e.strerror or e}", path=path) from None
    if len(data) > max_bytes:
        raise FormatError(too_big, path=path, expected=f"<= {max_bytes} bytes",
                          found=f"more than {max_bytes} bytes")
    return data


@dataclasses.dataclass(frozen=True)
class Oversize:
    """A line longer than the bound: its size in bytes (without its newline) and the
    bound, never its bytes."""
    size: int
    limit: int


def bounded_lines(f, max_bytes: int, chunk: int = 1 << 20):
    """(line number from 1, bytes or ``Oversize``) of every line of the binary file
    ``f``, split on b"\\n" only, the newline dropped; a line of more than ``max_bytes``
    bytes is measured in ``chunk``-byte reads and dropped. A file ending in a newline has
    an empty last line, as ``bytes.split`` gives."""
    lineno = 0
    while True:
        lineno += 1
        line = f.readline(max_bytes + 1)
        if line.endswith(b"\n"):
            yield lineno, line[:-1]
            continue
        if len(line) <= max_bytes:                  # the end of the file
            yield lineno, line
            return
        size = len(line)
        del line
        while True:
            part = f.readline(chunk)
            if not part or part.endswith(b"\n"):
                size += len(part) - (1 if part else 0)
                break
            size += len(part)
        yield lineno, Oversize(size, max_bytes)
        if not part:
            return
