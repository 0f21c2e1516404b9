"""Log-probabilities of tokens, from the logits rows the sampler reads.

Owns: turning one logits row into the log-probability of the token chosen from it and
of the likeliest alternatives (what ``logprobs``/``top_logprobs`` and ``echo`` answer on
the server and in batch results), and their one JSON shape, OpenAI's chat ``logprobs``
``content`` list (``content``: the server's chat choices and batch result lines). Does
not own: which rows are scored (``core``, for the requests that ask) or the completion
endpoint's shape (``libk3.serve.protocol``).

Which distribution: the model's own, the log-softmax of the raw logits row, before
temperature, penalties and truncation (vLLM's default, "raw logprobs"), so a value is the
same whatever the request's sampling settings and can be checked against
``k3-run --logits-out`` of the same ids. Computed in float64 with a fixed reduction order
(numpy's sum over one row), so the same row always gives the same bytes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MAX_TOP = 20                      # alternatives per token, at most (the OpenAI API's)


@dataclasses.dataclass
class TokenLogprob:
    """One token's log-probability and the ``top`` likeliest (id, logprob) of its row,
    likeliest first (ties: lower id first)."""
    token: int
    logprob: float
    top: list


def log_softmax(row) -> np.ndarray:
    """float64 log-softmax of one logits row."""
    x = np.asarray(row, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def token_logprob(row, token: int, top: int = 0) -> TokenLogprob:
    """``token``'s log-probability under ``row`` and the ``top`` likeliest tokens'."""
    lp = log_softmax(row)
    best = []
    if top > 0:
        k = min(top, lp.size)
        part = np.argpartition(-lp, k - 1)[:k] if k < lp.size else np.arange(lp.size)
        cut = lp[part].min()                     # ties at the cut: every tied id, lowest
        tied = np.flatnonzero(lp >= cut)
        order = np.lexsort((tied, -lp[tied]))[:k]
        best = [(int(tied[i]), float(lp[tied[i]])) for i in order]
    return TokenLogprob(int(token), float(lp[token]), best)


def token_text(tokenizer, token: int) -> tuple:
    """(text, bytes) of one token: its bytes as UTF-8, a byte that is not (half a
    character) written as a \\xNN escape, as OpenAI does."""
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="backslashreplace"), list(raw)


def content(tokenizer, entries) -> list:
    """OpenAI's chat ``logprobs.content``: per TokenLogprob its ``token`` (text),
    ``logprob``, ``bytes`` and ``top_logprobs`` (the same three of each alternative)."""
    def one(token, logprob):
        text, raw = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": raw}
    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries]
