"""The K3 tokenizer: tiktoken-style byte-level BPE read from a model directory.

Owns: ``K3Tokenizer`` built from a model directory, the GPT-2 byte<->unicode map,
rank-BPE (model.md §8.2), building the equivalent ``tokenizers.Tokenizer`` (model.md §8.5),
encoding, byte-exact decoding and streaming detokenization. Does not own: reading the
three tokenizer files strictly (``libk3.text.tokenizer_files``, formats/tokenizer.md),
chat formatting, stop-token policy (engine) or writing tokenizer files for synthetic
checkpoints (``libk3.synth.bpe``).

Why these choices:
* Encoding runs in HF ``tokenizers`` (a runtime dependency, Rust speed); ``tiktoken`` is
  only the test oracle. model.md §8.5 says how to make the two agree: merges are derived per
  token by rank-BPE on its own bytes restricted to lower ranks, and ``ignore_merges`` lets a
  pre-token that is itself a token come out whole, as tiktoken does.
* Injection safety: user text must never turn ``<|end_of_msg|>`` typed by a user into the
  special id. Two ``Tokenizer`` objects share ONE BPE model (sharing costs no memory or
  time, measured): ``hf`` carries the special tokens as added tokens (model.md §8.5 step 5),
  the second has none, so ``encode(..., allow_special=False)`` cannot match them. (Toggling
  ``encode_special_tokens`` on one object would be hidden mutable state.)
* The derived form (rank bytes, byte-level spellings, merges) is cached on disk, keyed
  by the files' sha256 (``libk3.text.tokenizer_cache``): deriving 163,584 merges in Python
  and validating ``tiktoken.model`` cost seconds of every run. The HF
  tokenizer is built from it only when text is first encoded; decoding needs only the
  rank bytes, so runs given ``--ids`` never build it.
* Decoding does not use HF: its ByteLevel decoder returns ``str`` and loses the bytes of a
  token that ends mid UTF-8 character. We keep every id's raw bytes and join them.
* The split regex needs character-class intersection (``&&``, model.md §8.3). HF's Oniguruma
  and tiktoken's fancy-regex implement it; Python's ``re`` does not, and ``regex`` only in
  V1 mode, so no Python regex engine is used for splitting anywhere in k3.
"""

from __future__ import annotations

import codecs
import operator
import re
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, K3Error
from .encodable import first_surrogate
from . import tokenizer_cache
from .tokenizer_cache import DerivedTokenizer
from .tokenizer_files import (CONFIG_FILE, K3_PAT_STR, KIMI_FILE, TIKTOKEN_FILE,
                              read_added_tokens, read_pat_str, read_tiktoken_model,
                              reserved_name)

# file): text is encoded in chunks of at most this many characters ...
MAX_ENCODE_CHARS = 400_000
# ... and no piece holds a run of more than this many consecutive whitespace (or
# non-whitespace) characters, whitespace as Python's str.isspace decides.
MAX_RUN_CHARS = 25_000


# ---- byte-level alphabet (model.md §8.5 step 1) --------------------------------------

def gpt2_byte_order() -> list:
    """The 256 byte values in GPT-2 byte-level order: the 188 printable bytes (0x21..0x7E,
    0xA1..0xAC, 0xAE..0xFF) first, then the other 68 in byte order. K3's lowest ranks are
    the single bytes in this order, so rank k = byte 0x21 + k for k < 94 (model.md §8.5)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in set(printable)]
    return printable + rest


def byte_to_unicode() -> list:
    """list[256] of one-character strings: printable bytes map to themselves, the n-th
    other byte (in byte order) to chr(0x100 + n). The alphabet of HF byte-level vocab."""
    order = gpt2_byte_order()
    table = [""] * 256
    for n, b in enumerate(order[188:]):
        table[b] = chr(0x100 + n)
    for b in order[:188]:
        table[b] = chr(b)
    return table


# ---- rank-BPE (model.md §8.2 step 3) -------------------------------------------------

def bpe_parts(piece: bytes, ranks: dict, limit=None) -> list:
    """Split ``piece`` by rank-BPE: start from single bytes, repeatedly merge the leftmost
    adjacent pair whose CONCATENATION has the lowest rank (< ``limit`` when given), stop
    when no adjacent pair is a token. Returns the parts (bytes).

    Not "merge the most frequent pair" and not a merges-list lookup: tiktoken has no merges
    file, any adjacent pair whose concatenation is a token may merge."""
    parts = [piece[i:i + 1] for i in range(len(piece))]
    bound = float("inf") if limit is None else limit
    while len(parts) > 1:
        best_rank, best_i = bound, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_rank, best_i = rank, i
        if best_i < 0:
            break
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


# ---- the equivalent tokenizers.Tokenizer (model.md §8.5) -----------------------------

def derive_merges(ranks: list) -> tuple:
    """HF merges for ``ranks`` (list of bytes, index = rank), ordered by the merged token's
    rank: each multi-byte token's pair is what rank-BPE leaves of its own bytes when only
    lower ranks may merge. Returns (merges as (left bytes, right bytes), count of
    multi-byte tokens that rank-BPE cannot build from two parts; those are reachable only
    as a whole pre-token, which ``ignore_merges`` handles exactly as tiktoken)."""
    rank_of = {token: r for r, token in enumerate(ranks)}
    merges, whole_only = [], 0
    for r, token in enumerate(ranks):
        if len(token) < 2:
            continue
        parts = bpe_parts(token, rank_of, limit=r)
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
        else:
            whole_only += 1
    return merges, whole_only


def split_pre_tokenizer(pat_str: str, path=None):
    """HF pre-tokenizer cutting text by the split regex (model.md §8.3), keeping every
    character: matches and the unmatched spans between them each become a piece."""
    from tokenizers import Regex, pre_tokenizers
    try:
        return pre_tokenizers.Split(Regex(pat_str), behavior="isolated", invert=False)
    except Exception as e:      # tokenizers raises a bare Exception for a bad pattern
        raise CheckpointError(f"split regex does not compile: {e}", path=path) from None


def derive(ranks: list) -> DerivedTokenizer:
    """The derived form of ``ranks`` (model.md §8.5): each rank's byte-level spelling and the
    merges of ``derive_merges`` as rank pairs."""
    to_uni = byte_to_unicode()
    vocab = ["".join([to_uni[b] for b in token]) for token in ranks]
    merges, whole_only = derive_merges(ranks)
    rank_of = {token: r for r, token in enumerate(ranks)}
    pairs = np.array([(rank_of[a], rank_of[b]) for a, b in merges], np.int32).reshape(-1, 2)
    return DerivedTokenizer(list(ranks), vocab, pairs, whole_only)


def build_hf_tokenizer(derived: DerivedTokenizer, specials: dict, pat_str: str, path=None):
    """(tokenizer with specials, tokenizer without) per model.md §8.5.

    ``specials`` maps id -> content and must fill ids n_ranks.. densely: HF gives added
    tokens the next free ids, so they are added in id order and then checked."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    spell = derived.vocab
    model = models.BPE(vocab={s: r for r, s in enumerate(spell)},
                       merges=[(spell[a], spell[b]) for a, b in derived.merges.tolist()],
                       ignore_merges=True)
    pre = pre_tokenizers.Sequence([
        split_pre_tokenizer(pat_str, path),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    built = []
    for with_specials in (True, False):
        tok = Tokenizer(model)      # both share the one BPE model
        tok.pre_tokenizer = pre
        tok.decoder = decoders.ByteLevel()
        if with_specials and specials:
            tok.add_special_tokens([
                AddedToken(specials[i], special=True, normalized=False, lstrip=False,
                           rstrip=False, single_word=False) for i in sorted(specials)])
            for token_id, content in specials.items():
                if tok.token_to_id(content) != token_id:
                    raise CheckpointError(
                        f"special token {content!r} did not land on its id", path=path,
                        expected=token_id, found=tok.token_to_id(content),
                        hint="its text may also be a BPE token")
        built.append(tok)
    return built[0], built[1]


# ---- pathological-input cuts (model.md §8.2, unverified) -----------------------------

def split_long_runs(text: str) -> list:
    """Cut ``text`` as tokenization_kimi.py reportedly does before encoding: chunks of at
    most MAX_ENCODE_CHARS characters, and within a chunk a cut before any character that
    would make a run of same-class (str.isspace) characters longer than MAX_RUN_CHARS.
    Pieces are encoded independently. Only inputs longer than MAX_RUN_CHARS can change."""
    return list(iter_long_runs(text))


def iter_long_runs(text: str):
    """``split_long_runs``'s pieces one chunk at a time, so an encoding that stops early
    scans no further. A run over the limit is found by a regex that tries only where a
    run starts, so it reads each character once, at C speed (a loop in Python over the
    characters is far slower on a long text); it is cut every MAX_RUN_CHARS."""
    if len(text) <= MAX_RUN_CHARS:
        yield text
        return
    for c0 in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[c0:c0 + MAX_ENCODE_CHARS]
        start = 0
        for run in _LONG_RUN.finditer(chunk):
            for cut in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield chunk[start:cut]
                start = cut
        yield chunk[start:]


# A run of more than MAX_RUN_CHARS characters of one class, from where it starts (re's \s
# is str.isspace); the lookbehind fails at once inside a run, so no run is read twice.
_LONG_RUN = re.compile(r"(?<!\S)\S{%d,}|(?<!\s)\s{%d,}" % (MAX_RUN_CHARS + 1,
                                                             MAX_RUN_CHARS + 1))


# ---- the tokenizer ------------------------------------------------------------------

class K3Tokenizer:
    """Encode text to K3 ids and decode ids to exact bytes (model.md §8).

    Attributes: ``n_ranks`` (BPE ranks, ids 0..n_ranks-1), ``vocab_size`` (ranks + special
    slots), ``special_ids`` {content: id}, ``pat_str`` and ``pat_source`` (where the split
    regex came from), ``pat_fallback`` (True when tokenization_kimi.py was absent and the
    built-in K3_PAT_STR was used), ``hf`` (the model.md §8.5 ``tokenizers.Tokenizer``, built
    on first use), ``whole_only_ranks`` (multi-byte ranks with no two-part BPE
    derivation), ``longest_rank_bytes`` (bytes of the longest BPE rank: text of n bytes
    encodes, without specials, to at least n / longest_rank_bytes tokens), ``cache_status``
    (what ``from_dir`` did with the derived-form cache: None without one, "hit", "written",
    "rewritten" (it was stale or damaged) or "in-memory" (it could not be written))."""

    def __init__(self, ranks: list, specials: dict, pat_str: str, *, pat_source: str,
                 pat_fallback: bool, vocab_size=None, path=None, derived=None):
        self.path = None if path is None else str(path)
        self.n_ranks = len(ranks)
        self.longest_rank_bytes = max(map(len, ranks), default=1)
        top = max(specials, default=self.n_ranks - 1) + 1
        self.vocab_size = max(self.n_ranks, top) if vocab_size is None else vocab_size
        slots = dict(specials)
        owner = {c: i for i, c in slots.items()}
        for token_id in range(self.n_ranks, self.vocab_size):
            if token_id not in slots:
                name = reserved_name(token_id)
                if name in owner:
                    raise CheckpointError(f"{name!r} names id {owner[name]}, but an unnamed "
                                          f"slot {token_id} needs that name", path=path)
                slots[token_id] = name
        self.special_ids = {content: i for i, content in sorted(slots.items())}
        self.pat_str = pat_str
        self.pat_source = pat_source
        self.pat_fallback = pat_fallback
        self.cache_status = None
        self._split = split_pre_tokenizer(pat_str, path)
        self._ranks = ranks
        self._slots = slots
        self._derived = derived
        self._hf_pair = None
        # id -> raw bytes; specials decode to their literal UTF-8 text (model.md §8.2)
        self._bytes = list(ranks) + [slots[i].encode("utf-8")
                                     for i in range(self.n_ranks, self.vocab_size)]

    def derived(self) -> DerivedTokenizer:
        """The derived form (read from the cache by ``from_dir``, else derived now)."""
        if self._derived is None:
            self._derived = derive(self._ranks)
        return self._derived

    def _tokenizers(self) -> tuple:
        """(with specials, without) HF tokenizers, built on first use."""
        if self._hf_pair is None:
            self._hf_pair = build_hf_tokenizer(self.derived(), self._slots, self.pat_str,
                                               path=self.path)
        return self._hf_pair

    @property
    def hf(self):
        return self._tokenizers()[0]

    @property
    def whole_only_ranks(self) -> int:
        return self.derived().whole_only

    @classmethod
    def from_dir(cls, model_dir, vocab_size=None, cache=None) -> "K3Tokenizer":
        """Read ``tiktoken.model``, ``tokenizer_config.json`` and (if present)
        ``tokenization_kimi.py`` from ``model_dir``. ``vocab_size`` (the config's) bounds the
        special ids; unnamed slots below it become ``<|reserved_token_{id}|>``. ``cache``:
        the derived-form cache file (``tokenizer_cache.cache_path``) to read, or to write
        when absent, stale or damaged; None derives in memory."""
        d = Path(model_dir)
        kimi = d / KIMI_FILE
        files = {TIKTOKEN_FILE: d / TIKTOKEN_FILE, CONFIG_FILE: d / CONFIG_FILE,
                 KIMI_FILE: kimi if kimi.is_file() else None}
        key = derived = None
        if cache is not None:
            try:
                key = tokenizer_cache.cache_key(files, vocab_size)
            except OSError:
                key = None                 # a missing file: the readers below say which
            derived = tokenizer_cache.load(cache, key) if key is not None else None
        ranks = derived.ranks if derived is not None else read_tiktoken_model(files[TIKTOKEN_FILE])
        if vocab_size is not None and vocab_size < len(ranks):
            raise CheckpointError("more BPE ranks than the vocabulary has ids",
                                  path=files[TIKTOKEN_FILE], expected=f"<= {vocab_size} ranks",
                                  found=len(ranks))
        specials = read_added_tokens(files[CONFIG_FILE], len(ranks), vocab_size)
        if files[KIMI_FILE] is not None:
            pat_str, source, fallback = read_pat_str(kimi), str(kimi), False
        else:
            pat_str, fallback = K3_PAT_STR, True
            source = f"built-in K3_PAT_STR ({KIMI_FILE} absent)"
        tok = cls(ranks, specials, pat_str, pat_source=source, pat_fallback=fallback,
                  vocab_size=vocab_size, path=d, derived=derived)
        if derived is not None:
            tok.cache_status = "hit"
        elif key is not None:
            existed = Path(cache).exists()
            if tokenizer_cache.save(cache, key, tok.derived()):
                tok.cache_status = "rewritten" if existed else "written"
            else:
                tok.cache_status = "in-memory"
        return tok

    # ---- encoding ----
    def encode(self, text: str, allow_special: bool = False, limit: int | None = None) -> list:
        """Token ids of ``text``; no BOS is prepended (model.md §8.4). With ``allow_special``
        False, special-token strings in the text are encoded as ordinary text (use this for
        anything a user typed); True recognises them, leftmost-longest match first. With
        ``limit``, encoding stops once more than ``limit`` ids are known: the ids then are
        the whole text's first ones (its pieces are encoded independently), enough to
        refuse a text over a context without tokenizing all of it."""
        if first_surrogate(text) is not None:
            # lone surrogates: joined into pairs where possible, else U+FFFD, as tiktoken does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        tok = self._tokenizers()[0 if allow_special else 1]
        ids = []
        for piece in iter_long_runs(text):
            # encode_batch lets go of the GIL while it works (encode does not): other
            # threads of the process run on meanwhile
            ids.extend(tok.encode_batch([piece], add_special_tokens=False)[0].ids)
            if limit is not None and len(ids) > limit:
                break
        return ids

    def pre_tokens(self, text: str) -> list:
        """The pieces the split regex cuts ``text`` into (specials not recognised)."""
        return [piece for piece, _ in self._split.pre_tokenize_str(text)]

    # ---- decoding ----
    def token_bytes(self, token_id) -> bytes:
        """Raw bytes of one id; K3Error for an id outside 0..vocab_size-1."""
        i = operator.index(token_id)
        if not 0 <= i < self.vocab_size:
            raise K3Error(f"token id {i} is outside the vocabulary", path=self.path,
                          expected=f"0..{self.vocab_size - 1}", found=i)
        return self._bytes[i]

    def decode_bytes(self, ids) -> bytes:
        """Concatenated raw bytes of ``ids``, byte-exact (may be invalid UTF-8)."""
        return b"".join([self.token_bytes(i) for i in ids])

    def decode(self, ids) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def id_of(self, content: str):
        """Id of the special token ``content``, or None."""
        return self.special_ids.get(content)

    def stream_decoder(self) -> "IncrementalDecoder":
        return IncrementalDecoder(self)


class LazyTokenizer:
    """A model directory's tokenizer, read on its first use (``K3Tokenizer.from_dir``
    with ``cache``). Why: a run given ids that decodes nothing needs none of it, and a
    run printing text needs it only at its first generated token, after the first
    forward. ``loaded`` is the K3Tokenizer once read, else None."""

    def __init__(self, model_dir, vocab_size=None, cache=None):
        self.model_dir, self.vocab_size, self.cache = model_dir, vocab_size, cache
        self.loaded = None

    def get(self) -> K3Tokenizer:
        if self.loaded is None:
            self.loaded = K3Tokenizer.from_dir(self.model_dir, self.vocab_size, self.cache)
        return self.loaded

    @property
    def longest_rank_bytes(self) -> int:
        return self.get().longest_rank_bytes

    def encode(self, text: str, allow_special: bool = False, limit: int | None = None) -> list:
        return self.get().encode(text, allow_special, limit)

    def token_bytes(self, token_id) -> bytes:
        return self.get().token_bytes(token_id)

    def decode_bytes(self, ids) -> bytes:
        return self.get().decode_bytes(ids) if len(ids) else b""

    def decode(self, ids) -> str:
        return self.get().decode(ids) if len(ids) else ""

    def id_of(self, content: str):
        return self.get().id_of(content)

    @property
    def special_ids(self) -> dict:
        return self.get().special_ids

    def stream_decoder(self) -> "IncrementalDecoder":
        return IncrementalDecoder(self)


class IncrementalDecoder:
    """Text of a token stream as tokens arrive, never splitting a UTF-8 character.

    ``push(id)`` returns the text that became complete (often "", when a token ends inside
    a multi-byte character); ``flush()`` returns what is left, with U+FFFD for an incomplete
    tail. The concatenation of all outputs equals ``tokenizer.decode(all ids)``."""

    def __init__(self, tokenizer: K3Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id), final=False)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
