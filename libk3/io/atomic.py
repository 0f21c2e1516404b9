"""Atomic file writes: temporary name, fsync, rename, fsync of the directory.

Owns: the one way k3 writes a file so that readers see all of it or none of it, and a
failed write (full disk, read-only directory) leaves the previous file untouched, no
temporary behind, and an error naming the file (invariant 4 of the developers' guide);
the same for a directory built whole (``building_dir``: synthetic checkpoints and drafts).
Large streamed artifacts (shards, trunk.bin, traces) follow the same rule in their
writers, with ``fsync_dir`` from here.

Why a per-process temporary name: two runs writing the same output must not write into
one temporary file; the last rename wins, whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from ..errors import K3IOError


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


def write_error(path, e: OSError) -> K3IOError:
    """A K3IOError naming ``path`` for an OSError met while writing it (a write's OSError
    carries no file name)."""
    return K3IOError(f"cannot write: {e.strerror or e}", path=path)


@contextlib.contextmanager
def replacing(path, mode: str = "wb"):
    """Yield a file open on a temporary name beside ``path``. A clean exit flushes,
    fsyncs and renames it over ``path``; any exception removes it and leaves ``path`` as
    it was (an OSError is re-raised as K3IOError naming ``path``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        f = open(tmp, mode)
    except OSError as e:
        raise write_error(path, e) from None
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise write_error(path, e) from None
        raise
    fsync_dir(path.parent)


def write_bytes(path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with replacing(path) as f:
        f.write(data)


def write_json(path, doc, indent=2) -> None:
    """Deterministic JSON (sorted keys, trailing newline), written atomically."""
    write_bytes(path, (json.dumps(doc, indent=indent, sort_keys=True) + "\n").encode())


@contextlib.contextmanager
def building_dir(path):
    """Yield a new hidden sibling directory in which to build the directory ``path``. A
    clean exit renames it to ``path`` (absent, or an empty directory, which it replaces);
    any exception removes it and leaves ``path`` as it was, an OSError (or a K3IOError met
    inside) re-raised as a K3IOError naming ``path``.

    Why a fixed temporary name rather than a per-process one: a build killed midway
    leaves it behind, and the next build of the same ``path`` removes it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.build-tmp")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        yield tmp
        if path.exists():
            path.rmdir()
        os.replace(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise write_error(path, e) from None
        if isinstance(e, K3IOError):
            raise K3IOError(e.message, path=path) from None
        raise
    fsync_dir(path.parent)
