"""Snapshots of sequence states on disk, found again by the token ids they hold.

Owns: the prefix cache directory (formats/prefix-cache.md): naming a snapshot by its
weights, pack and exact ids, finding the longest cached prefix of a prompt, writing a
snapshot atomically, refusing (and removing) one that fails its checks, and keeping the
directory within its byte budget, least recently used out; what ``k3-pack cache``
lists, checks and removes. Does not own: which prefixes are worth keeping
(``libk3.run.prefixes`` for batch files, the server's turn cache), the state file's
format (``libk3.model.state``), the forward, or printing (``k3-pack cache``).

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

from ..errors import FormatError, K3Error, UsageError
from ..model.state import State, array_layout, read_meta

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
    from ..text.tokenizer_cache import user_cache_dir
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
                if not m or not d.is_file(follow_symlinks=False):
                    continue
                try:
                    st = d.stat()
                except OSError:          # removed meanwhile by another process
                    continue
                out.append(Entry(Path(d.path), int(m.group(1)), st.st_size, st.st_mtime))
    except OSError:               # no folder yet, or one that cannot be read: no snapshots
        return []
    return sorted(out, key=lambda e: (e.used, e.path.name))


class PrefixCache:
    """The snapshots of one model (``weights_identity``) streamed from one pack
    (``pack_identity``; "shards" without one) in ``directory``, at most ``budget_bytes``
    in all (every model's snapshots in the folder count). ``min_tokens``: shorter
    prefixes are not worth a file. ``warn(line)`` hears a snapshot refused or a write that
    failed (the run goes on without it). ``draft_identity``: a drafting run's draft
    (``libk3.draft.checkpoint.draft_identity``); a snapshot without that draft's context
    is then a miss, and replaced when this run stores the same prefix with it (resuming
    from it would leave drafting off for the whole sequence). ``stats``: lookups, hits,
    tokens reused, writes."""

    def __init__(self, directory, budget_bytes: int, cfg, weights_identity: str,
                 pack_identity: str, *, min_tokens: int = 1, warn=None,
                 draft_identity: str | None = None):
        self.directory = Path(directory)
        self.budget_bytes = int(budget_bytes)
        self.cfg = cfg
        self.weights_identity = weights_identity
        self.context = context_key(weights_identity, pack_identity)
        self.min_tokens = max(1, int(min_tokens))
        self.warn = warn or (lambda line: None)
        self.draft_identity = draft_identity
        self.writable = True
        self.stats = {"lookups": 0, "hits": 0, "reused_tokens": 0, "writes": 0,
                      "refused": 0, "without_draft": 0, "load_seconds": 0.0,
                      "write_seconds": 0.0}

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

    def _lacks_draft(self, path: Path) -> bool:
        """Whether a drafting run must pass this snapshot by: its header records no
        context of this run's draft. An unreadable header is left to ``State.load``."""
        if self.draft_identity is None:
            return False
        try:
            draft = read_meta(path).get("draft")
        except (K3Error, AttributeError):
            return False
        return not (isinstance(draft, dict) and draft.get("identity") == self.draft_identity)

    def _load(self, path: Path, ids):
        if self._lacks_draft(path):
            self.stats["without_draft"] += 1
            return None
        t0 = time.perf_counter()
        try:
            state = State.load(self.cfg, path, self.weights_identity)
        except FileNotFoundError:
            return None
        except K3Error as e:
            if not path.exists():            # evicted between the listing and the read
                return None
            self._refuse(path, e.one_line())
            return None
        finally:
            self.stats["load_seconds"] += time.perf_counter() - t0
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
        already there (then it counts as used; one without this run's draft context is
        replaced when ``state`` has it), it alone exceeds the budget, or writing fails
        (one warning; later stores are skipped). Evicts least recently used snapshots to
        fit the budget. Returns the snapshot's path, or None. A state holding image rows
        is never kept: its ids do not say which image (formats/model/vision.md §8.3)."""
        if not self.writable or state.pos < self.min_tokens or state.media:
            return None
        path = self.path(state.ids)
        if path.exists() and not (self.draft_identity is not None and self._lacks_draft(path)
                                  and state.draft_identity() == self.draft_identity):
            _touch(path)
            return path
        if state_file_bytes(state) > self.budget_bytes:
            return None
        t0 = time.perf_counter()
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
        self.stats["write_seconds"] += time.perf_counter() - t0
        self.evict(keep=path)
        return path

    def evict(self, keep: Path | None = None) -> int:
        """Remove least recently used snapshots until the folder fits the budget (never
        ``keep``), and temporaries left by writers that are gone; -> bytes removed."""
        remove_stale_temps(self.directory)
        freed = 0
        for e in over_budget(list_entries(self.directory), self.budget_bytes, keep=keep):
            if _unlink(e.path):
                freed += e.size
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


# Managing the folder by hand (``k3-pack cache ls|verify|rm``): what each command shows,
# checks or removes is decided here; the front end only prints.

def describe(entry: Entry) -> dict:
    """What ``k3-pack cache ls`` shows of a snapshot: its name, tokens, bytes, last use
    (unix time), and from its header the weights identity and config fingerprint (None
    when the header cannot be read). The checksum is not read: a listing stays instant
    on GB-sized files (``check_entry`` reads every byte)."""
    try:
        meta = read_meta(entry.path)
    except FormatError:
        meta = {}

    def text(key):
        return meta[key] if isinstance(meta.get(key), str) else None
    return {"name": entry.path.name, "tokens": entry.tokens, "bytes": entry.size,
            "last_used": entry.used, "weights": text("weights"),
            "fingerprint": text("fingerprint")}


def check_entry(entry: Entry) -> FormatError | None:
    """Why the snapshot ``entry`` is bad, or None: the checks that need no model
    (``read_meta`` with ``check``: checksum, arrays that fill the file exactly, finite
    values), and a header holding as many ids as its name's token count. The weights and
    configuration are checked when a run loads it (``PrefixCache.lookup``)."""
    path = entry.path
    try:
        meta = read_meta(path, check=True)
    except FormatError as e:
        # removed since the listing (another process's eviction): gone, not bad
        return e if path.exists() else None
    pos, ids = meta["pos"], meta["ids"]
    if type(pos) is not int or pos != entry.tokens:
        return FormatError("its header holds another token count than its name says",
                           path=path, expected=entry.tokens, found=pos)
    if not isinstance(ids, list) or len(ids) != pos:
        found = f"{len(ids)} ids" if isinstance(ids, list) else type(ids).__name__
        return FormatError("its header's ids are not pos long", path=path,
                           expected=f"{pos} ids", found=found)
    return None


def unused_for(entries, seconds: float, now: float | None = None) -> list:
    """The entries last used more than ``seconds`` ago (``rm --older-than``)."""
    now = time.time() if now is None else now
    return [e for e in entries if now - e.used > seconds]


def over_budget(entries, budget_bytes: int, keep: Path | None = None) -> list:
    """The entries to remove, least recently used first, for the rest to take at most
    ``budget_bytes`` (never ``keep``): ``entries`` oldest use first, as ``list_entries``
    gives them (eviction, ``rm --keep-gb``)."""
    total = sum(e.size for e in entries)
    out = []
    for e in entries:
        if total <= budget_bytes:
            break
        if keep is not None and e.path == keep:
            continue
        out.append(e)
        total -= e.size
    return out


def named(entries, names, directory) -> list:
    """The entries of ``directory`` called ``names`` (file names), each once, in the order
    given; UsageError naming the first that is not a snapshot there, so a typo removes
    nothing (``rm NAME...``)."""
    by_name = {e.path.name: e for e in entries}
    out = {}
    for name in names:
        if name not in by_name:
            why = (f"no snapshot named {name!r}" if _NAME.match(name) else
                   f"{name!r} is not a snapshot's file name (NNNNNNN-<40 hex>.k3state)")
            raise UsageError(why, path=directory,
                             hint=f"give file names as `k3-pack cache ls {directory}` "
                                  "lists them")
        out[name] = by_name[name]
    return list(out.values())


def remove_entries(entries) -> tuple:
    """Remove ``entries``' files: -> (removed, failed), the entries removed and
    (entry, why) for each that could not be; one already gone (another process's
    eviction) is neither. Only snapshot names are ever removed (``list_entries``)."""
    removed, failed = [], []
    for e in entries:
        if not _NAME.match(e.path.name):       # never anything but a snapshot
            continue
        try:
            os.unlink(e.path)
        except FileNotFoundError:
            continue
        except OSError as err:
            failed.append((e, err.strerror or str(err)))
            continue
        removed.append(e)
    return removed, failed


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


def remove_stale_temps(directory) -> int:
    """Temporaries (``.<name>.<pid>.tmp``, ``libk3.io.atomic``) whose writer is gone and
    that are over an hour old: a writer killed mid-write; -> how many were removed."""
    directory = Path(directory)
    now = time.time()
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = _TEMP.match(name)
        if not m or _alive(int(m.group(1))):
            continue
        path = directory / name
        try:
            if now - path.stat().st_mtime > STALE_TEMP_SECONDS:
                os.unlink(path)
                removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
