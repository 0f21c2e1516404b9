"""Text k3 can encode: the one check every text passes where it enters k3.

Owns: strict UTF-8 decoding of bytes (the byte offset of the first invalid one), and
finding a lone UTF-16 surrogate in a string or anywhere in a JSON value (its strings and
its keys), named by where it is. Does not own: the places text enters (the server's
request bodies and headers, batch lines, prompt files, options, template output); each
calls this once and refuses in its own way (a 4xx, a skipped line, an exit code).

Why: a JSON escape such as ``"\\ud800"``, bytes decoded with ``surrogatepass`` (JSON's
own rule for bytes) and argv or stdin decoded with ``surrogateescape`` all give Python
strings that UTF-8 cannot encode. Let in, such a string fails far from where it came
from (a stop string turned to bytes in the middle of a lockstep pass takes the
requests decoding beside it down), so it is refused at the door, naming the field.
"""

from __future__ import annotations


class TextError(ValueError):
    """Bytes that are not UTF-8; ``offset`` is the first invalid byte's."""

    def __init__(self, message: str, offset: int):
        super().__init__(message)
        self.offset = offset


def decode_text(data: bytes) -> str:
    """``data`` as strict UTF-8 (invalid bytes are refused, never replaced; UTF-8 never
    decodes to a surrogate); TextError with the offset of the first invalid byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TextError(f"not valid UTF-8 at byte offset {e.start}", e.start) from None


def text_problem(value, where: str) -> str | None:
    """Why ``value`` (a str, or a JSON value of dicts, lists and scalars) holds text k3
    cannot encode, naming the place (``where``, then the keys and indices down to the
    string: ``"messages"[1]["content"]``); None when every string in it is fine."""
    if isinstance(value, str):              # the common case
        return _lone(where, value)
    stack = [(value, where)]
    while stack:
        value, at = stack.pop()
        if isinstance(value, str):
            why = _lone(at, value)
            if why:
                return why
        elif isinstance(value, dict):
            for key in value:
                why = (_lone(f"a key of {at}", key)
                       if isinstance(key, str) and not key.isascii() else None)
                if why:
                    return why
            # reversed onto the stack, so the first bad string in document order is named
            stack.extend((item, f"{at}[{_quoted(key)}]")
                         for key, item in reversed(value.items()) if _holds_text(item))
        elif isinstance(value, (list, tuple)) and not _TEXTY.isdisjoint(map(type, value)):
            stack.extend((value[i], f"{at}[{i}]")
                         for i in reversed(range(len(value))) if _holds_text(value[i]))
    return None


def field_problem(obj: dict):
    """(name, why) of the first field of a JSON object whose name or value holds text k3
    cannot encode (``text_problem``, the field named in double quotes); None when none
    does."""
    for name, value in obj.items():
        why = text_problem(name, "a field name") or text_problem(value, f'"{name}"')
        if why:
            return name, why
    return None


# What may hold a string: a list of a million token ids is passed over at C speed.
_TEXTY = frozenset((str, dict, list, tuple))


def _holds_text(value) -> bool:
    return isinstance(value, (str, dict, list, tuple))


def _lone(where: str, text: str) -> str | None:
    """Why ``text`` cannot be encoded (its first lone surrogate), or None. Any surrogate
    code point in a str is a lone one: decoders join the pairs they read."""
    at = first_surrogate(text)
    if at is None:
        return None
    return (f"{where} holds a lone surrogate U+{ord(text[at]):04X} at character {at}: not "
            "Unicode text (UTF-8 cannot encode it)")


def first_surrogate(text: str) -> int | None:
    """The index of the first surrogate code point of ``text`` (which UTF-8 cannot
    encode: decoders join the pairs they read, so any left is a lone one), or None."""
    if text.isascii():                      # at C speed, as is the encoding below
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _quoted(key) -> str:
    return f'"{key}"' if isinstance(key, str) else str(key)
