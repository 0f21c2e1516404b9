"""Deterministic BPE vocabularies and tokenizer files for synthetic K3 checkpoints.

Owns: training a rank list (``train_ranks``), the built-in seed corpus, and writing the
three tokenizer files of a model directory (``tiktoken.model``, ``tokenizer_config.json``,
``tokenization_kimi.py``) as ``formats/tokenizer.md`` specifies them. Does not own: reading
them (``libk3.text.tokenizer``, whose byte map, rank-BPE and split regex are reused here so
writer and reader cannot drift apart) or the rest of a synthetic checkpoint
(``libk3.synth.checkpoint``).

How a vocabulary is made (formats/tokenizer.md S1-S4):
1. Ranks 0..255 are the single bytes in GPT-2 byte-level order, as in the release.
2. Merges learned from the corpus: pre-tokens by the split regex (HF's engine, which does
   ``&&`` right), adjacent pairs counted with pre-token frequency; the most frequent pair
   (count >= 2) merges next, ties broken by (left rank, right rank).
3. When the corpus has no pair left (SEED_CORPUS: after 388 merges, 644 ranks), the
   vocabulary grows by concatenating two existing tokens drawn by a fixed-seed splitmix64
   stream (left among the LEFT_POOL lowest ranks, right among the RIGHT_POOL lowest). A
   candidate is kept only if both parts are whole UTF-8 (so its characters all come from
   the corpus or ASCII, and no Unicode-table difference between Python versions can
   change a decision), its letters share one script, its text is one pre-token (so
   encoding can reach it), and it fits a length cap growing one byte per doubling of the
   vocabulary (``_max_len``); it takes about 8 draws per kept token.
Every new token, in both phases, must be what rank-BPE makes of its own bytes from the
two parts that formed it; so every multi-byte rank has a two-part derivation and the
model.md §8.5 merges are exactly the training merges (no "whole-only" ranks).

Why our own PRNG: ``random.Random`` method details have changed between Python versions;
splitmix64 is four lines and fixes the bytes of every written file forever.
"""

from __future__ import annotations

import base64
import heapq
import itertools
import json
import unicodedata
from collections import Counter
from pathlib import Path

from ..errors import K3Error
from ..io.atomic import write_bytes
from ..text.tokenizer import bpe_parts, gpt2_byte_order, split_pre_tokenizer
from ..text.tokenizer_files import (CONFIG_FILE, K3_PAT_STR, KIMI_FILE, TIKTOKEN_FILE,
                                    reserved_name)

# Hard cap on extension tokens (step 3); see _max_len for the size-dependent cap.
MAX_TOKEN_BYTES = 16
# Extension draws its left part among the LEFT_POOL lowest ranks and its right part
# among the RIGHT_POOL lowest (frequent, short pieces), keeping tokens word-like.
LEFT_POOL = 16384
RIGHT_POOL = 2048
SPLITMIX_SEED = 0x6B33_5F62_7065   # "k3_bpe"

# Named special slots, as offsets from n_ranks (model.md §8.4; ids there are unverified).
# The last two slots are [UNK], [PAD] when free; every other slot is reserved.
SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>",
    5: "<|sep|>", 6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
    21: "<|media_pad|>",
}

# The chat template of synthetic checkpoints (formats/chat.md "The synthetic template"):
# XTML-like markup of model.md §8.4, not the release's (unverified). It exercises what a real
# template uses: roles in a loop, a macro, loop controls, raise_exception, tojson, tools,
# tool calls, reasoning, a keyword (`thinking`) and add_generation_prompt, and writes an
# assistant turn in exactly the markup libk3.text.chat_parse reads back.
CHAT_TEMPLATE = """\
{%- macro text(content) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- elif content is iterable -%}
    {%- for part in content -%}
      {%- if part.type != 'text' -%}{%- continue -%}{%- endif -%}
      {{- part.text -}}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|open|>system name="tools"<|sep|>{{ tools | tojson }}<|close|>system<|sep|><|end_of_msg|>
{%- endif -%}
{% for message in messages %}
  {% if message.role not in ['system', 'user', 'assistant', 'tool'] %}
    {{- raise_exception('unknown role ' ~ message.role) -}}
  {% endif %}
<|open|>{{ message.role }}
  {%- if message.role == 'tool' and message.tool_call_id %} id="{{ message.tool_call_id }}"{% endif -%}
  <|sep|>
  {%- if message.role == 'assistant' -%}
    {%- if message.reasoning_content -%}
      <|open|>think<|sep|>{{ message.reasoning_content }}<|close|>think<|sep|>
    {%- endif -%}
    {%- if message.content -%}
      <|open|>response<|sep|>{{ text(message.content) }}<|close|>response<|sep|>
    {%- endif -%}
    {%- if message.tool_calls -%}
      <|open|>tools<|sep|>
      {%- for call in message.tool_calls -%}
        {%- set f = call.function if call.function is defined else call -%}
        <|open|>call name="{{ f.name }}"{% if call.id %} id="{{ call.id }}"{% endif %}<|sep|>
        {{- f.arguments if f.arguments is string else f.arguments | tojson -}}
        <|close|>call<|sep|>
      {%- endfor -%}
      <|close|>tools<|sep|>
    {%- endif -%}
  {%- else -%}
    {{- text(message.content) -}}
  {%- endif -%}
<|close|>{{ message.role }}<|sep|><|end_of_msg|>{% endfor %}
{%- if add_generation_prompt -%}
  <|open|>assistant<|sep|>
  {%- if thinking is defined and not thinking -%}<|open|>think<|sep|><|close|>think<|sep|>{%- endif -%}
{%- endif -%}
"""

# Seed corpus written for k3: English with contractions in every case, code, numbers,
# CJK, kana, Hangul, other scripts, combining marks, emoji with ZWJ sequences, whitespace
# runs, tabs and CRLF, so every alternative of the split regex has material to merge.
SEED_CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog doesn't care; it's asleep.\n"
    "She said: \"I'M SURE THEY'RE HERE, aren't they?\" We'll see. You've been told, "
    "haven't you? I'd rather not. They'll come back when it's time, and we're ready.\n"
    "Streaming weights from disk lets one ordinary machine run a very large model. "
    "Each layer is read, used, and released; the cache keeps the experts that were "
    "routed most often. The router picks the top experts for every token, and the "
    "shared experts always run. The model was trained on text and code in many "
    "languages, and it answers questions, writes programs, and explains its reasoning.\n"
    "In the beginning the universe was created. This has made a lot of people very "
    "angry and been widely regarded as a bad move. Time is an illusion; lunchtime "
    "doubly so. The answer is 42, but what is the question?\n"
    "Paris is the capital of France. Berlin is the capital of Germany. Tokyo is the "
    "capital of Japan. The capital of Italy is Rome, and Madrid is in Spain.\n"
    "\n"
    "def encode(self, text: str, allow_special: bool = False) -> list[int]:\n"
    "    \"\"\"Return the token ids of text.\"\"\"\n"
    "    ids = []\n"
    "    for piece in self.split(text):\n"
    "        if piece in self.ranks:\n"
    "            ids.append(self.ranks[piece])\n"
    "        else:\n"
    "            ids.extend(self.merge(piece))\n"
    "    return ids\n"
    "\n"
    "for (int i = 0; i < n; i++) {\n"
    "\tsum += a[i] * b[i];\t// dot product\n"
    "\tif (sum > limit) { return -1; }\n"
    "}\n"
    "const config = { \"hidden_size\": 7168, \"num_layers\": 93, \"vocab\": 163840 };\n"
    "x = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]; y = {k: v ** 2 for k, v in enumerate(x)}\n"
    "if __name__ == \"__main__\":\n"
    "    main()\n"
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY 2 DESC;\n"
    "<div class=\"note\"><p>Hello, <b>world</b>!</p></div>\n"
    "https://example.com/path/to/page?query=value&page=2#section-3\n"
    "\n"
    "Numbers: 0 1 12 123 1234 12345 123456 3.14159 2.71828 -273.15 1e-5 6.02e23\n"
    "Dates 2024-01-31, 1999-12-31 23:59:59; phone +1 (555) 123-4567; 1,000,000 and 42%.\n"
    "Prices: $19.99, EUR 5.00, 100 yen, 7,500 won. Version 1.2.3-rc.4, build #5678.\n"
    "\n"
    "人工智能正在改变世界。我们今天学习中文，明天学习日本语。你好，世界！\n"
    "大型语言模型可以回答问题、编写代码、翻译文本。北京是中国的首都，上海是最大的城市。\n"
    "東京は日本の首都です。ひらがなとカタカナと漢字を使います。ありがとうございます。\n"
    "안녕하세요, 세계! 한국어는 한글로 씁니다. 감사합니다.\n"
    "Привет, мир! Это пример текста на русском языке. Москва — столица России.\n"
    "Γειά σου κόσμε! Αυτό είναι ελληνικό κείμενο. مرحبا بالعالم! هذا نص عربي.\n"
    "שלום עולם. नमस्ते दुनिया, यह हिंदी पाठ है। สวัสดีชาวโลก\n"
    "Café, naïve, façade, résumé, Ångström, Straße, ĳssel, Œuvre, jalapeño, São Paulo.\n"
    "Combining: cafe\u0301 nai\u0308ve a\u0300 e\u0302 o\u0303 u\u0308\u0301 "
    "Z\u0351\u0364a\u0313\u0346l\u0367g\u0352o\u0344 text.\n"
    "Emoji: 😀 😂 🎉 👍 🚀 ❤️ 👍🏽 🇫🇷 🇯🇵 👩\u200d💻 👨\u200d👩\u200d👧\u200d👦 "
    "🏳\ufe0f\u200d🌈 🧑🏿\u200d🔬 ✨✨✨ 🔥🔥\n"
    "Symbols: → ← ↑ ↓ ≤ ≥ ≠ ∞ ∑ ∫ √ π ° © ® ™ € £ ¥ § ¶ • … « » “quoted” ‘single’\n"
    "\n"
    "    indented four spaces\n"
    "        indented eight spaces\n"
    "\t\ttwo tabs\n"
    "trailing spaces   \n"
    "windows line\r\n"
    "another windows line\r\n"
    "\r\n"
    "many                spaces                between\n"
    "\n\n\n"
    "THE END. The End. the end. tHe EnD.\n"
)


def _splitmix64(state: int):
    """Endless stream of 64-bit values (Steele, Lea, Flood 2014 constants)."""
    mask = (1 << 64) - 1
    while True:
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        yield z ^ (z >> 31)


def train_ranks(corpus: str, n_ranks: int, pat_str: str = K3_PAT_STR) -> list:
    """A vocabulary of exactly ``n_ranks`` distinct byte strings, element k = rank k.
    Deterministic: the same arguments give the same list on every machine."""
    if n_ranks < 256:
        raise K3Error("a byte-level BPE vocabulary needs at least the 256 single bytes",
                      expected=">= 256 ranks", found=n_ranks)
    ranks = [bytes([b]) for b in gpt2_byte_order()]
    rank_of = {token: r for r, token in enumerate(ranks)}
    pre = split_pre_tokenizer(pat_str)

    def accept(left: int, right: int) -> bool:
        """Append ranks[left] + ranks[right] as the next rank if it is new and rank-BPE
        of its bytes rebuilds exactly these two parts."""
        token = ranks[left] + ranks[right]
        if token in rank_of or bpe_parts(token, rank_of) != [ranks[left], ranks[right]]:
            return False
        rank_of[token] = len(ranks)
        ranks.append(token)
        return True

    _learn_corpus_merges(corpus, n_ranks, pre, ranks, accept)
    _extend_by_concatenation(n_ranks, pre, ranks, rank_of, accept)
    return ranks


def _learn_corpus_merges(corpus: str, n_ranks: int, pre, ranks: list, accept) -> None:
    """Phase 2: classic pair-count BPE over the corpus's pre-tokens. ``counts`` holds every
    pair still on offer; a merged or refused pair is retired for good."""
    words = Counter(piece.encode("utf-8") for piece, _ in pre.pre_tokenize_str(corpus))
    byte_rank = {token[0]: r for r, token in enumerate(ranks[:256])}
    seqs = [[byte_rank[b] for b in word] for word in sorted(words)]
    freq = [words[word] for word in sorted(words)]
    counts, where, retired = Counter(), {}, set()
    for w, seq in enumerate(seqs):
        for pair in zip(seq, seq[1:]):
            counts[pair] += freq[w]
            where.setdefault(pair, set()).add(w)
    heap = [(-c, a, b) for (a, b), c in counts.items()]
    heapq.heapify(heap)
    while heap and len(ranks) < n_ranks:
        neg, a, b = heapq.heappop(heap)
        if counts.get((a, b)) != -neg:
            continue                      # stale heap entry
        if -neg < 2:
            break
        del counts[(a, b)]
        retired.add((a, b))
        if not accept(a, b):
            continue
        new = len(ranks) - 1
        touched = set()
        for w in sorted(where.pop((a, b), ())):
            seq, f = seqs[w], freq[w]
            for pair in zip(seq, seq[1:]):
                if pair in counts:
                    counts[pair] -= f
                    touched.add(pair)
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[w] = out
            for pair in zip(out, out[1:]):
                if pair not in retired:
                    counts[pair] += f
                    touched.add(pair)
                    where.setdefault(pair, set()).add(w)
        for pair in touched:
            if counts[pair] > 0:
                heapq.heappush(heap, (-counts[pair], pair[0], pair[1]))
            else:
                del counts[pair]


def _max_len(n: int) -> int:
    """Longest extension token at vocabulary size n: one byte more per doubling, so early
    ranks stay short like a real vocabulary's (at 163,584 ranks: <= 11 bytes, mode 8)."""
    return min(MAX_TOKEN_BYTES, n.bit_length() - 7)


def _script_of(token: bytes):
    """What a token's text allows in a merge (real merges stay in one script): None when
    it is not whole UTF-8, holds a control character other than whitespace, or mixes
    scripts; else the script of its letters (first word of the Unicode name: LATIN, CJK,
    HANGUL, ...), "" when it has none."""
    try:
        text = token.decode("utf-8")
    except UnicodeDecodeError:
        return None
    script = ""
    for ch in text:
        cat = unicodedata.category(ch)
        if cat == "Cc" and ch not in "\t\n\r\v\f":
            return None
        if cat[0] == "L":
            word = unicodedata.name(ch, "?").split(" ", 1)[0]
            if not script:
                script = word
            elif word != script:
                return None
    return script


def _extend_by_concatenation(n_ranks: int, pre, ranks: list, rank_of: dict, accept) -> None:
    """Phase 3: concatenations of two existing tokens chosen by splitmix64."""
    needed = n_ranks - len(ranks)
    budget = 200 * needed + 100_000        # far above the measured ~8 draws per token
    scripts: dict = {}          # rank -> _script_of(its token): ranks never change

    def script(r: int):
        s = scripts.get(r, False)
        if s is False:
            s = scripts[r] = _script_of(ranks[r])
        return s

    def limits(n: int) -> tuple:
        """(left pool, right pool, longest token) at n ranks: they change only when a
        rank is added, not per draw."""
        return min(n, LEFT_POOL), min(n, RIGHT_POOL), _max_len(n)

    split = pre.pre_tokenize_str
    n = len(ranks)
    left_pool, right_pool, longest = limits(n)
    for z in itertools.islice(_splitmix64(SPLITMIX_SEED), budget):
        if n >= n_ranks:
            return
        left = (z & 0xFFFF_FFFF) % left_pool
        right = (z >> 48) % right_pool
        token = ranks[left] + ranks[right]
        if len(token) > longest or token in rank_of:
            continue
        # both parts whole UTF-8 (characters come only from the corpus and ASCII) and
        # one script between them
        a, b = script(left), script(right)
        if a is None or b is None or (a and b and a != b):
            continue
        if len(split(token.decode("utf-8"))) != 1:
            continue
        if accept(left, right):
            n = len(ranks)
            left_pool, right_pool, longest = limits(n)
    if len(ranks) < n_ranks:
        raise K3Error("BPE extension ran out of candidates", expected=f"{n_ranks} ranks",
                      found=len(ranks))


# ---- writers (atomic, deterministic) ------------------------------------------------

def write_tiktoken_model(path, ranks: list) -> None:
    """``<base64> <rank>\\n`` per rank, in rank order (formats/tokenizer.md S1, T1-T6)."""
    if len(set(ranks)) != len(ranks) or not all(ranks):
        raise K3Error("ranks must be distinct non-empty byte strings", path=path)
    lines = [base64.b64encode(token) + b" %d\n" % r for r, token in enumerate(ranks)]
    write_bytes(path, b"".join(lines))


def special_slot_names(n_ranks: int, vocab_size: int) -> dict:
    """{id: content} for every special slot n_ranks..vocab_size-1 (release-like naming)."""
    names = {n_ranks + off: name for off, name in SPECIAL_OFFSETS.items()
             if n_ranks + off < vocab_size}
    for token_id, name in ((vocab_size - 2, "[UNK]"), (vocab_size - 1, "[PAD]")):
        if token_id >= n_ranks and token_id not in names:
            names[token_id] = name
    return {i: names.get(i, reserved_name(i)) for i in range(n_ranks, vocab_size)}


def write_tokenizer_config(path, n_ranks: int, vocab_size: int) -> None:
    """``tokenizer_config.json`` naming all special slots (formats/tokenizer.md S2)."""
    if vocab_size < n_ranks:
        raise K3Error("vocab_size is smaller than the BPE ranks", path=path,
                      expected=f">= {n_ranks}", found=vocab_size)
    slots = special_slot_names(n_ranks, vocab_size)
    doc = {"added_tokens_decoder": {
        str(i): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True} for i, content in slots.items()}}
    present = set(slots.values())
    for field, content in (("bos_token", "[BOS]"), ("eos_token", "[EOS]"),
                           ("unk_token", "[UNK]"), ("pad_token", "[PAD]")):
        if content in present:
            doc[field] = content
    doc["chat_template"] = CHAT_TEMPLATE
    text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    write_bytes(path, text.encode("utf-8"))


def write_tokenization_kimi(path, pat_str: str) -> None:
    """A tiny Python data file assigning ``pat_str`` (formats/tokenizer.md S3, K1)."""
    raw_ok = '"' not in pat_str and not pat_str.endswith("\\") and pat_str.isprintable()
    literal = f'r"{pat_str}"' if raw_ok else repr(pat_str)
    text = (
        '"""Split regex of a synthetic K3 checkpoint (written by libk3.synth.bpe).\n'
        "\n"
        "A data file: k3 reads pat_str with ast and never executes it. Not the released\n"
        "tokenization_kimi.py, which is a tokenizer class.\n"
        '"""\n'
        "\n"
        f"pat_str = {literal}\n"
    )
    write_bytes(path, text.encode("utf-8"))


def write_tokenizer_files(model_dir, n_ranks: int, vocab_size: int, seed_corpus=None) -> None:
    """Train ``n_ranks`` ranks on ``seed_corpus`` (default SEED_CORPUS) and write the three
    tokenizer files into ``model_dir``."""
    d = Path(model_dir)
    if vocab_size < n_ranks:
        raise K3Error("vocab_size is smaller than the BPE ranks", path=d,
                      expected=f">= {n_ranks}", found=vocab_size)
    ranks = train_ranks(SEED_CORPUS if seed_corpus is None else seed_corpus, n_ranks,
                        K3_PAT_STR)
    write_tiktoken_model(d / TIKTOKEN_FILE, ranks)
    write_tokenizer_config(d / CONFIG_FILE, n_ranks, vocab_size)
    write_tokenization_kimi(d / KIMI_FILE, K3_PAT_STR)
