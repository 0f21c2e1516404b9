"""Memory presets and budgets: how many bytes go to the trunk and to the expert cache.

Owns, one module each: reading and validating ``libk3/presets.yaml`` (``presets``,
formats/presets.md); the model's sizes as the budget sees them (``sizes``:
``ModelSizes``); the smallest budget that can work and how a trunk budget splits into
pinned layers and a ring (``plan``); the fixed overhead a run needs besides its two
budgets, whether a budget fits a machine's memory, the ``auto`` rule, resolving
``--preset``/``--trunk-gb``/``--cache-gb`` in argv order and the batch width
(``admission``); the state store's share, the one line for states kept for reuse
(``store``). This package exports what the other stages use. Does not own:
probing the machine (``libk3.machine``), streaming or caching (``libk3.stream``), or
printing (the click front ends).

Why the memory model is what it is (numbers are Kimi K3's, model.md §3.5, §6):
* peak = trunk budget + cache budget + overhead. The overhead is lm_head and the three
  small model-level vectors (2.35 GB, resident), the recurrent state (0.46 GB), the MLA
  latent cache for ``context_positions`` positions (0.23 GB at 4096) and a runtime
  reserve. The embedding (another 2.35 GB) is NOT in it: a token needs one 14 KB row of
  it, read on demand. Keeping it resident would put the floor at ~9.6 GB and make an
  8 GB machine unusable.
* The trunk budget pays for the ring first, then for pins. The ring runs
  with one slot for the largest layer (2.34 GB: the dense layer 0), the next layer read
  into the room beside the one in use and into its bytes only once released; that is the
  feasibility floor (``floor_problems``, the one rule k3-run, k3-doctor and ``k3-trace
  size`` apply). Two slots, for the two largest layers (3.61 GB), let the reader fill one
  while the other is computed on; ``auto`` prefers that ring when memory allows.
* Pins go largest first: a pinned byte is a byte not read per token, and pinning the
  largest layers also shrinks the ring the rest needs. ``plan_trunk`` is the split
  k3-run's trunk streamer runs, so the doctor's estimate streams the layers k3-run will.
* The cache floor is top_k + 1 slots: one layer's experts plus one in
  flight. A slot is the expert's bytes widened to the enclosing 4096-aligned window, as
  O_DIRECT reads it (17,555,456 B for the real expert).
* ``auto`` gives memory to the trunk before the cache: a trunk byte held is read by
  every token, an expert byte held only by the tokens that route to it. There is no cap
  on the trunk's share of memory: k3 reads with O_DIRECT, so pins do not compete with
  the page cache.
"""

from __future__ import annotations

from .admission import (MAX_AUTO_WIDTH, PREFILL_CHUNKS, admission_problems, auto_budget,
                        batch_width, minimum_memory, overhead_bytes, peak_bytes, prefill_chunk, resolve_budget,
                        split_problems, usable_memory)
from .plan import (Budget, TrunkPlan, cache_floor, expert_slots, floor_problems,
                   minimum_budget, overlap_floor, plan_trunk, trunk_floor)
from .presets import (FLAG_KEYS, GB, NAMED, PRESET_NAMES, PRESETS_FILE, Preset,
                      Rules, load_presets, load_rules)
from .store import BATCH_SNAPSHOTS, SERVER_SNAPSHOTS, StoreShare, store_share
from .sizes import (ModelSizes, activation_peak, sequence_bytes, verify_tape_bytes, vision_bytes,
                    with_beside, with_draft)

__all__ = ["BATCH_SNAPSHOTS", "MAX_AUTO_WIDTH", "PREFILL_CHUNKS", "SERVER_SNAPSHOTS",
           "admission_problems",
           "auto_budget", "batch_width", "minimum_memory", "overhead_bytes", "peak_bytes",
           "prefill_chunk", "resolve_budget",
           "split_problems", "usable_memory", "Budget", "TrunkPlan", "cache_floor",
           "expert_slots", "floor_problems", "minimum_budget", "overlap_floor", "plan_trunk",
           "trunk_floor", "FLAG_KEYS", "GB", "NAMED", "PRESET_NAMES", "PRESETS_FILE", "Preset",
           "Rules", "load_presets", "load_rules", "ModelSizes", "activation_peak", "sequence_bytes",
           "verify_tape_bytes", "vision_bytes", "with_beside", "with_draft", "StoreShare",
           "store_share"]
