"""The mount table: which filesystem holds a path.

Owns: reading ``/proc/self/mounts`` (with its octal escapes) and the mount point and
filesystem type of a path. Does not own: what a filesystem can do (``storage``).
"""

from __future__ import annotations

import os
from pathlib import Path


def unescape_mount(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n") \
        .replace("\\134", "\\")


def mounts(path) -> dict:
    """{mount point: (fstype, options)}; a later mount on the same point wins."""
    out = {}
    try:
        text = Path(path).read_text()
    except OSError:
        try:
            text = Path("/proc/mounts").read_text()
        except OSError:
            return out
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 4:
            out[unescape_mount(f[1])] = (f[2], f[3])
    return out


def mount_of(path, table: dict | None = None) -> tuple:
    """(mount point, fstype) of the longest mount prefix of ``path``'s real path."""
    table = mounts("/proc/self/mounts") if table is None else table
    real = os.path.realpath(path)
    best = ("/", table.get("/", ("unknown", ""))[0])
    for point, (fs, _) in table.items():
        if real == point or real.startswith(point.rstrip("/") + "/"):
            if len(point) >= len(best[0]):
                best = (point, fs)
    return best
