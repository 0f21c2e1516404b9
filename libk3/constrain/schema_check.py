"""Admission of a client's JSON schema: whether k3 can enforce it, decided before the
request takes a lane (docs/run.md "Structured output", docs/serve.md "Errors").

Owns: the checks a schema passes before any sequence decodes under it, on every surface
(a server request's ``response_format`` and tool parameters, ``--response-format``, a
batch line): its size (``SCHEMA_MAX_BYTES`` of canonical JSON), no vendor extension key
of the grammar library in it (``vendor_key``: ``x-guidance`` would override k3's own
settings, such as compact JSON), llguidance's compile within its parser limits, and a
witness: one complete value the grammar accepts, found within ``WITNESS_BYTES`` bytes and
``WITNESS_STEPS`` masks (``witness``). Does not own: the response format's shape and the
token-level grammar (``grammar``), where a failure is reported (callers).

Why a witness: llguidance compiles a schema no finite value satisfies (``{"$ref": "#"}``,
a required recursion) and fails only while decoding, at the first mask or when a forced
run of bytes never ends; a value found on a byte-level vocabulary (each byte a token, as
every byte-level BPE has) is a path the model's own tokens can take. The search is
depth-first and prefers closing bytes outside strings and bytes not yet used inside one,
so ordinary schemas find their witness in about as many masks as it has bytes.
"""

from __future__ import annotations

import functools
import json
import threading

import numpy as np

SCHEMA_MAX_BYTES = 65_536       # canonical JSON text of one schema (compile time: bench/README.md "Schema admission")
WITNESS_BYTES = 8_192           # the longest witness looked for
WITNESS_STEPS = 40_000          # masks computed in the search at most
VENDOR_KEYS = ("x-guidance",)   # keys llguidance reads as its own settings
KEPT = 256                      # verdicts kept, by the schema's canonical text
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_QUOTE, _BACKSLASH, _END = 34, 92, 256
# outside a string: close what is open first, then the shortest scalars
_OUTSIDE = list(b'}]"0123456789ntf,:{[-.eE')
# inside a string: letters, digits, then the punctuation patterns and formats ask for
_INSIDE = list(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.@+ :/")
_INSIDE += [b for b in range(32, 127) if b not in _INSIDE and b not in (_QUOTE, _BACKSLASH)]
_INSIDE += [_BACKSLASH] + list(range(128, 256)) + list(range(32))
_OUTSIDE += [b for b in [_QUOTE] + _INSIDE if b not in _OUTSIDE]
_LOCK = threading.Lock()
_BYTES = []                      # the byte-level LLTokenizer, built once


def vendor_key(schema) -> str | None:
    """Where the first vendor extension key of ``schema`` sits (its path, as
    ``"properties"."a"."x-guidance"``), or None. Walks the schema positions only (a
    property named like one is data), without recursion (any depth)."""
    todo = [("", schema)]
    while todo:
        where, node = todo.pop()
        if not isinstance(node, dict):
            continue
        for key in VENDOR_KEYS:
            if key in node:
                return f"{where}{json.dumps(key)}"
        subs = []
        for k in _ONE:
            if isinstance(node.get(k), dict):
                subs.append((f"{where}{json.dumps(k)}.", node[k]))
        for k in _MANY:
            if isinstance(node.get(k), list):
                subs += [(f"{where}{json.dumps(k)}[{i}].", s) for i, s in enumerate(node[k])]
        for k in _NAMED:
            if isinstance(node.get(k), dict):
                subs += [(f"{where}{json.dumps(k)}.{json.dumps(n)}.", s)
                         for n, s in node[k].items()]
        todo += subs[::-1]              # depth first, in the schema's order
    return None


def vendor_key_problem(schema) -> str | None:
    """Why ``schema`` is refused for holding a vendor extension key, or None."""
    where = vendor_key(schema)
    if where is None:
        return None
    return (f"the schema holds {where}, a setting of the grammar library; k3 sets those "
            "itself (remove the key)")


def schema_problem(schema, options: dict) -> str | None:
    """Why k3 cannot enforce ``schema`` (compiled with llguidance's JSON ``options``), or
    None: too large, a vendor key, refused by the library, or no value within the
    witness bounds. Needs llguidance (the caller has checked it is there)."""
    why = vendor_key_problem(schema)
    if why:
        return why
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        return "the schema is nested too deeply"
    except (TypeError, ValueError) as e:           # a value JSON cannot hold
        return f"the schema is not JSON ({e})"
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > SCHEMA_MAX_BYTES:
        return f"the schema is {size:,} bytes of JSON, over the {SCHEMA_MAX_BYTES:,} k3 takes"
    return _library_problem(text, json.dumps(options, sort_keys=True))


@functools.lru_cache(maxsize=KEPT)
def _library_problem(schema_text: str, options_text: str) -> str | None:
    """``schema_problem``'s checks by the library, of a schema's JSON text (its keys in order:
    a property order is a grammar's; kept: a server sees the same schemas again and again)."""
    import llguidance as llg
    try:
        text = llg.LLMatcher.grammar_from_json_schema(schema_text,
                                                      defaults=json.loads(options_text))
    except (ValueError, TypeError, RecursionError) as e:
        return f"schema refused: {_first_line(e)}"
    why = llg.LLMatcher.validate_grammar(text)
    if why and not why.startswith("WARNING"):
        return f"schema refused: {_first_line(why)}"
    return witness_problem(text)


def _first_line(e) -> str:
    """The message of ``e`` on one line, without llguidance's parser state dump after it
    (a regex error's own lines, the pattern and its caret, are kept)."""
    text = str(e).split("\n<state>")[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines) if lines else type(e).__name__


def _byte_tokenizer():
    """llguidance's tokenizer of 256 one-byte tokens and an end token."""
    import llguidance as llg
    with _LOCK:
        if not _BYTES:
            class Vocab:
                eos_token_id, bos_token_id, special_token_ids = _END, None, [_END]
                tokens = [bytes([i]) for i in range(256)] + [b"\xff<end>"]

                def __call__(self, text):
                    return list(text.encode() if isinstance(text, str) else text)
            _BYTES.append(llg.LLTokenizer(llg.TokenizerWrapper(Vocab()), n_vocab=_END + 1,
                                          eos_token=_END))
    return _BYTES[0]


def witness(grammar: str) -> tuple:
    """(a complete value of ``grammar`` as bytes or None, why none was found)."""
    import llguidance as llg
    m = llg.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if m.is_error():
        return None, f"schema refused: {_first_line(m.get_error())}"
    path, todo, lex, used, steps = [], [], [(False, False)], np.zeros(256, np.int64), 0
    while True:
        if m.is_accepting():
            return bytes(path), ""
        if len(path) >= WITNESS_BYTES:          # preferring to close, it still went on
            return None, ("no value of the schema found within "
                          f"{WITNESS_BYTES:,} bytes (its shortest is longer, or none ends)")
        steps += 1
        if steps > WITNESS_STEPS:
            return None, (f"no value of the schema found within {WITNESS_STEPS:,} "
                          "steps of search")
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8),
                             bitorder="little")[:256]
        inside, escaped = lex[-1]
        if inside and not escaped:
            cands = sorted((b for b in _INSIDE + [_QUOTE] if bits[b]),
                           key=lambda b: (b != _QUOTE, b >= 128, used[b]))
        else:
            cands = [b for b in _OUTSIDE if bits[b]]
        todo.append(cands[::-1])
        while True:
            if not todo:
                return None, "no value satisfies the schema (a recursion without an end?)"
            if todo[-1]:
                b = todo[-1].pop()
                if not m.consume_token(b):
                    return None, ("the grammar library gave up on it (a recursion without an "
                                  f"end, or too complex): {_first_line(m.get_error())}")
                path.append(b)
                lex.append(_lexed(lex[-1], b))
                used[b] += lex[-1][0]
                break
            todo.pop()
            if not path:
                continue
            m.rollback(1)
            used[path.pop()] -= lex.pop()[0]


def _lexed(state: tuple, b: int) -> tuple:
    """(inside a string, after a backslash) once byte ``b`` follows ``state``."""
    inside, escaped = state
    if escaped:
        return True, False
    if inside and b == _BACKSLASH:
        return True, True
    return (not inside if b == _QUOTE else inside), False


def witness_problem(grammar: str) -> str | None:
    """Why ``grammar`` has no witness value within the bounds, or None."""
    value, why = witness(grammar)
    return None if value is not None else why


def request_vendor_key(fmt=None, tools=None) -> tuple | None:
    """(field, why) for the first vendor extension key in a ``response_format``'s schema
    or a tool's ``parameters`` (OpenAI's shapes; anything else is left to their own
    checks), or None."""
    spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
    if isinstance(spec, dict) and spec.get("schema") is not None:
        why = vendor_key_problem(spec["schema"])
        if why:
            return "response_format", why
    for k, tool in enumerate(tools if isinstance(tools, list) else ()):
        fn = tool.get("function") if isinstance(tool, dict) else None
        why = vendor_key_problem(fn.get("parameters")) if isinstance(fn, dict) else None
        if why:
            return "tools", f"tools[{k}] \"parameters\": {why}"
    return None
