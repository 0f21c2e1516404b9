"""Perplexity and KL divergence of a text, llama-perplexity's way (docs/run.md
"Perplexity").

Owns: cutting a text's tokens into windows of the context length, scoring the second
half of each (the mean negative log-likelihood of each token given the ones before it in
its window), the running and final figures with their ± (the standard error of the
mean, propagated to the perplexity as ppl × stderr), and, against saved logits
(formats/logits.md), the mean KL divergence and the share of positions whose likeliest
token is the same. Does not own: the forward (``window_logits`` is given: the engine's,
or the float64 reference in the tests), tokenizing, or printing.

Why only the second half: a position early in a window sees few tokens before it, so its
loss says more about the window's cut than about the model; llama-perplexity scores
positions C/2 .. C-2 of each window of C tokens for the same reason, and the same figure
lets a user compare the two engines. All arithmetic is float64 on the float32 logits,
row by row in a fixed order, so the figures are the same bytes at every budget and
thread count (the logits are).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np

from ..errors import UsageError
from ..io.logits_file import LogitsHeader, LogitsReader, scored_per_window, writing

DEFAULT_CTX = 512          # llama-perplexity's default window
MAX_TEXT_BYTES = 1 << 30   # a longer text is refused unread: its windows would take days


def read_text(path) -> str:
    """The text of ``path`` (``-``: standard input), strict UTF-8, at most MAX_TEXT_BYTES
    (``prompt_file``'s rules: FormatError naming the file)."""
    from .prompt_file import read_prompt_file
    return read_prompt_file(path, MAX_TEXT_BYTES)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(K, V) float32 -> (K, V) float64 log-probabilities."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))


@dataclasses.dataclass
class Mean:
    """A running mean with its standard error: sqrt(var / (n - 1)), var the population
    variance of the values (llama-perplexity's estimate)."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, values: np.ndarray) -> None:
        v = np.asarray(values, dtype=np.float64)
        self.n += len(v)
        self.total += float(v.sum())
        self.squares += float((v * v).sum())

    @property
    def mean(self) -> float:
        return self.total / self.n

    @property
    def stderr(self) -> float:
        if self.n < 2:
            return 0.0
        var = max(self.squares / self.n - self.mean ** 2, 0.0)
        return math.sqrt(var / (self.n - 1))


@dataclasses.dataclass(frozen=True)
class Plan:
    """The windows of a text: ``windows`` of ``ctx`` tokens from its start, positions
    ``first`` .. ctx-2 of each scored (each predicts the token after it)."""

    ctx: int
    windows: int
    tokens: int

    @property
    def first(self) -> int:
        return self.ctx // 2

    @property
    def per_window(self) -> int:
        return scored_per_window(self.ctx)

    def window(self, ids, i: int) -> list:
        return list(ids[i * self.ctx:(i + 1) * self.ctx])

    def targets(self, ids) -> np.ndarray:
        """The token each scored position predicts, window by window."""
        rows = [self.window(ids, i)[self.first + 1:] for i in range(self.windows)]
        return np.asarray(rows, dtype=np.int64).reshape(-1)


def plan(ids, ctx: int, where: str) -> Plan:
    """The windows of ``ids`` (UsageError naming ``where`` when not one window fits)."""
    if ctx < 2:
        raise UsageError(f"--ctx-size {ctx}: a perplexity window needs at least 2 tokens")
    if len(ids) < ctx:
        raise UsageError(f"{where}: {len(ids):,} tokens, fewer than one window of "
                         f"--ctx-size {ctx:,} (give a smaller -c or a longer text)")
    return Plan(ctx, len(ids) // ctx, len(ids))


def _check_base(base: LogitsReader, p: Plan, vocab: int, targets) -> None:
    """UsageError unless ``base`` holds this text cut as this run cuts it."""
    h = base.header
    for what, theirs, ours in (("vocabulary", h.vocab, vocab), ("--ctx-size", h.ctx, p.ctx),
                               ("windows", h.windows, p.windows)):
        if theirs != ours:
            base.close()
            raise UsageError(f"--kl-divergence {base.path}: its {what} is {theirs:,}, this "
                             f"run's {ours:,} (the same text and -c are needed)")
    if not np.array_equal(base.targets, targets):
        base.close()
        raise UsageError(f"--kl-divergence {base.path}: its tokens differ from this text's "
                         "(another text or tokenizer)")


def evaluate(window_logits, ids, p: Plan, vocab: int, *, save=None, base=None,
             on_window=None) -> dict:
    """Perplexity of ``ids`` cut by ``p``: ``window_logits(window_ids, first)`` gives
    the (K, V) float32 logits of positions ``first`` .. C-2; ``save``: a path to write
    them to (formats/logits.md); ``base``: a saved-logits path to compare against;
    ``on_window(i, doc)`` hears the running figures after each window. Returns the
    result document (no times: it is the same bytes on every run)."""
    targets = p.targets(ids)
    reader = None
    if base is not None:
        reader = LogitsReader(base)
        _check_base(reader, p, vocab, targets)
    nll, kl, same = Mean(), Mean(), Mean()
    header = LogitsHeader(vocab, p.ctx, p.per_window, p.windows)
    k = p.per_window
    writer = contextlib.nullcontext() if save is None else writing(save, header, targets)
    try:
        with writer as out:
            for i in range(p.windows):
                rows = window_logits(p.window(ids, i), p.first)
                logp = log_softmax(rows)
                tgt = targets[i * k:(i + 1) * k]
                nll.add(-logp[np.arange(k), tgt])
                if out is not None:
                    out.add(rows)
                if reader is not None:
                    base_logp = log_softmax(reader.window(i))
                    kl.add((np.exp(base_logp) * (base_logp - logp)).sum(axis=1))
                    same.add(base_logp.argmax(axis=1) == logp.argmax(axis=1))
                if on_window is not None:
                    on_window(i, _doc(p, nll, kl if reader else None, same))
            if reader is not None:
                reader.finish()          # a damaged base: no result, nothing saved
    finally:
        if reader is not None:
            reader.close()
    doc = _doc(p, nll, kl if reader else None, same)
    if base is not None:
        doc["kl_divergence"]["base"] = str(base)
    if save is not None:
        doc["saved_logits"] = str(save)
    return doc


def _doc(p: Plan, nll: Mean, kl, same) -> dict:
    ppl = math.exp(nll.mean)
    doc = {"ctx": p.ctx, "windows": p.windows, "tokens": p.tokens, "scored": nll.n,
           "mean_nll": nll.mean, "mean_nll_stderr": nll.stderr, "ppl": ppl,
           "ppl_stderr": ppl * nll.stderr}
    if kl is not None:
        doc["kl_divergence"] = {"mean": kl.mean, "stderr": kl.stderr,
                                "same_top": same.mean, "same_top_stderr": same.stderr}
    return doc


def engine_window_logits(session, chunk: int):
    """``window_logits`` of the engine: each window from a new state, fed ``chunk``
    tokens per pass; only the scored positions' rows are kept."""
    def window_logits(ids, first):
        state = session.new_state()
        rows = []
        for i in range(0, len(ids) - 1, chunk):
            part = ids[i:min(i + chunk, len(ids) - 1)]
            wanted = i + len(part) > first
            logits = session.forward(part, state, all_logits=wanted, phase="prefill")
            if wanted:
                rows.append(logits[max(first - i, 0):])
        return np.concatenate(rows)
    return window_logits


def text_line(doc: dict) -> str:
    """The final estimate, llama-perplexity's words, and the KL figures when compared."""
    line = f"Final estimate: PPL = {doc['ppl']:.4f} +/- {doc['ppl_stderr']:.5f}"
    kl = doc.get("kl_divergence")
    if kl:
        line += (f"\nKL divergence: mean {kl['mean']:.6f} +/- {kl['stderr']:.6f}; same top "
                 f"token: {100 * kl['same_top']:.3f}% +/- {100 * kl['same_top_stderr']:.3f}%")
    return line
