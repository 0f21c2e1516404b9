"""Prompts through the engine core: ``generate`` (a one-prompt run, a chat turn, a batch
line at width 1), ``prefill`` (feeding ids into a state without generating: a
prompt-only request) and ``run_requests`` (a list of requests at width N, to their end).

Owns: driving an ``EngineCore`` of width 1 for one Request and handing its events to the
caller's callbacks (tokens as they are sampled, prefill progress, the state once the
prompt is in); driving a core over a fixed list of requests (a batch's shared prefixes,
the benches' and tests' driver; a batch file and the server add requests as they come,
``run.batch_sink``, ``serve.worker``). Does not own: the loop, chunking, sampling, stop
rules and admission from the state store (``core``), weights, printing, the CLI.

Every generated token is fed back (its logits row is produced), so the state after a
call holds the whole conversation and a later turn continues without re-prefill, and
``--logits-out`` has one row per prompt or generated token (row i predicts token i+1);
a one-shot run that keeps neither passes ``feed_last=False`` and skips the last pass.
An empty prompt continues the state: its first token comes from the logits the state
kept of its last position (``State.logits``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from typing import TYPE_CHECKING, NamedTuple

from .core import EngineCore, Request
from .core import Abandoned, GenResult, GenSettings

if TYPE_CHECKING:                  # the model is not imported by option parsing (start-up)
    from ..model.state import State


class Prompt(NamedTuple):
    """Prompt ids with the ``forward.ImageRows`` standing at their pads
    (formats/model/vision.md §8.2): what ``generate`` takes for a prompt with images."""
    ids: list
    images: tuple = ()


class Reuse(NamedTuple):
    """What a one-prompt run asks of a state store (``libk3.store.StateStore``):
    ``resume`` from its longest prefix of the prompt (``core.Request.reuse``), and the
    prompt counts after which the state is kept there (``core.Request.store_at``)."""
    store: object
    resume: bool = True
    keep_at: tuple = ()


__all__ = ["Abandoned", "GenResult", "GenSettings", "Prompt", "Reuse", "generate", "prefill",
           "run_requests"]


def prefill(forward, state: State, ids, chunk: int, keep_logits: bool, progress=None):
    """Feed ``ids`` into ``state`` as a prompt-only request (nothing generated), ``chunk``
    ids per pass; returns (logits of every fed position when ``keep_logits``, else None;
    the last position's row, or for no ids the state's own, None for an empty state).
    ``progress(n)`` hears each pass's n ids."""
    if not len(ids):
        return (np.zeros((0, state.cfg.vocab_size), np.float32) if keep_logits else None,
                state.logits)
    res = generate(forward, state, ids, GenSettings(gen=0, prefill_chunk=chunk),
                   hooks=Hooks(progress=progress), keep_logits=keep_logits, feed_last=False)
    return res.logits, state.logits


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What a one-prompt run tells its caller as it goes: ``on_token(id)`` as each token is
    produced; ``progress(n)`` as each chunk of n prompt ids is fed (and once for the ids
    resumed from the state store, before any is fed); ``after_prefill(state)``
    once the prompt is in the state (the state a run saves); ``interrupted()`` is asked
    before each sampled token joins the reply (``core.Request``)."""
    on_token: object = None
    progress: object = None
    after_prefill: object = None
    interrupted: object = None


def generate(forward, state: State | None, prompt_ids, settings: GenSettings, *,
             tokenizer=None, hooks: Hooks = Hooks(), keep_logits: bool = False,
             feed_last: bool = True, drafting=None, logprobs: int | None = None,
             reuse: Reuse | None = None) -> GenResult:
    """Run one prompt: an ``EngineCore`` of width 1 (``core.Request`` says what each
    argument means), its events to ``hooks``. ``logprobs``: alternatives per generated
    token whose log-probabilities the result carries (None: none). A lane's own failure
    (its grammar gave up) is raised here. ``prompt_ids``: ids, or a ``Prompt`` (ids and
    the image rows standing at their pads). ``state`` None: the store's longest prefix of
    the prompt (``reuse``), else a new state; the result's ``reused_tokens`` says how
    many prompt ids that held (its ``prompt_ids`` are then the rest)."""
    images = ()
    if isinstance(prompt_ids, Prompt):
        prompt_ids, images = prompt_ids
    store = None if reuse is None else reuse.store
    core = EngineCore(forward, lambda n: _fresh(forward, n), 1,
                      chunk=settings.prefill_chunk, tokenizer=tokenizer, drafting=drafting,
                      store=store)
    req = Request(None, [int(i) for i in prompt_ids], settings, state, logits=keep_logits,
                  feed_last=feed_last or keep_logits, interrupted=hooks.interrupted,
                  logprobs=logprobs, images=tuple(images),
                  reuse=reuse is not None and reuse.resume,
                  store_at=() if reuse is None else tuple(reuse.keep_at))
    core.add(req)
    if req.reused and hooks.progress is not None:
        hooks.progress(req.reused)
    while True:
        for ev in core.step():
            if ev.kind == "token":
                if hooks.on_token is not None:
                    hooks.on_token(ev.data[0])
            elif ev.kind == "fed":
                if hooks.progress is not None:
                    hooks.progress(ev.data)
            elif ev.kind == "prefilled":
                if hooks.after_prefill is not None:
                    hooks.after_prefill(ev.data)
            elif ev.kind == "failed":
                raise ev.data
            elif ev.kind == "done":
                res = ev.data
                if drafting is not None:
                    res.spec = drafting.stats.to_json()
                return res


def run_requests(forward, new_state, reqs, width: int, on_done=None, on_failed=None, **kw):
    """Every Request of ``reqs`` through an EngineCore of ``width`` (keywords as there),
    each added when a lane is free; ({tag: GenResult}, CoreStats). ``on_done(req, res)``
    hears each as it finishes; a lane's failure goes to ``on_failed(req, e)``, else it is
    raised."""
    core = EngineCore(forward, new_state, width, **kw)
    done = {}

    def absorb(events):
        for ev in events:
            if ev.kind == "done":
                done[ev.request.tag] = ev.data
                if on_done is not None:
                    on_done(ev.request, ev.data)
            elif ev.kind == "failed":
                if on_failed is None:
                    raise ev.data
                on_failed(ev.request, ev.data)
    for req in reqs:
        while core.full:
            absorb(core.step())
        core.add(req)
    while core.busy:
        absorb(core.step())
    return done, core.stats


def _fresh(forward, positions: int) -> State:
    """A new State of ``forward``'s model with room for ``positions``."""
    from ..model.state import State
    return State(forward.cfg, capacity=max(64, positions))
