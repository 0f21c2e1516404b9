"""One safetensors shard: its strict header reader, positioned reads, and a small writer.

Owns: the container format of model.md §3.2 (8-byte little-endian header
length N, N bytes of UTF-8 JSON, then the data region; ``data_offsets`` are relative to
byte 8 + N), parsed into ``TensorEntry`` rows with ABSOLUTE file offsets; ``pread_into``,
the one positioned-read loop every reader uses; ``write_shard`` for synthetic checkpoints
and tests. Does not own: which tensors a checkpoint must hold, the multi-shard table or
expert runs (``libk3.io.checkpoint``), dtype widening (``libk3.io.dtypes``).

Invariants the reader enforces, each raising ``CheckpointError`` naming file and tensor:

1. The file holds at least the 8-byte length; N <= file size - 8 and N <= MAX_HEADER_BYTES,
   both checked BEFORE anything of size N is allocated (a corrupt length never allocates).
2. The header is UTF-8 JSON whose top level is an object. Names may contain JSON escapes;
   trailing spaces (padding) are JSON whitespace. No name appears twice.
3. ``__metadata__``, if present, is an object of string -> string and is skipped.
4. Every other entry has exactly the keys ``dtype`` (one of ``ITEMSIZE``), ``shape`` (a
   list of non-negative ints; ``[]`` is rank 0 with one element) and ``data_offsets``
   (two ints, 0 <= start <= end <= data size).
5. end - start == prod(shape) * itemsize.
6. No two non-empty tensors overlap. A zero-byte tensor may share its start with the next
   tensor (that is not an overlap). Holes between tensors and unaligned offsets are legal.

Why objects are parsed as pair lists: ``json.loads`` silently keeps the last of two equal
keys, so a repeated tensor name would vanish (its bytes becoming an unnoticed hole). An
``object_pairs_hook`` sees every key; a C-level list subclass as hook costs a fraction
of a Python hook function building dicts (bench/README.md, "Reading the checkpoint
index").
"""

from __future__ import annotations

import json
import math
import operator
import os
import uuid
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..errors import CheckpointError, K3IOError
from .atomic import fsync_dir
from .dtypes import ITEMSIZE

# The real shards' headers are ~800 KB each (model.md §3.2: ~78 MB over 96 shards). 200 MB
# leaves room for any plausible re-sharding while refusing absurd length fields.
MAX_HEADER_BYTES = 200 * 1024 * 1024
# No real tensor comes near 2**62 elements; the cap stops a fuzzed shape from building a
# huge integer product (and bounds the arithmetic, like safetensors' ValidationOverflow).
_MAX_NUMEL = 1 << 62
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
_METADATA = "__metadata__"
_CANONICAL_DTYPE = {d: d for d in ITEMSIZE}      # interned dtype strings, one per dtype
# TensorEntry(...) runs a Python-level __new__; building the tuple directly is the same
# object at a third of the cost.
_new_tuple = tuple.__new__
_BY_OFFSET = operator.itemgetter(2)              # stable: ties keep header order


class TensorEntry(NamedTuple):
    """One tensor of one shard. ``offset`` is ABSOLUTE in the file: 8 + N + start."""

    name: str
    path: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple


def read_header(path) -> list:
    """Every tensor of the shard at ``path`` as TensorEntry rows sorted by offset.

    Enforces invariants 1-6 of the module docstring; a truncated shard (a tensor ending
    past the end of the file) is refused here, at open."""
    path = os.fspath(path)
    blob, size = _header_bytes(path)
    entries, _ = parse_header(blob, path, data_size=size - 8 - len(blob))
    return entries


def scan_header(path) -> tuple:
    """(entries as ``read_header`` gives them, the file size the header implies: 8 + N +
    the largest data end). Parses the header with invariant 1 and the entry rules but
    WITHOUT the end <= data size bound, so a truncated shard can be measured (k3-doctor)
    instead of refused; the entries are ``read_header``'s when the size matches."""
    path = os.fspath(path)
    blob, _ = _header_bytes(path)
    entries, data_end = parse_header(blob, path, data_size=None)
    return entries, 8 + len(blob) + data_end


def _header_bytes(path: str):
    """(the N header bytes, file size), with invariant 1 checked before allocating."""
    fd = _open(path)
    try:
        size = os.fstat(fd).st_size
        blob = bytearray(_header_length(fd, path, size))
        pread_into(fd, 8, blob, path=path)
    finally:
        os.close(fd)
    return blob, size


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError("shard file not found", path=path) from None
    except OSError as e:
        raise K3IOError(f"cannot open shard: {e.strerror}", path=path) from None


def _header_length(fd: int, path: str, size: int) -> int:
    if size < 8:
        raise CheckpointError("file is shorter than the 8-byte header length",
                              path=path, expected=">= 8 bytes", found=f"{size} bytes")
    head = bytearray(8)
    pread_into(fd, 0, head, path=path)
    header_len = int.from_bytes(head, "little")
    if header_len > size - 8:
        raise CheckpointError("header length runs past the end of the file",
                              path=path, expected=f"N <= {size - 8}", found=f"N = {header_len}",
                              hint="the shard is truncated or not a safetensors file")
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError("header length is implausibly large", path=path,
                              expected=f"N <= {MAX_HEADER_BYTES}", found=f"N = {header_len}")
    return header_len


class _Pairs(list):
    """A JSON object as its list of (key, value) tuples, in text order, repeats kept."""

    __slots__ = ()


def parse_header(blob, path, data_size=None):
    """Parse and check header bytes (bytes-like, without the 8-byte length). ``data_size`` is the
    length of the data region (file size - 8 - N), or None to skip the end bound.

    Returns (entries sorted by offset, largest data end relative to the data region)."""
    path = os.fspath(path)
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"header is not UTF-8 ({e.reason} at byte {8 + e.start})",
                              path=path) from None
    try:
        doc = json.loads(text, object_pairs_hook=_Pairs)
    except (ValueError, RecursionError) as e:   # JSONDecodeError is a ValueError
        raise CheckpointError(f"header is not valid JSON: {_short(e)}", path=path) from None
    if type(doc) is not _Pairs:
        raise CheckpointError("header is not a JSON object", path=path,
                              expected="object", found=type(doc).__name__)
    base = 8 + len(blob)
    if len(dict(doc)) != len(doc):
        _raise_duplicate(doc, path)
    entries = []
    append = entries.append
    shapes = {}                  # interned shape tuples and sizes: ~20 distinct values
    sizes = {}                   # among ~5,000 entries, saving ~40 MB at real scale
    data_end = 0
    for name, info in doc:
        if name == _METADATA:
            _check_metadata(info, path)
            continue
        if type(info) is not _Pairs or len(info) != 3:
            _bad_entry(info, name, path)
        pairs, info = info, dict(info)
        if info.keys() != _ENTRY_KEYS:
            _bad_entry(pairs, name, path)
        dtype = info["dtype"]
        itemsize = ITEMSIZE.get(dtype) if type(dtype) is str else None
        if itemsize is None:
            raise CheckpointError("unknown dtype", path=path, tensor=name,
                                  expected="/".join(ITEMSIZE), found=_short(dtype))
        shape = info["shape"]
        if type(shape) is not list:
            raise CheckpointError("shape is not a list", path=path, tensor=name,
                                  expected="list of non-negative ints", found=_short(shape))
        numel = 1
        for d in shape:
            if type(d) is not int or d < 0:
                raise CheckpointError("shape entry is not a non-negative int", path=path,
                                      tensor=name, expected="list of non-negative ints",
                                      found=_short(shape))
            numel *= d
            if numel > _MAX_NUMEL:
                raise CheckpointError("shape has implausibly many elements", path=path,
                                      tensor=name, expected="<= 2**62 elements",
                                      found=_short(shape))
        offsets = info["data_offsets"]
        if type(offsets) is not list or len(offsets) != 2 \
                or type(offsets[0]) is not int or type(offsets[1]) is not int:
            raise CheckpointError("data_offsets is not two ints", path=path, tensor=name,
                                  expected="[start, end]", found=_short(offsets))
        start, end = offsets
        if not 0 <= start <= end:
            raise CheckpointError("data_offsets are not 0 <= start <= end", path=path,
                                  tensor=name, expected="0 <= start <= end",
                                  found=f"[{start}, {end}]")
        if data_size is not None and end > data_size:
            raise CheckpointError("tensor data runs past the end of the file", path=path,
                                  tensor=name, expected=f"end <= data size {data_size}",
                                  found=f"end {end}", hint="the shard is truncated")
        nbytes = numel * itemsize
        if end - start != nbytes:
            raise CheckpointError("data_offsets do not span shape x dtype", path=path,
                                  tensor=name,
                                  expected=f"{nbytes} bytes ({shape} x {dtype})",
                                  found=f"{end - start} bytes [{start}, {end}]")
        key = tuple(shape)
        shape_t = shapes.setdefault(key, key)
        nbytes = sizes.setdefault(nbytes, nbytes)
        if end > data_end:
            data_end = end
        append(_new_tuple(TensorEntry,
                          (name, path, base + start, nbytes, _CANONICAL_DTYPE[dtype], shape_t)))
    entries.sort(key=_BY_OFFSET)
    _check_overlap(entries, path)
    return entries, data_end


def _raise_duplicate(doc, path: str):
    seen = set()
    for name, _ in doc:
        if name in seen:
            raise CheckpointError("name appears twice in the header", path=path, tensor=name)
        seen.add(name)


def _check_metadata(info, path: str) -> None:
    if type(info) is not _Pairs or not all(type(k) is str and type(v) is str for k, v in info) \
            or len({k for k, _ in info}) != len(info):
        raise CheckpointError("__metadata__ is not an object of string -> string",
                              path=path, tensor=_METADATA, found=_short(info))


def _bad_entry(info, name: str, path: str):
    if type(info) is not _Pairs:
        raise CheckpointError("header entry is not an object", path=path, tensor=name,
                              expected="{dtype, shape, data_offsets}", found=_short(info))
    keys = [k for k, _ in info]
    raise CheckpointError("header entry has the wrong keys", path=path, tensor=name,
                          expected="dtype, shape, data_offsets (each once)",
                          found=", ".join(keys))


def _check_overlap(entries: list, path: str) -> None:
    """entries sorted by offset: each non-empty tensor starts at or after the end of the
    previous non-empty one (zero-byte tensors occupy nothing and never overlap)."""
    prev = None
    for ent in entries:
        if ent.nbytes == 0:
            continue
        if prev is not None and ent.offset < prev.offset + prev.nbytes:
            raise CheckpointError(f"tensor data overlaps tensor {prev.name}", path=path,
                                  tensor=ent.name,
                                  expected=f"start >= {prev.offset + prev.nbytes}",
                                  found=f"start {ent.offset} (absolute)")
        prev = ent


def _short(value, limit: int = 80) -> str:
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def pread_into(fd: int, offset: int, buf, path=None, tensor: str | None = None):
    """Fill all of ``buf`` (a writable C-contiguous buffer, e.g. a numpy uint8 array or
    a bytearray) from ``fd`` at absolute ``offset``, looping on short reads (Linux caps
    one read near 2 GiB). Raises CheckpointError naming ``path`` when the file ends
    early, K3IOError on an OS read failure. Returns ``buf``."""
    view = memoryview(buf).cast("B")
    total = len(view)
    got = 0
    while got < total:
        try:
            n = os.preadv(fd, [view[got:]], offset + got)
        except OSError as e:
            raise K3IOError(f"read failed: {e.strerror}", path=path, tensor=tensor,
                            expected=f"{total} bytes at offset {offset}") from None
        if n == 0:
            raise CheckpointError("file ends early (truncated shard?)", path=path,
                                  tensor=tensor,
                                  expected=f"{total} bytes at offset {offset}",
                                  found=f"{got} bytes before end of file")
        got += n
    return buf


# ---- writer -----------------------------------------------------------------------------

def write_shard(path, tensors, metadata: dict | None = None) -> int:
    """Write a safetensors shard; returns its size in bytes.

    ``tensors``: list of (name, dtype, shape, data), laid out in the given order with no
    gaps. ``data`` is one of: None (left as a sparse hole that reads as zeros, so a 1.5 TB
    apparent checkpoint takes no disk); bytes-like or a numpy array (its raw bytes); an
    iterable of such chunks; or a zero-argument callable returning that iterable (so big
    tensors can be generated while streaming). The byte count must equal
    prod(shape) x itemsize.

    Deterministic bytes: entries in the given order, keys sorted inside each entry, fixed
    separators, ASCII-escaped names, JSON padded with spaces to a multiple of 8. Written
    to a temporary name in the same directory, fsynced, then renamed into place."""
    path = Path(path)
    header, spans = _build_header(path, tensors, metadata)
    base = 8 + len(header)
    total = base + (spans[-1][1] if spans else 0)
    # O_EXCL on a unique name rather than mkstemp: mkstemp's mode 0600 would survive the
    # rename, and shards should get the usual permissions (0666 under the umask).
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            for (name, _, _, data), (start, end) in zip(tensors, spans):
                if data is None:
                    continue
                f.seek(base + start)
                written = _write_data(f, data)
                if written != end - start:
                    raise CheckpointError("tensor data has the wrong length", path=path,
                                          tensor=name, expected=f"{end - start} bytes",
                                          found=f"{written} bytes")
            f.truncate(total)            # extends the file over trailing holes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)
    return total


def _build_header(path: Path, tensors, metadata):
    parts = []
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise CheckpointError("__metadata__ must map strings to strings", path=path)
        parts.append(json.dumps(_METADATA) + ":" +
                     json.dumps(metadata, sort_keys=True, separators=(",", ":")))
    spans, seen, pos = [], set(), 0
    for name, dtype, shape, _ in tensors:
        if not isinstance(name, str) or name == _METADATA or name in seen:
            raise CheckpointError("tensor name is not a fresh string", path=path,
                                  tensor=str(name))
        seen.add(name)
        if dtype not in ITEMSIZE:
            raise CheckpointError("unknown dtype", path=path, tensor=name,
                                  expected="/".join(ITEMSIZE), found=dtype)
        shape = [int(d) for d in shape]
        if any(d < 0 for d in shape):
            raise CheckpointError("negative dimension", path=path, tensor=name,
                                  found=shape)
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        spans.append((pos, pos + nbytes))
        # json.dumps(entry, sort_keys=True, separators=(",", ":")) spelled out: a real
        # checkpoint's header has half a million entries (dtype is one of ITEMSIZE's names)
        dims = ",".join(map(str, shape))
        parts.append(f'{json.dumps(name)}:{{"data_offsets":[{pos},{pos + nbytes}],'
                     f'"dtype":"{dtype}","shape":[{dims}]}}')
        pos += nbytes
    text = ("{" + ",".join(parts) + "}").encode("ascii")
    text += b" " * (-len(text) % 8)
    return text, spans


def _write_data(f, data) -> int:
    if callable(data):
        data = data()
    if isinstance(data, (bytes, bytearray, memoryview, np.ndarray)):
        data = (data,)
    written = 0
    for chunk in data:
        if isinstance(chunk, np.ndarray):
            chunk = np.ascontiguousarray(chunk).view(np.uint8).reshape(-1)
        view = memoryview(chunk).cast("B")
        f.write(view)
        written += len(view)
    return written


