"""Structured output: the token mask that keeps a sequence's output JSON, or JSON valid
against a JSON schema (docs/run.md "Structured output").

Owns: checking a request's ``response_format`` (OpenAI's shape: ``{"type": "text"}``,
``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": {...},
"strict": bool}}``; ``strict`` false is enforced all the same), compiling it for a
tokenizer (``compile_grammar``: cached by the format's canonical JSON text on the
tokenizer's ``GrammarTokenizer``, so a server compiles a schema once for every request that
sends it), and one sequence's ``Matcher`` (the allowed tokens after the tokens it has seen,
``advance``, ``copy``, ``is_done``). Does not own: where the mask is applied (``libk3.engine.sampler``:
first, before the logit bias and the penalties, formats/model/numerics.md section 12), the stop rule
(``libk3.engine.stops``: a grammar's end token ends generation), options and batch lines.

The server's ``tool_choice`` constraint and a reasoning budget are compiled on top of
this module by ``tool_grammar``.

Why llguidance (the ``structured`` extra, never a core dependency): it builds its token
trie from raw token bytes, as k3's tokenizer gives them (``token_bytes``: byte-level BPE,
a token may end inside a UTF-8 character), compiles JSON schemas itself, computes a mask in
tens of microseconds on CPU, and rolls a matcher back by n tokens, which a verify pass
needs: its rows are picked with proposals that may then be rejected.

End tokens. A sequence's end set is the tokenizer's turn ends (``K3_TURN_ENDS`` the
vocabulary has) plus the settings' stop ids. They are allowed only once the JSON is
complete (the grammar accepts), and no other token is then allowed when the grammar can
take no more; so a sequence under a grammar ends at an end token with valid JSON, or at
the length limit with a cut one (stop reason "length"). A stop string may also cut it: it
is the caller's to give none.

Exactness: the mask of a position is a function of the tokens generated before it
(``Matcher.sync`` brings the matcher there, rolling back what a rejected proposal left),
so sampling's rule that a pick depends only on its row and the tokens before it holds,
and drafting still gives plain decoding's tokens.
"""

from __future__ import annotations

import collections
import json
import threading
import time

import numpy as np

from ..errors import UsageError
from .schema_check import _first_line, schema_problem

EXTRA = "structured"
MISSING = ("structured output needs the llguidance library: install k3's "
           f"'{EXTRA}' extra (pip install 'k3[{EXTRA}]')")
GRAMMARS_KEPT = 64          # compiled formats kept per tokenizer (least recently used out)
MASKS_KEPT = 8              # a matcher's recent masks (a draft and its verify share them)
# compact JSON ("," and ":" between items, no other whitespace): free whitespace lets a
# weak model fill its output with newlines up to the length limit; a client's schema may
# not change it (its "x-guidance" is refused: schema_check)
JSON_OPTIONS = {"whitespace_flexible": False}
_LOCK = threading.Lock()


def llguidance():
    """The llguidance module, or UsageError naming the extra."""
    try:
        import llguidance as llg
    except ImportError:
        raise UsageError(MISSING) from None
    return llg


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _schema(fmt):
    """The JSON schema a valid ``response_format`` asks for (None: free text), without
    checking the schema; ValueError for a malformed format."""
    if not isinstance(fmt, dict):
        raise ValueError("must be an object with a \"type\"")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise ValueError("\"type\" must be \"text\", \"json_object\" or \"json_schema\"")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValueError("\"json_schema\" must be an object with a \"schema\" object")
    if "strict" in spec and not isinstance(spec["strict"], bool):
        raise ValueError("\"json_schema\".\"strict\" must be true or false")
    if "name" in spec and not isinstance(spec["name"], str):
        raise ValueError("\"json_schema\".\"name\" must be a string")
    return spec["schema"]


def _grammar_text(schema) -> str:
    """llguidance's grammar of ``schema`` (compact JSON: no free whitespace, which a weak
    model could fill to the length limit), the schema checked first; ValueError when k3
    cannot enforce it (``schema_check.schema_problem``)."""
    llg = llguidance()
    why = schema_problem(schema, JSON_OPTIONS)
    if why:
        raise ValueError(why)
    return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def response_format_problem(fmt) -> str | None:
    """Why ``fmt`` cannot be enforced (a malformed format, or a schema k3 cannot enforce:
    ``schema_check``), or None. UsageError naming the extra when llguidance is missing and
    ``fmt`` constrains."""
    try:
        schema = _schema(fmt)
        if schema is not None:
            _grammar_text(schema)
    except ValueError as e:
        return str(e)
    return None


def format_key(fmt) -> str:
    """The canonical text a compiled format is cached by."""
    return json.dumps(_schema(fmt), sort_keys=True, separators=(",", ":"))


class _Vocab:
    """k3's tokenizer as llguidance's ``TokenizerWrapper`` reads it: every id's bytes, the
    special ids marked (0xFF first: no grammar text matches them)."""

    def __init__(self, tok, eos: int):
        self.eos_token_id = eos
        self.bos_token_id = None
        specials = set(tok.special_ids.values())
        self.special_token_ids = sorted(specials)
        self.tokens = [b"\xff" + tok.token_bytes(i) if i in specials else tok.token_bytes(i)
                       for i in range(tok.vocab_size)]
        self._tok = tok

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tok.encode(text)


class GrammarTokenizer:
    """llguidance's tokenizer of one k3 tokenizer (built once: ``for_tokenizer``), its
    turn-end ids and the formats compiled for it."""

    def __init__(self, tok):
        from ..text.chat_template import K3_TURN_ENDS
        llg = llguidance()
        self.vocab_size = tok.vocab_size
        ends = [tok.id_of(n) for n in K3_TURN_ENDS]
        self.end_ids = tuple(dict.fromkeys(i for i in ends if i is not None))
        eos = self.end_ids[0] if self.end_ids else tok.vocab_size - 1
        t0 = time.perf_counter()
        self.lltok = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tok, eos)),
                                     n_vocab=tok.vocab_size, eos_token=eos)
        self.build_seconds = time.perf_counter() - t0
        self.grammars = collections.OrderedDict()

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "GrammarTokenizer":
        """The one of ``tokenizer`` (a K3Tokenizer or LazyTokenizer), kept on it."""
        tok = tokenizer.get() if hasattr(tokenizer, "get") else tokenizer
        with _LOCK:
            gt = getattr(tok, "_k3_grammar", None)
            if gt is None:
                gt = cls(tok)
                tok._k3_grammar = gt
        return gt


def compile_grammar(tokenizer, fmt) -> "Grammar | None":
    """``fmt`` compiled for ``tokenizer`` (cached by ``format_key``); None for
    ``{"type": "text"}``. UsageError for a format ``response_format_problem`` refuses or
    when llguidance is missing."""
    try:
        schema = _schema(fmt)
    except ValueError as e:
        raise UsageError(f"response format: {e}") from None
    if schema is None:
        return None
    gt = GrammarTokenizer.for_tokenizer(tokenizer)

    def build(key):
        try:
            return Grammar(gt, _grammar_text(schema), key)
        except ValueError as e:
            raise UsageError(f"response format: {e}") from None
    return _kept(gt, format_key(fmt), build)


def _kept(gt: GrammarTokenizer, key: str, build) -> "Grammar":
    """The grammar cached on ``gt`` by ``key``, else ``build(key)`` cached (least
    recently used out past GRAMMARS_KEPT)."""
    with _LOCK:
        g = gt.grammars.get(key)
        if g is not None:
            gt.grammars.move_to_end(key)
            return g
    g = build(key)
    with _LOCK:
        gt.grammars[key] = g
        if len(gt.grammars) > GRAMMARS_KEPT:
            gt.grammars.popitem(last=False)
    return g


class Grammar:
    """A compiled format for one tokenizer; ``matcher(stop_ids)`` starts a sequence."""

    def __init__(self, gt: GrammarTokenizer, text: str, key: str,
                 what: str = "response format"):
        llg = llguidance()
        self.tokenizer, self.key, self.what = gt, key, what
        self._proto = llg.LLMatcher(gt.lltok, text, log_level=0)
        if self._proto.is_error():
            raise UsageError(f"{what}: schema refused: {_first_line(self._proto.get_error())}")

    def matcher(self, stop_ids=()) -> "Matcher":
        """A new sequence's matcher; its end tokens are the turn ends and ``stop_ids``."""
        ends = self.end_ids(stop_ids)
        if not ends:
            raise UsageError("structured output needs an end token: this vocabulary has no "
                             "turn end ([EOS], <|end_of_msg|>); give a stop id")
        return Matcher(self, self._proto.deep_copy(), ends)

    def end_ids(self, stop_ids=()) -> tuple:
        """A sequence's end tokens: the turn ends, then ``stop_ids``, each once."""
        return tuple(dict.fromkeys(tuple(self.tokenizer.end_ids) + tuple(int(i) for i in stop_ids)))


class Matcher:
    """One sequence's grammar state: the generated tokens it has consumed (``ids``) and
    the tokens allowed next. ``seconds``: time spent computing masks."""

    def __init__(self, grammar: Grammar, m, end_ids: tuple):
        self.grammar, self._m = grammar, m
        self.end_ids = tuple(end_ids)
        self._ends = np.asarray(self.end_ids, np.int64)
        self.ids: list = []
        self.seconds = 0.0
        self.masks = 0
        self._kept = collections.OrderedDict()

    def copy(self) -> "Matcher":
        new = Matcher(self.grammar, self._m.deep_copy(), self.end_ids)
        new.ids = list(self.ids)
        return new

    def advance(self, tok: int) -> None:
        """Consume the generated ``tok``; ValueError when the grammar does not allow it."""
        tok = int(tok)
        if tok in self.end_ids:
            raise ValueError(f"token {tok} ends the sequence; nothing follows it")
        if not self._m.validate_tokens([tok]):
            raise ValueError(f"token {tok} is not allowed here by the grammar")
        if not self._m.consume_token(tok):     # allowed, and the library gave up on it
            raise self._failed(f"token {len(self.ids) + 1}")
        self.ids.append(tok)

    def sync(self, made) -> None:
        """Make the consumed tokens equal ``made`` (the generated tokens before a
        position): roll back past the first difference, then advance."""
        made = [int(t) for t in made]
        n = min(len(self.ids), len(made))
        k = n
        if self.ids[:n] != made[:n]:
            k = next(i for i in range(n) if self.ids[i] != made[i])
        if k < len(self.ids):
            if not self._m.rollback(len(self.ids) - k):
                raise RuntimeError(f"grammar rollback failed: {self._m.get_error()}")
            del self.ids[k:]
        for t in made[k:]:
            self.advance(t)

    def _failed(self, where: str) -> UsageError:
        """The error ending this sequence alone: the grammar cannot go on at ``where``
        (llguidance gave up, or allows nothing: a schema k3 cannot enforce)."""
        why = _first_line(self._m.get_error()) if self._m.is_error() else ""
        if why in ("", "NoExtensionBias"):
            why = "nothing the schema allows can follow (a part of it no value satisfies)"
        return UsageError(f"{self.grammar.what}: the grammar failed at {where}: {why}")

    def is_complete(self) -> bool:
        """The output so far is a whole value of the grammar (an end token may follow)."""
        return self._m.is_accepting()

    def is_done(self) -> bool:
        """Only an end token may follow."""
        return self._m.is_stopped()

    def allowed(self, n: int) -> np.ndarray:
        """Boolean [n]: the ids allowed next (end tokens exactly when complete)."""
        key = (tuple(self.ids), n)
        got = self._kept.get(key)
        if got is not None:
            self._kept.move_to_end(key)
            return got
        t0 = time.perf_counter()
        bits = np.frombuffer(self._m.compute_bitmask(), np.uint8)
        ok = np.zeros(n, bool)
        m = min(n, self.grammar.tokenizer.vocab_size)
        ok[:m] = np.unpackbits(bits, bitorder="little")[:m].astype(bool)
        ends = self._ends[self._ends < n]
        ok[ends] = self._m.is_accepting()
        if not ok.any():
            raise self._failed(f"the mask after {len(self.ids)} tokens")
        self.seconds += time.perf_counter() - t0
        self.masks += 1
        self._kept[key] = ok
        if len(self._kept) > MASKS_KEPT:
            self._kept.popitem(last=False)
        return ok

    def mask(self, logits, made=None) -> np.ndarray:
        """A float64 copy of ``logits`` with the disallowed ids at -inf, after the tokens
        ``made`` (default: where the matcher is). After an end token (a draft that
        proposes past one: such a pick is never committed) only end tokens are allowed."""
        row = np.array(logits, dtype=np.float64)
        if made is not None:
            made = [int(t) for t in made]
            cut = next((i for i, t in enumerate(made) if t in self.end_ids), None)
            if cut is not None:
                self.sync(made[:cut])
                ok = np.zeros(row.size, bool)
                ok[self._ends[self._ends < row.size]] = True
                row[~ok] = -np.inf
                return row
            self.sync(made)
        row[~self.allowed(row.size)] = -np.inf
        return row
