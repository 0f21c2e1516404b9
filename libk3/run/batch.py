"""Batch prompt files for cron: one JSON object per line in, one result line per prompt out.

Owns: parsing and validating batch lines, skipping ids already present in the results
file (so a rerun after a crash continues), appending each result durably as it finishes.
Does not own: generation (``libk3.engine.generate``) or the CLI.

Input line: {"id": str|int (required, unique), "prompt": str | "ids": [int] | "messages":
[message] (exactly one; "messages" with optional "tools" and "template_kwargs", rendered
with the model's chat template, formats/chat.md), optional "gen", "stop" (str or list of
str), "stop_ids" ([int]) and the sampling fields "temperature", "top_p", "top_k",
"min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
"logit_bias" ({"id": bias}) and "response_format" (OpenAI's: {"type": "json_object"} or
{"type": "json_schema", "json_schema": {"schema": {...}}}, ``grammar``), and as on the
server's chat endpoint "n", "logprobs", "top_logprobs" and, with "messages",
"reasoning_effort", "tool_choice", "parallel_tool_calls"}: a
``request.model.ChatGeneration`` with an id (``BatchLine``), each field checked by its rule
(``settings.gen_or_until_end_problem``, ``settings.SAMPLING_RULES``,
``settings.logit_bias_problem``); any other field is refused with the wording every
surface gives it (``request.fields.refusal``). A malformed line, or one with a bad
setting, is reported with its line number and skipped; it never stops the batch.
Lines are split on b"\n" only (U+2028 and U+2029 are legal inside a JSON string, and a
trailing \r is JSON whitespace) and each is decoded as strict UTF-8: invalid bytes are
that line's error, never replaced; so is a string the JSON escapes into a lone surrogate
(``libk3.text.encodable``).

Results file: one k3 result object per line (an object with "id", "line", "prompt_ids"
and "generated_ids"). Before appending, the file is checked (``open_results``): every
complete line must be a k3 result, else it is someone else's file and is refused untouched;
only a last line torn by a crash (no newline, starts with ``{"``, and not complete JSON
other than a k3 result) is dropped.

Sharding (``--shard K/N``, docs/batch.md): a line belongs to shard
``shard_of(id, N)`` = 1 + (the first 8 bytes, big-endian, of SHA-256 of the UTF-8 bytes of
``json.dumps(id)``) mod N, so N machines split one file with no coordination and every
id lands in exactly one shard. ``json.dumps`` with Python's defaults (ensure_ascii: non-ASCII
escaped) is also the key that finished ids are matched by: "7" and 7 are different ids.
"""

from __future__ import annotations

import hashlib
import json
import sys
import os
import stat
from pathlib import Path
from typing import Annotated

from pydantic import Field

from ..errors import FormatError, K3IOError
from ..io.atomic import write_error
from ..io.bounded import bounded_lines
from ..text.encodable import TextError, decode_text, field_problem
from ..engine.generate import GenSettings
from ..request.model import ChatGeneration, Problem, check, ruled
from ..request.settings import settings_over

RESULT_KEYS = ("id", "line", "prompt_ids", "generated_ids")
# fields that only a conversation's rendering or reply reads
CHAT_ONLY = ("reasoning_effort", "tool_choice", "parallel_tool_calls")


def _id_problem(value):
    ok = isinstance(value, (str, int)) and not isinstance(value, bool)
    return None if ok else "must be a string or an integer"


class BatchLine(ChatGeneration):
    """A batch line: a generation request with what a chat request may also ask (``n``,
    ``logprobs``, ``reasoning_effort``, ``tool_choice``: ``ChatGeneration``, k3's field
    names, the server's rules) and its ``id``; no other field (``request.fields.BATCH``)."""
    id: Annotated[str | int, ruled(_id_problem, (str, int))] = Field(
        None, validate_default=True)


class BatchLineError(ValueError):
    pass


# a batch line's bound (``line_bound``): a byte of its text takes at most 6 bytes of JSON
# ("\u0001"), an id of "ids" at most 16 (digits, a comma, spaces), and its other fields
# (settings, tools, a schema of at most 64 KiB) get room
JSON_BYTES_PER_BYTE = 6
JSON_BYTES_PER_ID = 16
LINE_ROOM = 1 << 20


def line_bound(context: int, longest_token_bytes: int | None) -> int:
    """The most bytes a batch line can hold and still fit ``context`` tokens: a text of
    more than context x the longest token's bytes cannot (every token covers at least one
    byte), nor more than context ids, written as JSON, plus room for the line's other
    fields. ``longest_token_bytes`` None: a model without a tokenizer (ids only)."""
    per = max(JSON_BYTES_PER_BYTE * (longest_token_bytes or 0), JSON_BYTES_PER_ID)
    return per * context + LINE_ROOM


def read_lines(path, max_bytes: int):
    """(line number from 1, raw bytes or ``bounded.Oversize``) of every line of a batch
    file, split on b"\\n" only, read one line at a time: a line over ``max_bytes`` is
    measured and dropped, never held (``bounded.bounded_lines``). A path that is not a
    regular file (``/dev/zero``, a FIFO) is refused at once (FormatError): it could grow
    without end or block. ``-`` is standard input (the user chose to pipe it)."""
    if path == "-":
        yield from bounded_lines(sys.stdin.buffer, max_bytes)
        return
    p = Path(path)
    _check_regular(p, "the batch file", "the batch file")
    try:
        f = open(p, "rb")
    except OSError as e:
        raise K3IOError(f"cannot read the batch file: {e.strerror or e}", path=p) from None
    with f:
        yield from bounded_lines(f, max_bytes)


def parse_line(line: bytes, vocab_size: int) -> dict:
    try:
        text = decode_text(line)
    except TextError as e:
        raise BatchLineError(f"{e} of the line") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BatchLineError(f"not valid JSON ({e.msg})") from None
    except (ValueError, RecursionError) as e:     # a 5,000-digit number, deep nesting
        raise BatchLineError(f"not valid JSON ({str(e)[:80] or type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise BatchLineError("not a JSON object")
    bad = field_problem(obj)            # a "\ud800" escape: refused here, not mid-batch
    if bad:
        raise BatchLineError(bad[1])
    try:
        line = check(BatchLine, obj, "batch", vocab_size=vocab_size, until_end=True)
    except Problem as e:
        raise BatchLineError(e.message) from None
    if (line.prompt is not None) + (line.ids is not None) + ("messages" in obj) != 1:
        raise BatchLineError("give exactly one of \"prompt\", \"ids\" and \"messages\"")
    chat_only = [k for k in CHAT_ONLY if obj.get(k) is not None]
    if chat_only and "messages" not in obj:
        raise BatchLineError(f"\"{chat_only[0]}\" needs \"messages\"")
    return {**obj, "stop": list(line.stop)}


def alternatives(job: dict) -> int | None:
    """Alternatives per token whose log-probabilities a parsed line asks for (None:
    none): ``top_logprobs`` with ``logprobs`` true (``model.ChatGeneration``)."""
    return (job.get("top_logprobs") or 0) if job.get("logprobs") else None


def job_settings(job: dict, base: GenSettings) -> GenSettings:
    """A parsed line's settings over the run's (``request.settings.settings_over``): each
    field the line gives replaces the option's (a "logit_bias" the whole of --logit-bias,
    {} none; a "response_format" that of --response-format, {"type": "text"} none)."""
    return settings_over(job, base)


_BAD = object()        # what _json returns for a line that is not JSON


def _json(line: bytes):
    """The line's JSON value, or _BAD (not JSON, a 5,000-digit number, deep nesting)."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return _BAD


def _is_result(obj) -> bool:
    return isinstance(obj, dict) and all(k in obj for k in RESULT_KEYS)


def check_results_path(results_path) -> None:
    """FormatError at once when ``results_path`` exists and is not a regular file (a
    directory, a FIFO that would block the run, a device): results are appended to a
    file, nothing else."""
    _check_regular(Path(results_path), "the results file", "the results path",
                   missing_ok=True, hint="give --out a file")


def _check_regular(p: Path, reading: str, named: str, missing_ok=False, hint=None) -> None:
    """K3IOError when ``p`` cannot be looked at (unless it is absent and ``missing_ok``),
    FormatError when it is not a regular file: it could block or grow without end."""
    try:
        regular = stat.S_ISREG(p.stat().st_mode)
    except OSError as e:
        if missing_ok and isinstance(e, FileNotFoundError):
            return
        raise K3IOError(f"cannot read {reading}: {e.strerror}", path=p) from None
    if not regular:
        raise FormatError(f"{named} is not a regular file", path=p, hint=hint)


def context_problem(n_prompt: int, gen: int, context: int,
                    name: str = "the model's context") -> str | None:
    """Why a prompt of ``n_prompt`` tokens and ``gen`` more (-1: until the end) do not fit
    ``context`` tokens (``name``: what that context is), or None."""
    if n_prompt > context:
        return f"the prompt is {n_prompt:,} tokens, over {name} of {context:,}"
    if gen >= 0 and n_prompt + gen > context:
        return (f"the prompt's {n_prompt:,} tokens and \"gen\" {gen:,} run past "
                f"{name} of {context:,}")
    return None


def open_results(results_path) -> set:
    """Check ``results_path`` before any append and return the ids already in it (as
    ``json.dumps(id)``). Every complete line must be a k3 result, else it is someone
    else's file, refused (FormatError) and left untouched. A last line without its
    newline that starts like a k3 result (``{"``) and is not complete JSON other than a k3
    result is a write a crash tore: it is dropped, so appends stay line-aligned (its id
    runs again). Any other last line is refused as above."""
    p = Path(results_path)
    done, lineno, kept, tail = set(), 0, 0, b""
    try:
        if not p.exists():
            return done
        with open(p, "rb") as f:            # one line at a time: the file is never held
            for line in f:
                lineno += 1
                if not line.endswith(b"\n"):
                    tail = line
                    break
                row = _json(line[:-1])
                if not _is_result(row):
                    raise _not_results(p, lineno)
                done.add(id_key(row["id"]))
                kept += len(line)
    except OSError as e:
        raise K3IOError(f"cannot read the results file: {e.strerror}", path=p) from None
    if tail:
        tail_row = _json(tail)
        if not (tail.startswith(b'{"') and (_is_result(tail_row) or tail_row is _BAD)):
            raise _not_results(p, lineno)
        try:
            with open(p, "r+b") as f:
                f.truncate(kept)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise write_error(p, e) from None
    return done


def _not_results(p, lineno: int) -> FormatError:
    return FormatError(f"not a k3 results file (line {lineno} is not a k3 result); refusing "
                       "to append to it", path=p,
                       hint="give --out a new file or an earlier results file")


def id_key(job_id) -> str:
    """What tells ids apart: their text. An integer id and the string of its digits are
    one id (a script reading the results with `jq -r .id` could not tell them apart), so
    the second is a duplicate, and a result under either finishes both."""
    return str(job_id)


def append_result(results_path, obj: dict) -> None:
    try:
        with open(results_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise write_error(results_path, e) from None


def summary_text(summary: dict, results_path) -> str:
    """The one stderr line a batch run ends with (cron logs keep it)."""
    if summary["stopped"] == "deadline" and summary["remaining"] is None:
        return f"batch: deadline passed while waiting for the lock on {results_path}; nothing run"
    text = (f"batch: {summary['done']} done, {summary['skipped']} already in {results_path}, "
            f"{summary['malformed']} malformed line(s)")
    if summary["stopped"] is not None:
        text += f"; stopped at {summary['stopped']}, {summary['remaining']} left for the next run"
    if summary.get("cut_off"):
        text += (f" ({summary['cut_off']} cut off in flight, {summary['discarded_tokens']} "
                 "generated tokens discarded)")
    return text


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
