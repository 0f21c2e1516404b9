"""Atomic file writes: temporary name, fsync, rename, fsync of the directory.

Owns: the one way k3 writes a small file so that readers see all of it or none of it
(invariant 4 of the developers' guide). Large streamed artifacts (shards, trunk.bin,
traces) follow the same rule in their writers, with ``fsync_dir`` from here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def fsync_dir(directory) -> None:
    """Make a rename durable. Some filesystems refuse fsync on a directory: harmless."""
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def write_bytes(path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json(path, doc, indent=2) -> None:
    """Deterministic JSON (sorted keys, trailing newline), written atomically."""
    write_bytes(path, (json.dumps(doc, indent=indent, sort_keys=True) + "\n").encode())
