"""The defaults of a run: what k3-run, the engine and the server take when not told.

Owns: the prefill chunk, the number of expert-read threads and the prefix cache's
budget, each written once here
(k3-run's ``--help`` shows them from here). Does not own: the cache policy's default
(``libk3.policies.registry.DEFAULT_POLICY``), budgets (``libk3.budget``) or any rule.
"""

PREFILL_CHUNK = 64    # prompt tokens per forward pass while prefilling (and per lockstep pass)
IO_THREADS = 4        # expert reads in flight while a layer's experts load
PREFIX_CACHE_BYTES = 16 * 10 ** 9   # the prefix cache's disk budget (--prefix-cache-gb)
