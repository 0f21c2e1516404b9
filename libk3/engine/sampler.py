"""Choosing the token at a position from its logits and the tokens before it.

Owns: the decision rule only, in one fixed order (formats/model/numerics.md section 12): a
structured-output grammar's mask first, when the request has one (``grammar``: the ids it
does not allow after the tokens generated before the position get -inf), then the
logit bias of the request's biased tokens, the repetition penalty over every token before
the position, the frequency and presence penalties over those this request generated;
greedy is then the first index of the maximum (model.md §5.9); sampling divides by the
temperature, keeps the candidates that min-p, top-k and top-p leave, in order of
(probability descending, id ascending), and takes the candidate with the largest
logit/temperature plus a Gumbel noise drawn for (seed, position, token id) (the
Gumbel-max rule, an exact draw from the candidates' renormalised softmax). Which
settings are valid is ``settings.py``'s rule.

Why keyed by position and not by step: the noise of a position is fixed before any model
runs, so the token there depends only on that position's logits and the tokens before it.
A draft model that picks its proposals with the same noise, and a verify pass that accepts
a proposal when it equals the pick from the target's logits with the tokens before that
row, then give the very tokens plain sampling gives, at every verify width, budget and
thread count (dspark.md §6.2); and the same seed gives the same tokens whether positions
are decoded one at a time, in a verify block or in a lockstep batch.

Why the penalties read the whole context at every pick (no running counts): a verify
pass picks several rows whose contexts differ by the proposals before them, and a
rejected proposal must leave nothing behind; a count of the context per pick is exact by
construction and small beside a forward pass.
"""

from __future__ import annotations

import collections

import numpy as np

from .settings import (MAX_TOP_K, frequency_penalty_problem, logit_bias_pairs,
                       logit_bias_problem, min_p_problem, presence_penalty_problem,
                       repetition_penalty_problem, seed_problem, temperature_problem,
                       top_k_problem, top_p_problem)

NOISE_KEPT = 16             # positions whose noise is kept (a draft and its verify share it)


class Sampler:
    """One sequence's picks. ``start``: the position of its first generated token (the
    presence and frequency penalties count the tokens from there on; earlier ones, a
    prompt or a continued state, count only for the repetition penalty). ``top_k`` 0 or
    -1, ``min_p`` 0, ``repetition_penalty`` 1, the other penalties 0 and an empty
    ``logit_bias`` ((id, bias) pairs, as ``GenSettings.logit_bias``) are off."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, *,
                 top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias=(), start: int = 0, grammar=None):
        why = (temperature_problem(temperature) or top_p_problem(top_p) or seed_problem(seed)
               or top_k_problem(top_k) or min_p_problem(min_p)
               or repetition_penalty_problem(repetition_penalty)
               or presence_penalty_problem(presence_penalty)
               or frequency_penalty_problem(frequency_penalty)
               or logit_bias_problem(logit_bias, MAX_TOP_K))   # the row bounds the ids
        if why:
            raise ValueError(why)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.seed = int(seed)
        self.top_k = max(int(top_k), 0)
        self.min_p = float(min_p)
        self.repetition_penalty = float(repetition_penalty)
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)
        self.logit_bias = logit_bias_pairs(logit_bias)
        self._bias_ids = np.array([i for i, _ in self.logit_bias], dtype=np.int64)
        self._bias = np.array([b for _, b in self.logit_bias], dtype=np.float64)
        self.start = int(start)
        self.grammar = grammar          # a grammar.Matcher, or None: no mask
        self._noise = collections.OrderedDict()

    @classmethod
    def of(cls, settings, start: int) -> "Sampler":
        """The sampler of a request's ``settings`` (``GenSettings``) whose first generated
        token is at position ``start`` (its own grammar matcher when the settings have a
        grammar)."""
        grammar = None if settings.grammar is None else \
            settings.grammar.matcher(settings.stop_ids)
        return cls(settings.temperature, settings.top_p, settings.seed, top_k=settings.top_k,
                   min_p=settings.min_p, repetition_penalty=settings.repetition_penalty,
                   presence_penalty=settings.presence_penalty,
                   frequency_penalty=settings.frequency_penalty,
                   logit_bias=settings.logit_bias, start=start, grammar=grammar)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether a pick reads the tokens before its position."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def __call__(self, logits: np.ndarray, position: int, fed=(), pending=()) -> int:
        """The token at ``position`` (0-based in the sequence) given its logits row; the
        tokens before it are ``fed`` (the state's ids) then ``pending`` (a verify's anchor
        and proposals, not in the state yet), read only when a penalty or a grammar is
        on. The caller's row is never changed (a biased or masked row is a copy)."""
        if self.grammar is not None:
            logits = self.grammar.mask(logits, self.made(position, fed, pending))
        if self.logit_bias:
            logits = np.array(logits, dtype=np.float64)          # a copy, always
            logits[self._bias_ids] += self._bias                 # ids are distinct
        else:
            logits = np.asarray(logits, dtype=np.float64)
        if self.penalised:
            logits = self.penalise(logits, position, fed, pending)
        if self.greedy:
            return int(np.argmax(logits))
        z = logits / self.temperature
        if self.top_p < 1.0 or self.top_k or self.min_p:
            p = np.exp(z - z.max())
            p /= p.sum()
            order = np.lexsort((np.arange(p.size), -p))
            n = p.size
            if self.min_p:                  # a prefix of the order: p is non-increasing
                n = int(np.count_nonzero(p >= self.min_p * p[order[0]]))
            if self.top_k:
                n = min(n, self.top_k)
            if self.top_p < 1.0:
                cum = np.cumsum(p[order[:n]])
                n = int(np.searchsorted(cum, self.top_p * cum[-1]) + 1)
            cand = order[:n]
        else:
            cand = np.arange(z.size)
        score = z[cand] + self.noise(position, z.size)[cand]
        return int(cand[int(np.argmax(score))])

    def made(self, position: int, fed, pending) -> list:
        """The tokens generated (from ``start``) before ``position``."""
        n = len(fed)                    # fed then pending: every token before position
        made = list(fed[self.start:]) + list(pending) if self.start <= n else \
            list(pending)[self.start - n:]
        if self.start + len(made) < position or position < self.start:
            raise ValueError(f"the grammar needs the ids generated before position "
                             f"{position}, got {len(made)} from {self.start}")
        return made[:position - self.start]

    def penalise(self, logits: np.ndarray, position: int, fed, pending) -> np.ndarray:
        """float64 ``logits`` with the penalties of the tokens before ``position``: each id
        in them has its logit divided by the repetition penalty when positive, else
        multiplied; then each id generated from ``start`` on, n times, loses
        frequency * n, then presence."""
        before = np.asarray(list(fed) + list(pending), dtype=np.int64)
        if before.size != position:
            raise ValueError(f"the penalties need the {position} ids before position "
                             f"{position}, got {before.size}")
        out = logits.copy()
        if self.repetition_penalty != 1.0 and before.size:
            seen = np.unique(before)
            x = out[seen]
            out[seen] = np.where(x > 0, x / self.repetition_penalty,
                                 x * self.repetition_penalty)
        made = before[min(self.start, before.size):]
        if made.size and (self.frequency_penalty or self.presence_penalty):
            ids, n = np.unique(made, return_counts=True)
            out[ids] = (out[ids] - self.frequency_penalty * n) - self.presence_penalty
        return out

    def noise(self, position: int, n: int) -> np.ndarray:
        """Gumbel noise of ``position`` for ids 0..n-1: -log(-log(u)), u uniform in (0, 1)
        from PCG64 seeded by (seed, position)."""
        key = (int(position), n)
        g = self._noise.get(key)
        if g is None:
            u = np.random.Generator(np.random.PCG64([self.seed, int(position)])).random(n)
            with np.errstate(divide="ignore"):
                g = -np.log(-np.log(u))               # u = 0 gives -inf: never chosen
            self._noise[key] = g
            if len(self._noise) > NOISE_KEPT:
                self._noise.popitem(last=False)
        else:
            self._noise.move_to_end(key)
        return g
