"""Log-probabilities of tokens, from the logits rows the sampler reads.

Owns: turning one logits row into the log-probability of the token chosen from it and
of the likeliest alternatives (what ``logprobs``/``top_logprobs`` and ``echo`` answer on
the server). Does not own: which rows are scored (``core``, for the requests that ask)
or the wire format (``libk3.serve.protocol``).

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
