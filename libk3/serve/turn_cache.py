"""Reuse of earlier turns: the state store as a server keeps it.

Owns: the server's shape of the state store (``libk3.store``): its RAM tier sized by
``--reuse-gb``, its disk tier the run's prefix cache (formats/chat.md "Reuse of earlier
turns"), written by the store's writer thread so no request in flight waits for a
snapshot. Does not own: the tiers, the lookup or the writer (``libk3.store``), when
states are offered, kept or taken (the engine core, as the server's worker asks it in
each request), the snapshot files (``libk3.engine.prefix_cache``), or the forward.
"""

from __future__ import annotations

from ..store import StateStore
from ..store.writer import WRITES_QUEUED

__all__ = ["TurnCache", "WRITES_QUEUED"]


class TurnCache(StateStore):
    """Kept states of a server: ``ram_bytes`` bounds the copies held in memory (0: none);
    ``prefix_cache`` (a PrefixCache, or None) is the disk tier: what RAM lets go is
    written there, ``keep`` writes there at once, and a lookup that RAM cannot answer
    well is asked there."""

    def __init__(self, cfg, ram_bytes: int, prefix_cache=None):
        super().__init__(cfg, ram_bytes, prefix_cache, background=True)
