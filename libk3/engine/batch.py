"""Batch prompt files for cron: one JSON object per line in, one result line per prompt out.

Owns: parsing and validating batch lines, skipping ids already present in the results
file (so a rerun after a crash continues), appending each result durably as it finishes.
Does not own: generation (``libk3.engine.generate``) or the CLI.

Input line: {"id": str|int (required, unique), "prompt": str | "ids": [int] (exactly one),
optional "gen", "temperature", "top_p", "seed", "stop" (list of str), "stop_ids"}.
A malformed line is reported with its line number and skipped; it never stops the batch.
Lines are split on b"\n" only (U+2028 and U+2029 are legal inside a JSON string, and a
trailing \r is JSON whitespace) and each is decoded as strict UTF-8: invalid bytes are
that line's error, never replaced.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

_SETTINGS = {"gen": int, "temperature": (int, float), "top_p": (int, float), "seed": int}


class BatchLineError(ValueError):
    pass


def read_lines(path):
    """(line number from 1, raw bytes) of every line of a batch file, split on b"\n" only."""
    return enumerate(Path(path).read_bytes().split(b"\n"), start=1)


def parse_line(line: bytes, vocab_size: int) -> dict:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BatchLineError(f"not valid UTF-8 at byte offset {e.start} of the line") from None
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


def summary_text(summary: dict, results_path) -> str:
    """The one stderr line a batch run ends with (cron logs keep it)."""
    text = (f"batch: {summary['done']} done, {summary['skipped']} already in {results_path}, "
            f"{summary['malformed']} malformed line(s)")
    if summary["stopped"] == "deadline" and summary["remaining"] is None:
        return f"batch: deadline passed while waiting for the lock on {results_path}; nothing run"
    if summary["stopped"] is not None:
        text += f"; stopped at {summary['stopped']}, {summary['remaining']} left for the next run"
    return text
