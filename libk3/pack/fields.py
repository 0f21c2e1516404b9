"""Reading a pack's files strictly: typed access to their JSON fields, every refusal a
FormatError naming the file and field (formats/pack.md).

Owns: ``Fields`` (objects with exactly their keys, bounded integers, lists, plain file
names, sha256 hex, a tensor entry against its inventory spec, equality with JSON types),
parsing JSON that refuses duplicate keys, reading a pack file or saying it is missing,
``first_diff`` between two JSON values and the re-pack hint. Does not own: what the pack
must say (``libk3.pack.schema``), writing it (``libk3.pack.writer``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import FormatError
from ..io.dtypes import ITEMSIZE

REPACK_HINT = "re-pack: k3-pack CHECKPOINT NEW_OUT (a pack is never rewritten in place)"


class Fields:
    """Typed access to a parsed JSON document; every refusal names the file and field."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, field: str, problem: str, expected=None, found=None, hint=None):
        raise FormatError(f"{field}: {problem}", path=self.path, expected=expected,
                          found=None if found is None else show(found), hint=hint)

    def obj(self, v, field: str, keys) -> dict:
        if type(v) is not dict:
            self.fail(field, "must be a JSON object", found=v)
        missing = [k for k in keys if k not in v]
        if missing:
            self.fail(field, f"missing key {missing[0]!r}")
        unknown = [k for k in v if k not in keys]
        if unknown:
            self.fail(field, f"unknown key {unknown[0]!r}", expected=", ".join(keys))
        return v

    def int(self, v, field: str, lo: int = 0, hi: int | None = None) -> int:
        if type(v) is not int or v < lo or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"{lo}..{hi}"
            self.fail(field, "must be an integer " + rng, found=v)
        return v

    def list(self, v, field: str) -> list:
        if type(v) is not list:
            self.fail(field, "must be a JSON list", found=v)
        return v

    def eq(self, v, want, field: str, problem: str = "has the wrong value", hint=None):
        """``v`` equals ``want`` with the same JSON types all the way down (1.0 is not 1)."""
        if first_diff(want, v, field):
            self.fail(field, problem, expected=show(want), found=v, hint=hint)
        return v

    def file_name(self, v, field: str) -> str:
        """A plain file name: no directory part, so it cannot leave the pack or checkpoint."""
        if type(v) is not str or not v or v in (".", "..") or "/" in v or "\\" in v \
                or "\0" in v:
            self.fail(field, "must be a plain file name (no directory, no '..')", found=v)
        return v

    def hex64(self, v, field: str) -> str:
        if type(v) is not str or len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
            self.fail(field, "must be 64 lowercase hex digits (sha256)", found=v)
        return v

    def tensor(self, t: dict, field: str, off_key: str, spec, cfg, room: int) -> dict:
        """A tensor entry (keys already checked): a dtype the inventory allows, the shape,
        the size; it ends within ``room`` bytes of where ``off_key`` counts from."""
        if type(t["dtype"]) is not str or t["dtype"] not in spec.dtypes:
            self.fail(f"{field}.dtype", "dtype the inventory does not allow for this tensor",
                      expected="/".join(spec.dtypes), found=t["dtype"])
        shape = self.list(t["shape"], f"{field}.shape")
        for k, s in enumerate(shape):
            self.int(s, f"{field}.shape[{k}]")
        if spec.shape is None:                 # A_log: (n,), n >= num_heads
            if len(shape) != 1 or shape[0] < cfg.num_heads:
                self.fail(f"{field}.shape", "wrong shape",
                          expected=f"[n] with n >= {cfg.num_heads}", found=shape)
        elif tuple(shape) != spec.shape:
            self.fail(f"{field}.shape", "wrong shape", expected=list(spec.shape), found=shape)
        want = math.prod(shape) * ITEMSIZE[t["dtype"]]
        self.eq(t["nbytes"], want, f"{field}.nbytes", "is not shape x dtype size")
        self.int(t[off_key], f"{field}.{off_key}")
        if t[off_key] + want > room:
            self.fail(f"{field}.{off_key}", "tensor ends outside its run or file",
                      expected=f"off + nbytes <= {room}", found=t[off_key])
        return t


def show(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def no_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"key {k!r} appears twice")
        seen[k] = v
    return seen


def parse_json(blob: bytes, path: Path, what: str):
    try:
        return json.loads(blob, object_pairs_hook=no_duplicates)
    except (ValueError, RecursionError) as e:        # JSONDecodeError, bad UTF-8, duplicates
        raise FormatError(f"{what} is not valid JSON: {' '.join(str(e).split())[:120]}",
                          path=path) from None


def read_file(path: Path, what: str) -> bytes:
    if not path.is_file():
        raise FormatError(f"{what} is missing (not a finished pack?)", path=path, hint=REPACK_HINT)
    try:
        return path.read_bytes()
    except OSError as e:
        raise FormatError(f"cannot read {what}: {e.strerror}", path=path) from None


def first_diff(want, got, field: str):
    """(field, want, got) of the first difference between two JSON values, or None."""
    if type(want) is dict and type(got) is dict:
        for k in list(want) + [k for k in got if k not in want]:
            if k not in got or k not in want:
                return f"{field}[{k}]", want.get(k), got.get(k)
            sub = first_diff(want[k], got[k], f"{field}.{k}" if field else k)
            if sub:
                return sub
        return None
    if type(want) is list and type(got) is list and len(want) == len(got):
        for k, (a, b) in enumerate(zip(want, got)):
            sub = first_diff(a, b, f"{field}[{k}]")
            if sub:
                return sub
        return None
    return None if (type(want) is type(got) and want == got) else (field, want, got)
