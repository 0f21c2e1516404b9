"""Test drivers of the engine core: ``run_core`` (requests through an EngineCore, results
by tag, in finishing order) and ``reference_generate`` (an independent oracle: one prompt
fed and sampled with plain forward calls, the loop the core must agree with)."""

from __future__ import annotations

import numpy as np

from libk3.engine.core import EngineCore
from libk3.engine.sampler import Sampler
from libk3.engine.stops import Stops


def run_core(forward, new_state, reqs, width: int, on_done=None, on_failed=None, **kw):
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
    while core.lanes or core.pending:
        absorb(core.step())
    return done, core.stats


def reference_generate(forward, state, prompt_ids, settings, tokenizer=None):
    """(generated ids, stop reason, logits of every fed position): the prompt in chunks of
    settings.prefill_chunk, then each sampled token fed back, the last one too."""
    rows = []
    for i in range(0, len(prompt_ids), settings.prefill_chunk):
        rows.append(forward(prompt_ids[i:i + settings.prefill_chunk], state))
    sampler = Sampler.of(settings, state.pos)
    stops = Stops(settings, tokenizer, sampler.grammar)
    limit = settings.limit(state.pos)
    out, reason = [], "length"
    while len(out) < limit:
        tok = sampler(rows[-1][-1], state.pos, state.ids)
        out.append(tok)
        rows.append(forward([tok], state))
        why = stops.see(tok)
        if why:
            reason = why
            break
    return out, reason, np.concatenate(rows)
