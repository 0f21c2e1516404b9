"""The drafting side of one k3-run invocation: which proposer a run drafts with, how many
proposals a pass verifies, and the --draft-dump file.

Owns: ``start_drafting`` (a DSpark draft wired to the session's forward, or prompt
lookup for --spec), ``draft_cap`` and ``DraftDump``. Does not own: proposing or
verifying (``libk3.speculate.speculative``, ``libk3.speculate.proposers``), the draft model
(``libk3.draft``), the run's options (``runner.RunOptions``).
"""

from __future__ import annotations

import numpy as np


def draft_cap(opts, draft_cfg) -> int:
    """Proposals a pass verifies at most with a DSpark draft: --draft-max, within its
    block."""
    return min(opts.draft_max or draft_cfg.block_size, draft_cfg.block_size)


def start_drafting(opts, draft, session):
    """The run's ``Drafting`` (a DSpark draft, or prompt lookup for --spec), or None;
    the session's forward then captures the taps the draft reads."""
    from ..speculate.speculative import Drafting
    if draft is None:
        if not opts.spec:
            return None
        from ..speculate.proposers import PromptLookup
        return Drafting(PromptLookup(), opts.spec)
    from ..draft.forward import DraftForward
    from ..speculate.proposers import DSpark
    weights = session.weights
    model = DraftForward(draft.cfg, draft.weights, weights.embed, weights.model()["lm_head"])
    proposer = DSpark(model, note=opts.warn, dump=opts.draft_dump is not None,
                      identity=draft.identity)
    session.forward.capture(proposer.taps)
    dump = DraftDump(opts.draft_dump) if opts.draft_dump else None
    return Drafting(proposer, draft_cap(opts, draft.cfg), on_dump=dump)


class DraftDump:
    """--draft-dump: per verify pass, the taps, the block, the draft's logits before and
    after the Markov bias, its confidence and the target's verify logits, written as one
    .npz at the end of the run (arrays ``<name>.<pass>``; dspark.md §9)."""

    def __init__(self, path: str):
        self.path = path if path.endswith(".npz") else path + ".npz"
        self.arrays = {}
        self.n = 0

    def __call__(self, record: dict) -> None:
        for name, value in record.items():
            if value is not None:
                self.arrays[f"{name}.{self.n}"] = np.asarray(value)
        self.n += 1

    def write(self) -> None:
        from ..io.atomic import replacing
        with replacing(self.path) as f:
            np.savez(f, passes=np.int64(self.n), **self.arrays)
