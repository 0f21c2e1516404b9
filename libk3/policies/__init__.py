"""Expert-cache replacement policies as numba step functions, one module per policy.

Owns nothing itself: each policy is one module declaring itself (``POLICY``) into
``libk3.policies.registry``, holding its state layout, its step functions (``new``,
``lookup``, ``admit``) and its replay; ``drive`` runs requests through the steps (belady,
pin+lru and s3fifo have their own replay loops). ``libk3.trace.replay`` and
``libk3.policies.online`` (k3-run's live cache) reach every policy through the registry.

Every key is ``layer * n_experts + expert`` (dense, int64). ``lookup(st, key)`` records a
request and returns a non-negative value (the key's slot) on a hit, -1 on a miss; after a
miss ``admit(st, key)`` places the key and returns (slot, evicted key or -1). States are
tuples of a few arrays because a non-inlined numba call increfs and decrefs every array
it unpacks (measured: ~85 ns for a 14-array state, ~30 ns for 3 arrays).
"""
