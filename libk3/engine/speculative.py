"""Speculative decoding without a second model: prompt-lookup drafts, one batched verify.

Owns: proposing up to N draft tokens by n-gram lookup in the context (the tokens that
followed the most recent earlier occurrence of the context's longest matching suffix),
and verifying them in ONE forward call over [current token + drafts], which fetches each
needed expert once for the whole block. Does not own: sampling or the model.

Exactness: only greedy decoding is sped up. Row i of the verify call's logits is
bit-identical to what token-by-token decoding computes (block kernels keep each token's
accumulation order), so accepting drafts while they equal the argmax yields exactly the
greedy stream. On a rejection the state is rolled back and the accepted prefix re-fed
(again bit-identical), so the state never holds a rejected token.
"""

from __future__ import annotations

import numpy as np


def lookup_drafts(context: list, n: int, max_ngram: int = 3) -> list:
    """Up to ``n`` tokens that followed the latest earlier occurrence of the longest suffix
    (length max_ngram down to 1) of ``context``; [] when none matches."""
    if n <= 0 or len(context) < 2:
        return []
    arr = np.asarray(context, dtype=np.int64)
    L = arr.size
    for g in range(min(max_ngram, L - 1), 0, -1):
        suffix = arr[L - g:]
        # candidate starts i with arr[i:i+g] == suffix and i + g < L (something follows)
        for i in range(L - g - 1, -1, -1):
            if np.array_equal(arr[i:i + g], suffix):
                follow = arr[i + g:i + g + n]
                if follow.size:
                    return [int(t) for t in follow]
    return []


MAX_PAUSE = 16          # decode steps without drafting, at most, after failed verifies


class DraftBudget:
    """How many drafts the next step may propose (drafting changes speed, never tokens).

    Why adaptive: a verify whose drafts are all rejected costs about two plain steps (the
    block forward, then a rollback and a re-feed) and reads every drafted token's experts;
    with drafts that are always wrong, a fixed --spec 4 is more than twice as slow as plain
    greedy (bench/README.md, "Speculative decoding"). So: the full N while drafts are accepted; after a partial
    acceptance of k, at most k + 1; after a verify that accepted nothing, no drafting for
    1, 2, 4, ... MAX_PAUSE steps (doubling while failures continue, reset by any
    acceptance)."""

    def __init__(self, n: int):
        self.n = n
        self.cap = n
        self.pause = 0
        self.backoff = 1

    def allowed(self) -> int:
        """Drafts this step may propose (0 while paused; each call is one step)."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.cap

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.cap = min(self.n, 2 * self.cap)
            self.backoff = 1
        elif accepted > 0:
            self.cap = min(self.n, accepted + 1)
            self.backoff = 1
        else:
            self.cap = 1
            self.pause = self.backoff
            self.backoff = min(2 * self.backoff, MAX_PAUSE)


class SpecStats:
    def __init__(self):
        self.drafted = 0
        self.accepted = 0
        self.verify_calls = 0
        self.rollbacks = 0

    def to_json(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": round(self.accepted / self.drafted, 6) if self.drafted else None,
                "verify_calls": self.verify_calls, "rollbacks": self.rollbacks}


def verify(forward, state, tok: int, drafts: list, stats: SpecStats, snap):
    """Feed [tok] + drafts; return (accepted drafts, logits rows of every fed token kept).
    Greedy acceptance: draft j is kept while argmax(row j) == draft j. ``snap`` is the
    state's snapshot from before the call, used to roll back a rejection."""
    logits = forward([tok] + drafts, state, all_logits=True, phase="decode")
    stats.verify_calls += 1
    stats.drafted += len(drafts)
    k = 0
    while k < len(drafts) and int(np.argmax(logits[k])) == drafts[k]:
        k += 1
    stats.accepted += k
    if k == len(drafts):
        return drafts, logits
    return drafts[:k], refeed(forward, state, snap, [tok] + drafts[:k], stats)


def refeed(forward, state, snap, tokens: list, stats: SpecStats):
    """Roll the state back to ``snap`` and feed ``tokens`` again (bit-identical rows)."""
    state.restore(snap)
    stats.rollbacks += 1
    return forward(tokens, state, all_logits=True, phase="decode")
