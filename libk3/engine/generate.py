"""The generation loop: prefill in chunks, then decode token by token, with stop rules.

Owns: turning a prompt into generated ids with a Forward, a State and a Sampler; timing;
collecting logits for ``--logits-out``. Does not own: weights, printing, or the CLI.

Every generated token is fed back (its logits row is produced), so the state after a
call holds the whole conversation and a later turn continues without re-prefill, and
``--logits-out`` has one row per prompt or generated token (row i predicts token i+1);
a one-shot run that keeps neither passes ``feed_last=False`` and skips the last pass.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from typing import TYPE_CHECKING

from .defaults import PREFILL_CHUNK

if TYPE_CHECKING:                  # the model is not imported by option parsing (start-up)
    from ..model.state import State
from .sampler import Sampler


class Abandoned(Exception):
    """Raised inside generation when a batch's deadline passes (the prompts in flight are
    dropped, to be redone by the next run)."""


@dataclasses.dataclass
class GenSettings:
    gen: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple = ()
    stop_strings: tuple = ()
    prefill_chunk: int = PREFILL_CHUNK
    spec: int = 0                  # speculative drafts per step (greedy only); 0 = off


@dataclasses.dataclass
class GenResult:
    prompt_ids: list
    generated_ids: list
    stop_reason: str
    prefill_seconds: float
    decode_seconds: float
    logits: np.ndarray | None = None
    spec: dict | None = None

    @property
    def seconds_per_token(self) -> float:
        n = len(self.generated_ids)
        return self.decode_seconds / n if n else 0.0


def prefill(forward, state: State, ids, chunk: int, keep_logits: bool, progress=None):
    """Feed ``ids`` in chunks; returns logits of every position (keep_logits) or the last."""
    rows = []
    last = None
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        logits = forward(part, state, all_logits=keep_logits, phase="prefill")
        if keep_logits:
            rows.append(logits)
        last = logits[-1]
        if progress is not None:
            progress(len(part))
    return (np.concatenate(rows) if keep_logits else None), last


def generate(forward, state: State, prompt_ids, settings: GenSettings, *, tokenizer=None,
             on_token=None, keep_logits: bool = False, progress=None,
             after_prefill=None, feed_last: bool = True) -> GenResult:
    """Run one prompt. ``on_token(id)`` is called as each token is produced;
    ``after_prefill(state)`` once the prompt is in the state (reuse of earlier turns).
    With ``feed_last`` False (and no ``keep_logits``), the token that ends generation by
    length or stop id is not fed: nothing would use its pass (at the floor, a whole trunk
    read), and the state then ends before it."""
    sampler = Sampler(settings.temperature, settings.top_p, settings.seed)
    prompt_ids = [int(i) for i in prompt_ids]
    t0 = time.perf_counter()
    all_rows, last = prefill(forward, state, prompt_ids, settings.prefill_chunk, keep_logits,
                             progress)
    if after_prefill is not None:
        after_prefill(state)
    t1 = time.perf_counter()
    rows = [all_rows] if keep_logits else []
    generated: list[int] = []
    reason = "length"
    text = b""
    spec_stats = None
    if settings.spec:
        from .speculative import DraftBudget, SpecStats, lookup_drafts, refeed, verify
        if not sampler.greedy:
            raise ValueError("speculative decoding is exact only for greedy decoding")
        spec_stats = SpecStats()
        budget = DraftBudget(settings.spec)
    while len(generated) < settings.gen and last is not None:
        tok = sampler(last)
        drafts = []
        if spec_stats is not None and tok not in settings.stop_ids:
            room = settings.gen - len(generated) - 1
            n = min(budget.allowed(), room)
            drafts = lookup_drafts(prompt_ids + generated + [tok], n) if n > 0 else []
            stop_at = next((j for j, d in enumerate(drafts) if d in settings.stop_ids), None)
            if stop_at is not None:
                drafts = drafts[:stop_at + 1]
        if drafts:
            snap = state.snapshot()
            accepted, logits = verify(forward, state, tok, drafts, spec_stats, snap)
            budget.update(len(drafts), len(accepted))
        else:
            accepted = []
            ends = len(generated) + 1 >= settings.gen or tok in settings.stop_ids
            logits = (None if ends and not feed_last and not keep_logits else
                      forward([tok], state, all_logits=True, phase="decode"))
        fed = [tok] + accepted
        kept = 0
        for t in fed:
            generated.append(t)
            kept += 1
            if on_token is not None:
                on_token(t)
            if t in settings.stop_ids:
                reason = "stop_id"
            elif settings.stop_strings and tokenizer is not None:
                text += tokenizer.decode_bytes([t])
                if any(s.encode() in text for s in settings.stop_strings):
                    reason = "stop_string"
            if reason != "length":
                break
        if kept < len(fed):          # a stop string inside accepted drafts: drop the rest
            logits = refeed(forward, state, snap, fed[:kept], spec_stats)
        if logits is None:             # the unfed last token: generation ends here
            break
        if keep_logits:
            rows.append(logits)
        last = logits[-1]
        if reason != "length":
            break
    t2 = time.perf_counter()
    return GenResult(prompt_ids, generated, reason, t1 - t0, t2 - t1,
                     np.concatenate(rows).astype(np.float32) if keep_logits else None,
                     spec_stats.to_json() if spec_stats is not None else None)
