"""Where speculative proposals come from: the sequence's own ids, or the DSpark draft.

Owns: the two proposers a ``Speculator`` drives, each with ``taps`` (the target hidden
states it needs captured, or None), ``propose(state, anchor, n, pick) -> Proposal`` and
``observe(state, taps)`` (called after every pass of the sequence with the committed
positions' taps). Does not own: verification or commit (``speculative``), the draft's
math (``libk3.draft.forward``).

A sequence's draft context lives on its State (``State.draft``), so it is copied, kept
across chat turns, saved and loaded with the State (formats/state.md) and dropped with it;
a loaded context is adopted by the draft whose identity it records. A State fed without
taps (made before the draft was there, or loaded without this draft's context) has none,
and the draft proposes nothing for it.
"""

from __future__ import annotations

import numpy as np

from ..draft.forward import DraftCache
from ..model.forward import Taps
from ..model.state import SavedDraft
from .speculative import Proposal


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


class PromptLookup:
    """``--spec``: the tokens that followed the latest earlier occurrence of the context's
    longest matching suffix (prompt-lookup decoding); no confidence, no taps."""

    taps = None
    identity = None         # no context of its own for a state to keep

    def propose(self, state, anchor: int, n: int, pick) -> Proposal:
        return Proposal(lookup_drafts(state.ids + [int(anchor)], n))

    def observe(self, state, taps) -> None:
        pass


class DSpark:
    """``--draft``: the DSpark draft (dspark.md §5), reading the taps of the target passes
    that fed the sequence. ``note(text)`` tells the user once why drafting stopped."""

    def __init__(self, draft, note=None, dump: bool = False, identity: str | None = None):
        self.draft = draft
        self.identity = identity        # the draft's weights (``draft_identity``)
        self.cfg = draft.cfg
        self.taps = Taps(tuple(self.cfg.target_layer_ids), self.cfg.aux_hidden_stream)
        self.note = note
        self.dump = dump
        self._noted = set()

    def observe(self, state, taps) -> None:
        if taps is None:
            return
        cache = self._context(state)
        if cache is None:
            if state.pos != len(taps):       # fed before: no context to draft from
                return
            cache = state.draft = self.draft.new_cache(self.identity)
        if cache.length + len(taps) == state.pos:
            self.draft.ingest(cache, taps)

    def _context(self, state):
        """The state's draft context; one read from a file (``SavedDraft``) becomes this
        draft's when it records this draft's identity and rows of its shapes, else it is
        dropped (another draft's rows would only propose worse)."""
        cache = state.draft
        if isinstance(cache, SavedDraft):
            ok = (self.identity is not None and cache.identity == self.identity
                  and cache.latent.shape[0] == self.cfg.num_hidden_layers
                  and cache.latent.shape[2] == self.cfg.kv_lora_rank
                  and cache.k_pe.shape[2] == self.cfg.qk_rope_head_dim)
            cache = state.draft = (DraftCache.of_rows(cache.identity, cache.latent,
                                                      cache.k_pe) if ok else None)
        return cache

    def propose(self, state, anchor: int, n: int, pick) -> Proposal:
        cache = self._context(state)
        if cache is None or cache.length != state.pos:
            self._tell("cold", "the draft has no context for this state (it was fed "
                       "without this draft, or saved without its context); drafting is "
                       "off for it")
            return Proposal([])
        p = state.pos
        if p + self.cfg.block_size > self.cfg.trained_context:
            self._tell("long", f"drafting is off past {self.cfg.trained_context:,} positions "
                       "(the draft's trained context, dspark.md §7)")
            return Proposal([])
        block = [int(anchor)]             # the anchor, then each proposal as it is picked

        def pick_k(k, logits):            # proposal k follows the anchor and k proposals
            t = int(pick(logits, p + k + 1, state.ids, block[:k + 1]))
            block[k + 1:] = [t]
            return t
        got = self.draft.propose(cache, int(anchor), min(n, self.cfg.block_size),
                                 pick=pick_k)
        dump = None
        if self.dump:
            dump = {"draft_base_logits": got.base, "draft_logits": got.logits,
                    "confidence": got.confidence, "proposed": np.asarray(got.tokens)}
        return Proposal([int(t) for t in got.tokens], np.asarray(got.confidence), dump)

    def _tell(self, key: str, text: str) -> None:
        if self.note is not None and key not in self._noted:
            self._noted.add(key)
            self.note(text)
