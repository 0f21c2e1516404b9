"""Prompt files: the exact text of a ``--prompt-file``, or a one-line refusal.

Owns: reading a prompt file as bytes (CRLF and lone CR kept: no newline translation),
strict UTF-8 decoding (invalid bytes refused with their offset, never replaced), and the
size bound that lets a prompt too large for the model's context be refused before it is
read. Does not own: tokenization (``libk3.text.tokenizer``) or the context length
(``libk3.config.context_length``).

The bound: every token of a prompt (encoded without specials) is one BPE rank, at least
one byte and at most ``longest_rank_bytes`` of the text. So a file of n bytes encodes to
between n / longest_rank_bytes and n tokens: a file over context x longest_rank_bytes
bytes cannot fit and is refused from its size; one at or under it is read (at most that
many bytes) and its token count checked exactly after encoding.
"""

from __future__ import annotations

import sys

from ..errors import FormatError
from ..io.bounded import read_bounded
from ..text.encodable import TextError, decode_text


def prompt_byte_bound(context_tokens: int, longest_rank_bytes: int) -> int:
    """The largest prompt file, in bytes, that could encode to ``context_tokens`` tokens."""
    return context_tokens * longest_rank_bytes


def read_prompt_file(path, max_bytes: int) -> str:
    """The file's text exactly as stored (``-``: standard input's bytes, up to the
    bound). FormatError naming the file when it is not a regular file (a FIFO, a device:
    ``read_bounded``), is larger than ``max_bytes`` (checked before reading it; a file
    that grows while being read is caught at max_bytes + 1) or is not valid UTF-8 (with
    the byte offset)."""
    too_big = "prompt file is larger than the model's context can hold"
    if path == "-":
        return _decoded(sys.stdin.buffer.read(max_bytes + 1), max_bytes, path, too_big)
    try:
        data = read_bounded(path, max_bytes, "the prompt file")
    except FormatError as e:
        if e.expected is None:
            raise
        raise FormatError(too_big, path=path, expected=e.expected, found=e.found) from None
    return _decoded(data, max_bytes, path, too_big)


def _decoded(data: bytes, max_bytes: int, path, too_big: str) -> str:
    if len(data) > max_bytes:
        raise FormatError(too_big, path=path, expected=f"<= {max_bytes} bytes",
                          found=f"more than {max_bytes} bytes")
    try:
        return decode_text(data)
    except TextError as e:
        raise FormatError(f"prompt file is {e}", path=path,
                          found=repr(data[e.offset:e.offset + 4])) from None
