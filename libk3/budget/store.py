"""The state store's share of a run's memory: the one line of the budget for states kept
for reuse (formats/presets.md 2 and 5).

Owns: how much the store's RAM tier (``libk3.store``) may hold for each kind of run, the
states its writer holds, and the line a budget's reasons show for them. Does not own:
the store itself, the admission arithmetic (``admission``), or a state's size
(``sizes.sequence_bytes``).

Why whole sequences for a batch: its lines usually share one preamble, so the RAM tier
holds one state (the shared prefix last built or read); others come from disk or are
rebuilt. Why a server counts its writer's states: each snapshot queued for the disk
tier, and the one being written, is a state's copy held until written.
"""

from __future__ import annotations

import dataclasses

from ..units import size_text

# States a batch run's store holds in RAM: the snapshot of the prefix its lines share.
BATCH_SNAPSHOTS = 1
# A server's with a prefix cache: the states its snapshot writer holds, those queued and
# the one being written (``libk3.store.writer``).
SERVER_SNAPSHOTS = 3


@dataclasses.dataclass(frozen=True)
class StoreShare:
    """The store of one run: its RAM tier's byte budget (``ram_bytes``; None: bounded by
    ``ram_states`` alone; 0: no RAM tier) and state count (``ram_states``; None: no
    count bound), and ``states``: whole sequences' states the store holds beside the
    lanes, each counted as one sequence (``held`` of ``admission.batch_width``).
    ``beside``: the RAM tier's bytes are counted in what the front end holds beside the
    model (a server's ``--reuse-gb``, ``sizes.with_beside``)."""
    ram_bytes: int | None = 0
    ram_states: int | None = 0
    states: int = 0
    beside: bool = False
    disk: bool = False

    def line(self, sequence: int) -> str:
        """What the budget's reasons say of the store, ``sequence`` bytes a state."""
        parts = []
        if self.beside:
            parts.append("RAM tier --reuse-gb (counted beside the model)")
        elif self.ram_states:
            parts.append(f"RAM tier {self.ram_states} state"
                         f"{'s' if self.ram_states > 1 else ''}")
        else:
            parts.append("no RAM tier")
        if self.states:
            parts.append(f"{self.states} sequence{'s' if self.states > 1 else ''} of "
                         f"{size_text(sequence)} held beside the lanes")
        parts.append("disk tier: the prefix cache" if self.disk else "no disk tier")
        return "state store: " + "; ".join(parts)

    def noted(self, budget, sequence: int):
        """``budget`` with the store's ``line`` among its reasons, when the run has a
        store (None, a resident run's: None)."""
        if budget is None or not (self.states or self.beside or self.disk):
            return budget
        return dataclasses.replace(budget, reasons=budget.reasons + (self.line(sequence),))


def store_share(*, serve: bool, batch: bool, disk: bool, share_prefixes: bool) -> StoreShare:
    """The store of a run: a server's RAM tier is ``--reuse-gb`` (counted beside the
    model) and with a disk tier its writer holds SERVER_SNAPSHOTS states; a batch that
    shares prefixes holds BATCH_SNAPSHOTS states in RAM; any other run (one prompt, a
    chat) keeps nothing in RAM, only on disk with ``--prefix-cache``."""
    if serve:
        return StoreShare(None, None, SERVER_SNAPSHOTS if disk else 0, True, disk)
    if batch and share_prefixes:
        return StoreShare(None, BATCH_SNAPSHOTS, BATCH_SNAPSHOTS, False, disk)
    return StoreShare(0, 0, 0, False, disk)
