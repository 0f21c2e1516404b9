"""The rules for a generation request's settings: tokens to generate, temperature, top_p,
top_k, min_p, the three penalties, the logit bias, seed, stop strings, token ids and the
context's room for a prompt (``room_problem``). Each
``*_problem`` returns why a value is refused, or None.

Owns: what values the options, batch lines and server requests accept (one rule each,
applied before any run), and ``GenSettings``, the settings one request carries. Imports neither numpy nor the model, so option parsing and
``--help`` stay light; numpy's scalar types are accepted through the
``numbers`` ABCs they register with.

Why temperatures in (0, 2^-126) are refused: logits are float32 (|logit| < 2^128), so for
T >= 2^-126, the smallest normal float32, logits / T stays below 2^254 and the float64
softmax is exact; a smaller T (e.g. the subnormal 1e-320) overflows to inf, and
inf - inf makes every probability NaN. The repetition penalty divides or multiplies a
logit the same way, so it lies in [2^-126, 2^126]; presence and frequency penalties lie in
[-2, 2] (OpenAI's range), so a penalised logit stays finite too (formats/model/numerics.md
section 12 has the rule they feed). A logit bias adds at most 100 in magnitude (OpenAI's
range, 300 tokens at most) before them: a biased logit stays below 2^128 + 100, and the
repetition penalty's bound still keeps it finite in float64.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from ..config import K3_CONTEXT as MAX_POSITIONS
from ..config import MAX_SIZE
from .defaults import PREFILL_CHUNK

MIN_TEMPERATURE = 2.0 ** -126
MAX_REPETITION_PENALTY = 2.0 ** 126
MAX_PENALTY = 2.0                    # presence and frequency penalties: -2 .. 2
MAX_TOP_K = MAX_SIZE                 # no vocabulary is wider (config.py refuses wider)
SEED_LIMIT = 2 ** 64                 # seeds are 0 .. 2^64 - 1
MAX_LOGIT_BIAS = 100                 # a token's logit bias: -100 .. 100 (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 300          # biased tokens per request (OpenAI's limit)
UNTIL_END = -1                       # gen: until a stop (the turn's end) or the context


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def gen_problem(n) -> str | None:
    """Why ``n`` is not a number of tokens to generate (0 .. the trained context), or None."""
    if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_POSITIONS:
        return None
    return f"gen must be an integer 0 .. {MAX_POSITIONS:,} (the trained context), got {n!r}"


def gen_or_until_end_problem(n) -> str | None:
    """``gen_problem``, or -1 (UNTIL_END): generate until a stop or the context is full
    (k3-run's --gen and batch lines; a server request's max_tokens takes a count)."""
    if n == UNTIL_END and _integer(n):
        return None
    return gen_problem(n) and (f"gen must be -1 (until a stop or the context) or an "
                               f"integer 0 .. {MAX_POSITIONS:,} (the trained context), "
                               f"got {n!r}")


def token_ids_problem(ids, vocab_size: int) -> str | None:
    """Why ``ids`` is not a list (or tuple) of token ids 0 .. vocab_size - 1, or None."""
    if isinstance(ids, (list, tuple)) and all(type(i) is int and 0 <= i < vocab_size
                                              for i in ids):
        return None
    return f"token ids must be integers 0..{vocab_size - 1}, got {str(ids)[:60]}"


def temperature_problem(t) -> str | None:
    """Why ``t`` is not a temperature (0 = greedy, or finite and >= 2^-126), or None."""
    if _number(t) and math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE):
        return None
    return f"temperature must be 0 (greedy) or a finite number >= 2^-126, got {t!r}"


def top_p_problem(p) -> str | None:
    """Why ``p`` is not a top-p mass in (0, 1], or None."""
    if _number(p) and math.isfinite(p) and 0 < p <= 1:
        return None
    return f"top_p must be a number in (0, 1], got {p!r}"


def seed_problem(s) -> str | None:
    """Why ``s`` is not a seed (an integer 0 .. 2^64 - 1), or None."""
    if _integer(s) and 0 <= s < SEED_LIMIT:
        return None
    return f"seed must be an integer 0 .. 2^64 - 1, got {s!r}"


def top_k_problem(k) -> str | None:
    """Why ``k`` is not a top-k count (1 .. 2^24; 0 or -1 keep every token), or None."""
    if _integer(k) and -1 <= k <= MAX_TOP_K:
        return None
    return f"top_k must be an integer 1 .. {MAX_TOP_K:,}, or 0 or -1 (off), got {k!r}"


def min_p_problem(p) -> str | None:
    """Why ``p`` is not a min-p fraction in [0, 1] (0 = off), or None."""
    if _number(p) and math.isfinite(p) and 0 <= p <= 1:
        return None
    return f"min_p must be a number in [0, 1], got {p!r}"


def repetition_penalty_problem(r) -> str | None:
    """Why ``r`` is not a repetition penalty in [2^-126, 2^126] (1 = off), or None."""
    if _number(r) and math.isfinite(r) and MIN_TEMPERATURE <= r <= MAX_REPETITION_PENALTY:
        return None
    return f"repetition_penalty must be a number in [2^-126, 2^126] (1 = off), got {r!r}"


def _penalty_problem(name: str, a) -> str | None:
    if _number(a) and math.isfinite(a) and -MAX_PENALTY <= a <= MAX_PENALTY:
        return None
    return f"{name} must be a number in [-2, 2] (0 = off), got {a!r}"


def presence_penalty_problem(a) -> str | None:
    """Why ``a`` is not a presence penalty in [-2, 2], or None."""
    return _penalty_problem("presence_penalty", a)


def frequency_penalty_problem(f) -> str | None:
    """Why ``f`` is not a frequency penalty in [-2, 2], or None."""
    return _penalty_problem("frequency_penalty", f)


def _bias_token(key, keyed: bool):
    """The token id a logit bias entry names, or None: in a JSON object (``keyed``) a
    string of decimal digits, as OpenAI's keys; in (id, bias) pairs an integer."""
    if keyed:
        if isinstance(key, str) and key.isascii() and key.isdigit():
            return int(key) if len(key) <= 20 else 1 << 64     # past any vocabulary
        return None
    return int(key) if _integer(key) else None


def _bias_entries(bias):
    """(entries, keyed) of a logit bias given as a JSON object or as (id, bias) pairs, or
    None when it is neither."""
    if isinstance(bias, dict):
        return list(bias.items()), True
    if isinstance(bias, (list, tuple)) and all(isinstance(e, (list, tuple)) and len(e) == 2
                                               for e in bias):
        return list(bias), False
    return None


def logit_bias_problem(bias, vocab_size: int, *, json_only: bool = False) -> str | None:
    """Why ``bias`` is not a logit bias, or None: a JSON object from token ids (strings of
    decimal digits, OpenAI's keys) to biases, or (unless ``json_only``: a batch line's, a
    request's) a list or tuple of (int id, bias) pairs (the option's,
    ``GenSettings.logit_bias``); at most 300 entries, each id in 0 .. vocab_size - 1
    once, each bias a number in [-100, 100]. Empty: no bias."""
    got = _bias_entries(bias)
    if got is None or (json_only and not isinstance(bias, dict)):
        return ("logit_bias must be an object mapping token ids to biases, got "
                f"{str(bias)[:60]}")
    entries, keyed = got
    if len(entries) > MAX_LOGIT_BIAS_TOKENS:
        return (f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got "
                f"{len(entries):,}")
    seen = set()
    for key, b in entries:
        token = _bias_token(key, keyed)
        if token is None:
            kind = "strings of decimal digits" if keyed else "integers"
            return f"logit_bias keys must be token ids ({kind}), got {str(key)[:30]!r}"
        if not 0 <= token < vocab_size:
            return (f"logit_bias: token id {str(key)[:30]} is outside the vocabulary "
                    f"0..{vocab_size - 1}")
        if token in seen:
            return f"logit_bias: token id {token} is given twice"
        seen.add(token)
        # NaN and the infinities fail the comparison; a huge int is compared, not converted
        if not (_number(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS):
            return (f"logit_bias: the bias of token {token} must be a number in "
                    f"[-100, 100], got {str(b)[:30]}")
    return None


def logit_bias_pairs(bias) -> tuple:
    """A valid logit bias (``logit_bias_problem``) as ``GenSettings.logit_bias``: its
    (id, float bias) pairs sorted by id."""
    entries, keyed = _bias_entries(bias)
    return tuple(sorted((_bias_token(k, keyed), float(b)) for k, b in entries))


def stop_strings_problem(strings) -> str | None:
    """Why ``strings`` is not a list (or tuple) of non-empty stop strings, or None (an
    empty one would match before the first token)."""
    if isinstance(strings, (list, tuple)) and all(isinstance(s, str) and s for s in strings):
        return None
    return f"stop must be a non-empty string or a list of them, got {str(strings)[:60]}"


# The sampling fields a batch line or a request may give, each with its rule (one place:
# the batch reader and the option table read it). ``logit_bias`` is one too, but its rule
# needs the model's vocabulary: ``logit_bias_problem``.
SAMPLING_RULES = {
    "temperature": temperature_problem, "top_p": top_p_problem, "top_k": top_k_problem,
    "min_p": min_p_problem, "repetition_penalty": repetition_penalty_problem,
    "presence_penalty": presence_penalty_problem,
    "frequency_penalty": frequency_penalty_problem, "seed": seed_problem,
}


def room_problem(held: int, n_prompt: int, gen: int, context: int,
                 name: str = "the model's context") -> str | None:
    """Why a prompt of ``n_prompt`` tokens after a state holding ``held`` and ``gen`` more
    (-1: until the end; 0: the prompt alone) do not fit ``context`` (``name``: what set
    it, ``Run.context_name``), with the sizes, or None."""
    after = f" after the {held:,} the state holds" if held else ""
    if not n_prompt and held >= context and gen:
        return f"the state's {held:,} tokens fill {name} of {context:,}"
    if held + n_prompt > context:
        return (f"the prompt is {n_prompt:,} tokens{after}, over {name} of "
                f"{context:,}")
    if held + n_prompt >= context and gen:
        return (f"the prompt's {n_prompt:,} tokens{after} fill {name} of "
                f"{context:,}: nothing can be generated")
    if gen >= 0 and held + n_prompt + gen > context:
        return (f"the prompt's {n_prompt:,} tokens{after} and --gen {gen:,} run past "
                f"{name} of {context:,} (--gen {context - held - n_prompt:,} fits)")
    return None


@dataclasses.dataclass
class GenSettings:
    """A request's settings (the rules of each: ``settings``). ``gen``: tokens to
    generate, or UNTIL_END (-1): until a stop or the sequence holds ``context``
    positions (the model's max_position_embeddings). The sampling fields are
    ``Sampler``'s; ``logit_bias``: (token id, bias) pairs sorted by id (empty: none;
    ``settings.logit_bias_pairs``); ``stop_strings`` follow ``stops``;
    ``response_format``: the request's (OpenAI's shape, ``grammar.response_format_problem``;
    None: free text) and ``grammar`` its compiled form for the run's tokenizer
    (``grammar.compile_grammar``; each sequence's Sampler gets its own matcher), which the
    engine reads."""
    gen: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple = ()
    stop_strings: tuple = ()
    prefill_chunk: int = PREFILL_CHUNK
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    context: int = MAX_POSITIONS
    logit_bias: tuple = ()
    response_format: object = None
    grammar: object = None

    def limit(self, positions: int) -> int:
        """Tokens to generate after a sequence of ``positions`` (its prompt in): ``gen``,
        or for UNTIL_END the room the context has left; never past the context (a
        generation that reaches it stops there, "length")."""
        room = max(self.context - positions, 0)
        return room if self.gen == UNTIL_END else min(self.gen, room)
