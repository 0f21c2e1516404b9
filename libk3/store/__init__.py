"""The state store: sequence states kept for reuse, found again by the token ids they hold.

Owns, one module each: the RAM tier (``ram``: states in memory, least recently used out
within a byte budget or a count), the writer thread that puts states on disk off the
engine's thread (``writer``), and the store itself (``tiers``: RAM first, then the prefix
cache on disk, ``libk3.engine.prefix_cache``, with the one lookup, the longest strict
prefix of a prompt). Does not own: the snapshot files and their format (the disk tier,
``libk3.engine.prefix_cache``, formats/prefix-cache.md), when a state is offered or
resumed (``libk3.engine.core`` at admission, asked by each request), or how much RAM the
store may hold (``libk3.budget.store``).
"""

from __future__ import annotations

from .tiers import StateStore

__all__ = ["StateStore"]
