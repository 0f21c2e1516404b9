"""Snapshots of sequence states on disk, found again by the token ids they hold.

Owns: the prefix cache directory (formats/prefix-cache.md): naming a snapshot by its
weights, pack and exact ids, finding the longest cached prefix of a prompt, writing a
snapshot atomically, refusing (and removing) one that fails its checks, and keeping the
directory within its byte budget, least recently used out. Does not own: which prefixes
are worth keeping (``libk3.run.prefixes`` for batch files, the server's turn cache), the
state file's format (``libk3.model.state``) or the forward.

Why the file name carries the key: a lookup lists the directory and hashes the prompt
only at the lengths found there, with no index to keep consistent between processes; two
processes sharing the folder need no lock (every write is a rename, every read opens a
whole file, a file removed while open stays readable).
Why a snapshot is never trusted on its name alone: it is loaded through ``State.load``
(checksum, model, weights, finite arrays) and its ids compared to the prompt's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time
from pathlib import Path

import numpy as np

from ..errors import K3Error
from ..model.state import State, array_layout

SUFFIX = ".k3state"
KEY_VERSION = "k3-prefix/1"
_NAME = re.compile(r"^(\d{7})-([0-9a-f]{40})\.k3state$")
_TEMP = re.compile(r"^\..+\.k3state\.(\d+)\.tmp$")
STALE_TEMP_SECONDS = 3600      # a temporary this old whose writer is gone is removed


def default_directory(pack_dir=None) -> Path:
    """``--prefix-cache auto``: ``prefix-cache`` in the pack directory, else in k3's
    per-user cache directory."""
    if pack_dir is not None:
        return Path(pack_dir) / "prefix-cache"
    from ..io.tokenizer_cache import user_cache_dir
    return user_cache_dir() / "prefix-cache"


@dataclasses.dataclass
class Entry:
    """One snapshot file: its path, the tokens it holds, bytes, last use (mtime)."""
    path: Path
    tokens: int
    size: int
    used: float


def context_key(weights_identity: str, pack_identity: str) -> bytes:
    """What every name hashes first: the format's version, the weights and the pack."""
    return f"{KEY_VERSION}\n{weights_identity}\n{pack_identity}\n".encode()


def _ids_bytes(ids) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def snapshot_name(context: bytes, ids) -> str:
    """``NNNNNNN-<40 hex>.k3state``: the token count, then the sha256 (first 160 bits) of
    ``context`` and the ids as little-endian u32."""
    h = hashlib.sha256(context)
    h.update(_ids_bytes(ids))
    return f"{len(ids):07d}-{h.hexdigest()[:40]}{SUFFIX}"


def list_entries(directory) -> list:
    """The snapshots in ``directory`` (files named as ``snapshot_name``), oldest use first."""
    out = []
    try:
        with os.scandir(directory) as it:
            for d in it:
                m = _NAME.match(d.name)
                if not m:
                    continue
                try:
                    st = d.stat()
                except OSError:          # removed meanwhile by another process
                    continue
                out.append(Entry(Path(d.path), int(m.group(1)), st.st_size, st.st_mtime))
    except FileNotFoundError:
        return []
    return sorted(out, key=lambda e: (e.used, e.path.name))


class PrefixCache:
    """The snapshots of one model (``weights_identity``) streamed from one pack
    (``pack_identity``; "shards" without one) in ``directory``, at most ``budget_bytes``
    in all (every model's snapshots in the folder count). ``min_tokens``: shorter
    prefixes are not worth a file. ``warn(line)`` hears a snapshot refused or a write that
    failed (the run goes on without it). ``stats``: lookups, hits, tokens reused, writes."""

    def __init__(self, directory, budget_bytes: int, cfg, weights_identity: str,
                 pack_identity: str, *, min_tokens: int = 1, warn=None):
        self.directory = Path(directory)
        self.budget_bytes = int(budget_bytes)
        self.cfg = cfg
        self.weights_identity = weights_identity
        self.context = context_key(weights_identity, pack_identity)
        self.min_tokens = max(1, int(min_tokens))
        self.warn = warn or (lambda line: None)
        self.writable = True
        self.stats = {"lookups": 0, "hits": 0, "reused_tokens": 0, "writes": 0,
                      "refused": 0}

    def name(self, ids) -> str:
        return snapshot_name(self.context, ids)

    def path(self, ids) -> Path:
        return self.directory / self.name(ids)

    def lookup(self, ids, limit: int | None = None, above: int = 0):
        """(State, n): the snapshot of the longest prefix of ``ids`` at most ``limit``
        tokens long (default: all but the last, which must be fed for its logits) and
        longer than ``above`` (one already at hand), loaded and checked; (None, 0) when
        there is none. A snapshot that fails a check is removed with one warning line and
        the next shorter one tried."""
        self.stats["lookups"] += 1
        ids = [int(i) for i in ids]
        limit = len(ids) - 1 if limit is None else min(limit, len(ids))
        lengths = sorted({e.tokens for e in list_entries(self.directory)
                          if max(self.min_tokens, above + 1) <= e.tokens <= limit})
        names, h, done = {}, hashlib.sha256(self.context), 0
        for n in lengths:                      # one pass over the ids, hashed incrementally
            h.update(_ids_bytes(ids[done:n]))
            done = n
            names[n] = f"{n:07d}-{h.copy().hexdigest()[:40]}{SUFFIX}"
        for n in reversed(lengths):
            path = self.directory / names[n]
            state = self._load(path, ids[:n])
            if state is not None:
                self.stats["hits"] += 1
                self.stats["reused_tokens"] += n
                return state, n
        return None, 0

    def _load(self, path: Path, ids):
        try:
            state = State.load(self.cfg, path, self.weights_identity)
        except FileNotFoundError:
            return None
        except K3Error as e:
            if not path.exists():            # evicted between the listing and the read
                return None
            self._refuse(path, e.one_line())
            return None
        if state.ids != ids:
            self._refuse(path, "it holds other token ids than its name says")
            return None
        _touch(path)
        return state

    def _refuse(self, path: Path, why: str) -> None:
        self.stats["refused"] += 1
        self.warn(f"prefix cache: {path.name} refused and removed ({why}); its prefix is "
                  "recomputed")
        _unlink(path)

    def store(self, state) -> Path | None:
        """Keep a snapshot of ``state`` (keyed by its ids) unless it is too short, one is
        already there (then it counts as used), it alone exceeds the budget, or writing
        fails (one warning; later stores are skipped). Evicts least recently used
        snapshots to fit the budget. Returns the snapshot's path, or None."""
        if not self.writable or state.pos < self.min_tokens:
            return None
        path = self.path(state.ids)
        if path.exists():
            _touch(path)
            return path
        if state_file_bytes(state) > self.budget_bytes:
            return None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            state.save(path, self.weights_identity)
        except (K3Error, OSError) as e:
            self.writable = False
            self.warn(f"prefix cache: cannot write to {self.directory} "
                      f"({e.one_line() if isinstance(e, K3Error) else e}); going on without "
                      "saving snapshots")
            return None
        self.stats["writes"] += 1
        self.evict(keep=path)
        return path

    def evict(self, keep: Path | None = None) -> int:
        """Remove least recently used snapshots until the folder fits the budget (never
        ``keep``), and temporaries left by writers that are gone; -> bytes removed."""
        _remove_stale_temps(self.directory)
        entries = list_entries(self.directory)
        total = sum(e.size for e in entries)
        freed = 0
        for e in entries:
            if total <= self.budget_bytes:
                break
            if keep is not None and e.path == keep:
                continue
            if _unlink(e.path):
                freed += e.size
            total -= e.size
        return freed

    def summary(self) -> dict:
        entries = list_entries(self.directory)
        return {**self.stats, "directory": str(self.directory), "entries": len(entries),
                "bytes": sum(e.size for e in entries), "budget_bytes": self.budget_bytes}


def state_file_bytes(state) -> int:
    """The bytes of ``state``'s arrays in its file (formats/state.md; the header and
    framing are a few KB more)."""
    return sum(4 * int(np.prod(shape, dtype=np.int64))
               for _, shape in array_layout(state.cfg, state.pos))


def _touch(path: Path) -> None:
    """Mark a snapshot as just used (its mtime is its last use)."""
    try:
        os.utime(path)
    except OSError:
        pass


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return False


def _remove_stale_temps(directory: Path) -> None:
    """Temporaries (``.<name>.<pid>.tmp``, ``libk3.io.atomic``) whose writer is gone and
    that are over an hour old: a writer killed mid-write."""
    now = time.time()
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        m = _TEMP.match(name)
        if not m or _alive(int(m.group(1))):
            continue
        path = directory / name
        try:
            if now - path.stat().st_mtime > STALE_TEMP_SECONDS:
                os.unlink(path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
