"""The tokenizer's derived form on disk, so a run reads it instead of deriving it.

Owns: where a model's cache file lives, its key, its byte layout (formats/tokenizer.md,
"Derived-form cache"), writing it atomically and reading it back only when it is intact
and current. Does not own: deriving the form or reading the tokenizer files
(``libk3.text.tokenizer``), or choosing the pack directory (``libk3.engine.session``).

Why: re-deriving the BPE merges of the real 163,584 ranks by rank-BPE in Python, and
re-validating ``tiktoken.model`` line by line, cost seconds of every run
(bench/README.md, "Start-up"). Both depend only on the tokenizer files, so the result is
keyed by their sha256 and the layout's version: a changed file or a new k3 layout makes
the entry stale and it is rebuilt. No pickle: the file is data a run validates, never
code it executes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import K3IOError
from ..io import atomic

MAGIC = b"K3TOKDRV"
VERSION = 1                     # bump with any change of layout or of the derivation
FILE_NAME = "tokenizer.k3tok"   # in a pack directory
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
SECTIONS = ("rank_bytes", "rank_offsets", "vocab", "merges")


@dataclasses.dataclass
class DerivedTokenizer:
    """What a run needs that the tokenizer files hold only implicitly.

    ``ranks``: raw bytes of each rank (index = rank). ``vocab``: each rank spelled in
    the byte-level alphabet (model.md §8.5 step 1). ``merges``: int32 [m, 2] rank pairs,
    ordered by the merged token's rank. ``whole_only``: multi-byte ranks with no merge."""

    ranks: list
    vocab: list
    merges: np.ndarray
    whole_only: int


# ---- where ---------------------------------------------------------------------------

def user_cache_dir(env=None) -> Path:
    """k3's per-user cache directory: ``$XDG_CACHE_HOME/k3`` when that is an absolute
    path (XDG base-directory rule), else ``~/.cache/k3``."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path(env.get("HOME") or Path.home()) / ".cache"
    return root / "k3"


def cache_path(model_dir, pack_dir=None, env=None) -> Path:
    """The cache file of ``model_dir``'s tokenizer: ``FILE_NAME`` in the pack directory
    when there is one, else one file per model directory in the per-user cache."""
    if pack_dir is not None:
        return Path(pack_dir) / FILE_NAME
    tag = hashlib.sha256(os.path.abspath(model_dir).encode()).hexdigest()[:16]
    return user_cache_dir(env) / "tokenizer" / f"{tag}.k3tok"


def cache_key(files: dict, vocab_size) -> dict:
    """The key of the files {name: path, or None when absent}: their sha256, the
    config's vocab_size and VERSION."""
    digests = {}
    for name, path in sorted(files.items()):
        digests[name] = None if path is None else hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return {"version": VERSION, "vocab_size": vocab_size, "files": digests}


# ---- writing -------------------------------------------------------------------------

def encode(key: dict, derived: DerivedTokenizer) -> bytes:
    """The file's bytes (formats/tokenizer.md, "Derived-form cache")."""
    if any("\n" in s for s in derived.vocab):
        raise ValueError("a byte-level spelling holds a newline")
    lengths = [len(t) for t in derived.ranks]
    sections = {
        "rank_bytes": b"".join(derived.ranks),
        "rank_offsets": np.concatenate([[0], np.cumsum(lengths)]).astype("<u4").tobytes(),
        "vocab": "\n".join(derived.vocab).encode("utf-8"),
        "merges": np.ascontiguousarray(derived.merges, dtype="<i4").tobytes(),
    }
    payload = b"".join(sections[s] for s in SECTIONS)
    header = {"key": key, "n_ranks": len(derived.ranks), "n_merges": len(derived.merges),
              "whole_only": derived.whole_only,
              "sections": [[s, len(sections[s])] for s in SECTIONS],
              "payload_sha256": hashlib.sha256(payload).hexdigest()}
    head = json.dumps(header, sort_keys=True).encode()
    return _PREFIX.pack(MAGIC, VERSION, len(head)) + head + payload


def save(path, key: dict, derived: DerivedTokenizer) -> bool:
    """Write the cache atomically; False when the directory is not writable (read-only
    medium, permissions, full disk): the caller then keeps the form in memory only."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(path, encode(key, derived))
    except (OSError, K3IOError):      # K3IOError: atomic's write failures, file named
        return False
    return True


# ---- reading -------------------------------------------------------------------------

class _Bad(Exception):
    """The file is not a current, intact cache (the message says why)."""


def load(path, key: dict):
    """The cached form, or None when the file is absent, stale (another key or version)
    or damaged in any way; every invariant of the format is checked."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    try:
        return decode(data, key)
    except _Bad:
        return None


def decode(data: bytes, key: dict) -> DerivedTokenizer:
    """Parse and validate a cache file's bytes against ``key`` (raises _Bad)."""
    if len(data) < _PREFIX.size:
        raise _Bad("shorter than its prefix")
    magic, version, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise _Bad("magic or version")
    try:
        header = json.loads(data[_PREFIX.size:_PREFIX.size + hlen])
        if header["key"] != key:
            raise _Bad("stale key")
        n, m, whole_only = header["n_ranks"], header["n_merges"], header["whole_only"]
        names = [s for s, _ in header["sections"]]
        sizes = [int(b) for _, b in header["sections"]]
        digest = header["payload_sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise _Bad(f"header: {e}") from None
    payload = data[_PREFIX.size + hlen:]
    if names != list(SECTIONS) or sum(sizes) != len(payload) \
            or hashlib.sha256(payload).hexdigest() != digest:
        raise _Bad("sections or checksum")
    parts, at = {}, 0
    for name, size in zip(names, sizes):
        parts[name] = payload[at:at + size]
        at += size
    try:
        offsets = np.frombuffer(parts["rank_offsets"], "<u4").astype(np.int64)
        merges = np.frombuffer(parts["merges"], "<i4").reshape(-1, 2)
        vocab = parts["vocab"].decode("utf-8").split("\n") if n else []
    except ValueError as e:
        raise _Bad(f"sections: {e}") from None
    blob = parts["rank_bytes"]
    if offsets.size != n + 1 or offsets[0] != 0 or offsets[-1] != len(blob) \
            or np.any(np.diff(offsets) < 1) or len(vocab) != n or merges.shape[0] != m \
            or (m and (merges.min() < 0 or merges.max() >= n)) or not 0 <= whole_only <= n:
        raise _Bad("inconsistent sections")
    cut = offsets.tolist()
    ranks = [blob[cut[i]:cut[i + 1]] for i in range(n)]
    return DerivedTokenizer(ranks, vocab, merges, int(whole_only))
