"""The engine core's test oracle: ``reference_generate``, one prompt fed and sampled with
plain forward calls, the loop the core must agree with (requests are driven through the
core by ``libk3.engine.generate.run_requests``)."""

from __future__ import annotations

import numpy as np

from libk3.engine.sampler import Sampler
from libk3.engine.stops import Stops


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
