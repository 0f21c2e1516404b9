"""Batch prompt files for cron: one JSON object per line in, one result line per prompt out.

Owns: parsing and validating batch lines, skipping ids already present in the results
file (so a rerun after a crash continues), appending each result durably as it finishes.
Does not own: generation (``libk3.engine.generate``) or the CLI.

Input line: {"id": str|int (required, unique), "prompt": str | "ids": [int] (exactly one),
optional "gen", "temperature", "top_p", "seed", "stop" (list of str), "stop_ids"}.
A malformed line is reported with its line number and skipped; it never stops the batch.

Sharding (``--shard K/N``, README "Batch files"): a line belongs to shard
``shard_of(id, N)`` = 1 + (the first 8 bytes, big-endian, of SHA-256 of the UTF-8 bytes of
``json.dumps(id)``) mod N, so N machines split one file with no coordination and every
id lands in exactly one shard. ``json.dumps`` with Python's defaults (ensure_ascii: non-ASCII
escaped) is also the key that finished ids are matched by: "7" and 7 are different ids.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_SETTINGS = {"gen": int, "temperature": (int, float), "top_p": (int, float), "seed": int}


class BatchLineError(ValueError):
    pass


def parse_line(text: str, vocab_size: int) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BatchLineError(f"not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise BatchLineError("not a JSON object")
    if "id" not in obj or not isinstance(obj["id"], (str, int)) or isinstance(obj["id"], bool):
        raise BatchLineError("missing or invalid \"id\" (a string or integer)")
    has_prompt, has_ids = "prompt" in obj, "ids" in obj
    if has_prompt == has_ids:
        raise BatchLineError("give exactly one of \"prompt\" and \"ids\"")
    if has_prompt and (not isinstance(obj["prompt"], str) or not obj["prompt"]):
        raise BatchLineError("\"prompt\" must be a non-empty string")
    if has_ids:
        ids = obj["ids"]
        if not isinstance(ids, list) or not ids or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
            raise BatchLineError(f"\"ids\" must be a non-empty list of ids in 0..{vocab_size - 1}")
    for key, typ in _SETTINGS.items():
        if key in obj and (not isinstance(obj[key], typ) or isinstance(obj[key], bool)):
            raise BatchLineError(f"\"{key}\" has the wrong type")
    if obj.get("gen", 0) < 0 or obj.get("temperature", 0) < 0 or not 0 < obj.get("top_p", 1) <= 1:
        raise BatchLineError("gen and temperature must be >= 0 and top_p in (0, 1]")
    stop = obj.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BatchLineError("\"stop\" must be a string or a list of strings")
    obj["stop"] = stop
    return obj


def done_ids(results_path) -> set:
    """Ids already in the results file (a torn last line from a crash is ignored)."""
    p = Path(results_path)
    if not p.exists():
        return set()
    out = set()
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "id" in obj:
            out.add(json.dumps(obj["id"]))
    return out


def repair_tail(results_path) -> None:
    """Drop a torn final line (no newline) left by a crash, so appends stay line-aligned."""
    p = Path(results_path)
    if not p.exists():
        return
    data = p.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(p, "r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())


def append_result(results_path, obj: dict) -> None:
    with open(results_path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def shard_of(job_id, n: int) -> int:
    """The shard (1..n) of a line's id (module docstring)."""
    digest = hashlib.sha256(json.dumps(job_id).encode("utf-8")).digest()
    return 1 + int.from_bytes(digest[:8], "big") % n


def in_shard(job_id, k: int, n: int) -> bool:
    return shard_of(job_id, n) == k


def parse_shard(text: str) -> tuple:
    """'K/N' -> (K, N) with 1 <= K <= N; ValueError otherwise."""
    k, sep, n = text.partition("/")
    try:
        k, n = int(k), int(n)
    except ValueError:
        raise ValueError(f"--shard must be K/N (e.g. 2/8), got {text!r}") from None
    if not sep or not 1 <= k <= n:
        raise ValueError(f"--shard K/N needs 1 <= K <= N, got {text!r}")
    return k, n
