"""The generation loop: prefill in chunks, then decode token by token, with stop rules.

Owns: turning a prompt into generated ids with a Forward, a State and a Sampler; timing;
collecting logits for ``--logits-out``. Does not own: weights, printing, the CLI, or the
stop rule (``stops``).

Every generated token is fed back (its logits row is produced), so the state after a
call holds the whole conversation and a later turn continues without re-prefill, and
``--logits-out`` has one row per prompt or generated token (row i predicts token i+1);
a one-shot run that keeps neither passes ``feed_last=False`` and skips the last pass.
An empty prompt continues the state: its first token comes from the logits the state
kept of its last position (``State.logits``).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from typing import TYPE_CHECKING

from ..config import K3_CONTEXT
from ..errors import UsageError
from .defaults import PREFILL_CHUNK
from .settings import UNTIL_END

if TYPE_CHECKING:                  # the model is not imported by option parsing (start-up)
    from ..model.state import State
from .sampler import Sampler
from .stops import Stops


class Abandoned(Exception):
    """Raised inside generation when a batch's deadline passes (the prompts in flight are
    dropped, to be redone by the next run)."""


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
    context: int = K3_CONTEXT
    logit_bias: tuple = ()
    response_format: object = None
    grammar: object = None

    def limit(self, positions: int) -> int:
        """Tokens to generate after a sequence of ``positions`` (its prompt in): ``gen``,
        or for UNTIL_END the room the context has left; never past the context (a
        generation that reaches it stops there, "length")."""
        room = max(self.context - positions, 0)
        return room if self.gen == UNTIL_END else min(self.gen, room)


@dataclasses.dataclass
class GenResult:
    prompt_ids: list
    generated_ids: list
    stop_reason: str
    prefill_seconds: float
    decode_seconds: float
    logits: np.ndarray | None = None
    spec: dict | None = None
    stop_strings: tuple = ()       # what the text ends at (``stops.returned_text``)
    reused_tokens: int = 0         # of prompt_ids, resumed from a kept state, not prefilled
    grammar_seconds: float | None = None   # computing the grammar's masks (None: no grammar)

    @property
    def seconds_per_token(self) -> float:
        n = len(self.generated_ids)
        return self.decode_seconds / n if n else 0.0


def prefill(forward, state: State, ids, chunk: int, keep_logits: bool, progress=None,
            observe=None):
    """Feed ``ids`` in chunks; returns logits of every position (keep_logits) or the last
    (for no ids, the state's own last row, or None for an empty state).
    ``observe(state, taps)`` hears each chunk's captured taps (a draft's context)."""
    rows = []
    last = state.logits
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        taps = [] if observe is not None else None
        logits = forward(part, state, all_logits=keep_logits, phase="prefill", taps=taps)
        if observe is not None:
            observe(state, taps[0])
        if keep_logits:
            rows.append(logits)
        last = logits[-1]
        if progress is not None:
            progress(len(part))
    if keep_logits:
        return (np.concatenate(rows) if rows else np.zeros((0, state.cfg.vocab_size),
                                                            np.float32)), last
    return None, last


def generate(forward, state: State, prompt_ids, settings: GenSettings, *, tokenizer=None,
             on_token=None, keep_logits: bool = False, progress=None,
             after_prefill=None, feed_last: bool = True, drafting=None,
             interrupted=None) -> GenResult:
    """Run one prompt. ``on_token(id)`` is called as each token is produced;
    ``after_prefill(state)`` once the prompt is in the state (reuse of earlier turns).
    ``interrupted()`` is asked before each token joins the reply: True ends generation
    there (stop reason "interrupted") with every token so far fed, the state a ``gen``
    ending at that token leaves (a chat's Ctrl-C; a prefill runs to its end first).
    With ``feed_last`` False (and no ``keep_logits``), the token that ends generation by
    length or stop id is not fed: nothing would use its pass (at the floor, a whole trunk
    read), and the state then ends before it. ``drafting`` (``speculative.Drafting``)
    proposes tokens to verify several per pass: the tokens and logits are the same."""
    prompt_ids = [int(i) for i in prompt_ids]
    if not prompt_ids and state.pos and state.logits is None:
        raise UsageError("this state does not hold its last position's logits; give a "
                         "prompt to continue it")
    sampler = Sampler.of(settings, state.pos + len(prompt_ids))
    spec = drafting.speculator() if drafting is not None else None
    t0 = time.perf_counter()
    all_rows, last = prefill(forward, state, prompt_ids, settings.prefill_chunk, keep_logits,
                             progress, observe=spec.observe if spec is not None else None)
    if after_prefill is not None:
        after_prefill(state)
    t1 = time.perf_counter()
    rows = [all_rows] if keep_logits else []
    generated: list[int] = []
    reason = "length"
    stops = Stops(settings, tokenizer, sampler.grammar)
    limit = settings.limit(state.pos)
    tok = None if last is None or limit <= 0 else sampler(last, state.pos, state.ids)
    if tok is not None and interrupted is not None and interrupted():
        tok, reason = None, "interrupted"
    while tok is not None:
        generated.append(tok)
        if on_token is not None:
            on_token(tok)
        reason = stops.see(tok) or reason
        ends = reason != "length" or len(generated) >= limit
        if ends and not feed_last and not keep_logits:
            break                        # the unfed last token: generation ends here
        if spec is None:
            logits = forward([tok], state, all_logits=True, phase="decode")
            kept = []
        else:
            room = 0 if ends else limit - len(generated)
            seg = spec.plan(state, tok, room, stops.ids, sampler)
            t = time.perf_counter()
            logits = forward.run([seg])[0]
            kept = []
            for d in spec.accept(seg, logits, sampler):
                kept.append(d)
                generated.append(d)
                if on_token is not None:
                    on_token(d)
                reason = stops.see(d) or reason
                if reason != "length" or len(generated) >= limit:
                    break
            spec.commit(seg, len(kept), time.perf_counter() - t)
            spec.width.record(len(seg.ids), time.perf_counter() - t,   # the commit's too
                              not seg.verify)
            logits = logits[:len(kept) + 1]
        if keep_logits:
            rows.append(logits)
        if ends or reason != "length" or len(generated) >= limit:
            break
        if interrupted is not None and interrupted():
            reason = "interrupted"
            break
        tok = sampler(logits[-1], state.pos, state.ids)
    t2 = time.perf_counter()
    return GenResult(prompt_ids, generated, reason, t1 - t0, t2 - t1,
                     np.concatenate(rows).astype(np.float32) if keep_logits else None,
                     spec.stats.to_json() if spec is not None else None,
                     tuple(settings.stop_strings),
                     grammar_seconds=None if sampler.grammar is None else
                     sampler.grammar.seconds)
