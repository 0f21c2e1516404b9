"""Expert-cache replacement policies as numba step functions, one module per policy.

Owns nothing itself: each module holds one policy's state layout and its step functions
(``new``, ``lookup``, ``admit``); ``drive`` runs requests through them (belady, pin+lru
and s3fifo have their own replay loops). ``libk3.trace.replay`` replays them and wraps
the online ones for k3-run; ``libk3.policies.registry`` names them.

Every key is ``layer * n_experts + expert`` (dense, int64). ``lookup(st, key)`` records a
request and returns a non-negative value (the key's slot) on a hit, -1 on a miss; after a
miss ``admit(st, key)`` places the key and returns (slot, evicted key or -1). States are
tuples of a few arrays because a non-inlined numba call increfs and decrefs every array
it unpacks (measured: ~85 ns for a 14-array state, ~30 ns for 3 arrays).
"""
