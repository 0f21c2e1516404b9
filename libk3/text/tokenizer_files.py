"""The K3 tokenizer's three files read strictly: ranks, added tokens and the split regex.

Owns: reading ``tiktoken.model`` (the ranks), ``tokenizer_config.json`` (the added and
reserved special tokens) and the ``pat_str`` of ``tokenization_kimi.py`` (by parsing it
with ``ast`` and evaluating only string literals, ``+`` and ``"sep".join([...])``; the file
is code from the checkpoint directory and is never executed), byte layout and numbered
invariants in ``formats/tokenizer.md``; and the built-in split regex used when the last
file is absent. Does not own: BPE, encoding or decoding (``libk3.text.tokenizer``), the
derived form's cache (``libk3.text.tokenizer_cache``).
"""

from __future__ import annotations

import ast
import base64
import binascii
import json
import re
from pathlib import Path

from ..errors import CheckpointError

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
KIMI_FILE = "tokenization_kimi.py"

# The K3 split regex as model.md §8.3 lists it (eight alternatives, in this order). Used only
# when a model directory has no tokenization_kimi.py; the released literal is unverified.
K3_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# Stack-safety cuts of tokenization_kimi.py (model.md §8.2, unverified, from copies of the


# ---- tiktoken.model -----------------------------------------------------------------

def read_tiktoken_model(path) -> list:
    """Ranks of ``tiktoken.model`` as a list: element k is the raw bytes of rank k.

    Strict (formats/tokenizer.md T1-T6): one ``<base64> <rank>`` per line with one space,
    ``\\n`` or ``\\r\\n`` endings, empty lines skipped, canonical padded base64 of at least
    one byte, canonical decimal ranks, ranks dense 0..n-1, no rank or byte string twice.
    Every violation names the file and line."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError("tokenizer file missing", path=path,
                              hint="a K3 model directory needs tiktoken.model "
                                   "(model.md §8.1)") from None
    by_rank = {}          # rank -> (bytes, line)
    line_of_bytes = {}    # bytes -> line
    for lineno, raw_line in enumerate(data.split(b"\n"), start=1):
        line = raw_line[:-1] if raw_line.endswith(b"\r") else raw_line
        if not line:
            continue
        fields = line.split(b" ")
        if len(fields) != 2:
            raise CheckpointError(f"line {lineno}: expected '<base64> <rank>' with one space",
                                  path=path, found=_show(line))
        b64, rank_text = fields
        try:
            token = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            token = None
        if not token or base64.b64encode(token) != b64:
            raise CheckpointError(f"line {lineno}: not canonical padded standard base64 of a "
                                  "non-empty token", path=path, found=_show(b64))
        if not rank_text.isdigit() or (len(rank_text) > 1 and rank_text[:1] == b"0"):
            raise CheckpointError(f"line {lineno}: rank is not a decimal integer", path=path,
                                  found=_show(rank_text))
        rank = int(rank_text)
        if rank in by_rank:
            raise CheckpointError(f"line {lineno}: duplicate rank {rank} (first at line "
                                  f"{by_rank[rank][1]})", path=path)
        if token in line_of_bytes:
            raise CheckpointError(f"line {lineno}: duplicate token bytes (first at line "
                                  f"{line_of_bytes[token]})", path=path, found=_show(b64))
        by_rank[rank] = (token, lineno)
        line_of_bytes[token] = lineno
    n = len(by_rank)
    if n == 0:
        raise CheckpointError("no ranks in file", path=path)
    for rank, (_, lineno) in sorted(by_rank.items(), key=lambda kv: kv[1][1]):
        if rank >= n:
            raise CheckpointError(f"line {lineno}: ranks are not dense: rank {rank} in a file "
                                  f"of {n} ranks", path=path, expected=f"ranks 0..{n - 1}",
                                  found=rank)
    return [by_rank[k][0] for k in range(n)]


def _show(raw: bytes, limit: int = 60) -> str:
    text = raw.decode("utf-8", "backslashreplace")
    return repr(text if len(text) <= limit else text[:limit] + "...")


# ---- tokenizer_config.json ----------------------------------------------------------

class _PairsDict(dict):
    """A JSON object that remembers keys it saw twice (json keeps the last silently)."""
    duplicates: tuple = ()


def _pairs_hook(pairs):
    out = _PairsDict(pairs)
    if len(out) != len(pairs):
        seen, dups = set(), []
        for key, _ in pairs:
            if key in seen:
                dups.append(key)
            seen.add(key)
        out.duplicates = tuple(dups)
    return out


def reserved_name(token_id: int) -> str:
    """Content of a special slot the config leaves unnamed (model.md §8.1, unverified)."""
    return f"<|reserved_token_{token_id}|>"


def read_added_tokens(path, n_ranks: int, vocab_size=None) -> dict:
    """``added_tokens_decoder`` of ``tokenizer_config.json`` as {id: content}.

    Strict (formats/tokenizer.md C1-C5; K3Tokenizer applies C6): valid JSON, an object
    ``added_tokens_decoder`` whose keys are canonical decimal ids, no id twice, each value
    an object with a non-empty string ``content``, every id >= n_ranks (no collision with
    a BPE rank) and < vocab_size when given, no content twice. Errors name the file and
    the line of the offending key."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError("tokenizer file missing", path=path,
                              hint="a K3 model directory needs tokenizer_config.json "
                                   "(model.md §8.1)") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"not UTF-8 ({e.reason} at byte {e.start})", path=path) from None
    try:
        doc = json.loads(text, object_pairs_hook=_pairs_hook)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"line {e.lineno}: invalid JSON: {e.msg}", path=path) from None
    except (ValueError, RecursionError) as e:      # a 5,000-digit number, deep nesting
        raise CheckpointError(f"invalid JSON: {str(e)[:200] or type(e).__name__}",
                              path=path) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("added_tokens_decoder"), dict):
        raise CheckpointError("no 'added_tokens_decoder' object", path=path,
                              hint="the special-token table is built from it (model.md §8.4)")
    table = doc["added_tokens_decoder"]
    anchor = text.find('"added_tokens_decoder"')

    def line_of(key: str) -> int:
        m = re.compile(r'"' + re.escape(key) + r'"\s*:').search(text, max(anchor, 0))
        return text.count("\n", 0, m.start()) + 1 if m else 0

    def fail(key, message, **kw):
        raise CheckpointError(f"line {line_of(key)}: added_tokens_decoder[{key!r}]: {message}",
                              path=path, **kw)

    for key in getattr(table, "duplicates", ()):
        fail(key, "id appears twice")
    specials, owner = {}, {}
    for key, entry in table.items():
        if not (key.isascii() and key.isdigit()) or (len(key) > 1 and key[0] == "0"):
            fail(key, "key is not a decimal token id")
        token_id = int(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) \
                or not entry["content"]:
            fail(key, "entry needs a non-empty string 'content'")
        if token_id < n_ranks:
            fail(key, f"special id collides with BPE rank {token_id}",
                 expected=f"id >= {n_ranks} (tiktoken.model has ranks 0..{n_ranks - 1})",
                 found=token_id)
        if vocab_size is not None and token_id >= vocab_size:
            fail(key, "special id outside the vocabulary", expected=f"id < {vocab_size}",
                 found=token_id)
        content = entry["content"]
        if content in owner:
            fail(key, f"content {content!r} already names id {owner[content]}")
        specials[token_id] = content
        owner[content] = token_id
    return specials


# ---- tokenization_kimi.py: pat_str without executing the file ----------------------

class _NotLiteral(Exception):
    pass


def _eval_str(node, env: dict) -> str:
    """Value of a string expression built only from literals, names bound earlier to such
    expressions, ``+`` and ``<literal>.join([...])``. Anything else is refused."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _eval_str(node.left, env) + _eval_str(node.right, env)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "join" and len(node.args) == 1 and not node.keywords
            and isinstance(node.args[0], (ast.List, ast.Tuple))):
        sep = _eval_str(node.func.value, env)
        return sep.join(_eval_str(e, env) for e in node.args[0].elts)
    raise _NotLiteral()


def _scan_scope(body, env: dict, found: list, path) -> None:
    """Bind string names of one scope in source order; record every ``pat_str = ...``."""
    for stmt in body:
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        elif isinstance(stmt, ast.ClassDef):
            _scan_scope(stmt.body, dict(env), found, path)
            continue
        elif isinstance(stmt, ast.AugAssign) and getattr(stmt.target, "id", None) == "pat_str":
            raise CheckpointError(f"line {stmt.lineno}: pat_str is modified in place; k3 "
                                  "reads only plain assignments", path=path)
        else:
            continue
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        try:
            text = _eval_str(value, env)
        except _NotLiteral:
            if "pat_str" in names:
                raise CheckpointError(
                    f"line {stmt.lineno}: pat_str is not a string expression k3 can read "
                    "without executing the file", path=path,
                    hint="k3 accepts literals, '+' and \"|\".join([...]) of literals") from None
            for name in names:
                env.pop(name, None)
            continue
        for name in names:
            env[name] = text
            if name == "pat_str":
                found.append((stmt.lineno, text))


def read_pat_str(path) -> str:
    """The split regex assigned to ``pat_str`` in ``tokenization_kimi.py`` (module or class
    level), found by parsing, never by executing (formats/tokenizer.md K1-K3)."""
    path = Path(path)
    source = path.read_bytes()
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as e:
        raise CheckpointError(f"line {e.lineno}: not valid Python: {e.msg}",
                              path=path) from None
    except ValueError as e:       # e.g. NUL bytes
        raise CheckpointError(f"not valid Python: {e}", path=path) from None
    found = []
    _scan_scope(tree.body, {}, found, path)
    if not found:
        raise CheckpointError("no module- or class-level 'pat_str = ...' assignment", path=path,
                              hint="the split regex is read from it (model.md §8.1); delete the "
                                   "file to use k3's built-in K3 pattern")
    values = {text for _, text in found}
    if len(values) > 1:
        lines = ", ".join(str(line) for line, _ in found)
        raise CheckpointError(f"pat_str is assigned different strings (lines {lines})",
                              path=path)
    return found[0][1]
