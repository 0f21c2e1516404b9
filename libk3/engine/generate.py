"""The generation loop: prefill in chunks, then decode token by token, with stop rules.

Owns: turning a prompt into generated ids with a Forward, a State and a Sampler; timing;
collecting logits for ``--logits-out``. Does not own: weights, printing, or the CLI.

Every generated token is fed back (its logits row is produced), so the state after a
call holds the whole conversation and a later turn continues without re-prefill, and
``--logits-out`` has one row per prompt or generated token (row i predicts token i+1).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..model.state import State
from .sampler import Sampler


@dataclasses.dataclass
class GenSettings:
    gen: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple = ()
    stop_strings: tuple = ()
    prefill_chunk: int = 64


@dataclasses.dataclass
class GenResult:
    prompt_ids: list
    generated_ids: list
    stop_reason: str
    prefill_seconds: float
    decode_seconds: float
    logits: np.ndarray | None = None

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
             on_token=None, keep_logits: bool = False, progress=None) -> GenResult:
    """Run one prompt. ``on_token(id)`` is called as each token is produced."""
    sampler = Sampler(settings.temperature, settings.top_p, settings.seed)
    prompt_ids = [int(i) for i in prompt_ids]
    t0 = time.perf_counter()
    all_rows, last = prefill(forward, state, prompt_ids, settings.prefill_chunk, keep_logits,
                             progress)
    t1 = time.perf_counter()
    rows = [all_rows] if keep_logits else []
    generated: list[int] = []
    reason = "length"
    text = b""
    while len(generated) < settings.gen and last is not None:
        tok = sampler(last)
        generated.append(tok)
        if on_token is not None:
            on_token(tok)
        logits = forward([tok], state, all_logits=True, phase="decode")
        if keep_logits:
            rows.append(logits)
        last = logits[-1]
        if tok in settings.stop_ids:
            reason = "stop_id"
            break
        if settings.stop_strings and tokenizer is not None:
            text += tokenizer.decode_bytes([tok])
            if any(s.encode() in text for s in settings.stop_strings):
                reason = "stop_string"
                break
    t2 = time.perf_counter()
    return GenResult(prompt_ids, generated, reason, t1 - t0, t2 - t1,
                     np.concatenate(rows).astype(np.float32) if keep_logits else None)
