"""libk3.kernels: the numba kernels of k3 (arrays and scalars in, preallocated outputs
written; no I/O, no model state, no imports from ``libk3.model``).

One module per concern, each citing the model.md section it implements and the numerics of
formats/model/numerics.md (model.md §7):

* ``bf16``        dense matvec / block matmul, BF16 bits (or f32) weights, f64 sums.
* ``mxfp4``       matvec / block matmul straight from packed MXFP4 experts.
* ``norms``       RMSNorm (with and without gain), L2Norm.
* ``activations`` f32 sigmoid, SiLU, SiTU, output gate, the draft's SiLU-gated product
                  (libm expf / tanhf).
* ``kda``         short conv + SiLU with history, decay, delta-rule recurrence.
* ``mla``         absorbed MLA attention over the latent cache.
* ``router``      sigmoid top-k router with selection-only bias.
* ``attnres``     the AttnRes aggregator.
* ``moe``         the routed combine (selection order).
* ``rope``        the DSpark draft's interleaved rotary embedding (dspark.md §5.4).
* ``logistic``    one float64 logistic unit (the draft's confidence head).
* ``_dot``/``_simd`` the fixed-order f64 dot product and the vector primitives under it.
* ``_mxfp4_tile`` the MXFP4 group decode and the tile steps ``mxfp4`` is built from.
* ``team``        whether a call uses the whole thread team or only the calling thread.

Numba caches each kernel per source file and does not track imports: after editing
``_dot.py``, ``_simd.py``, ``_mxfp4_tile.py`` or ``team.py``, delete ``libk3/kernels/__pycache__`` (formats/model/numerics.md 9).

Invariant shared by all: ``prange`` only over independent output rows, heads, channels
or tokens, never fastmath, so every result is bit-identical at any thread count, and a
T-token call equals T one-token calls bit for bit. Each parallel kernel brackets its
``prange`` with ``team.narrow(work)`` / ``team.widen``: a call below the threshold runs
on the calling thread, which changes who computes a row, never how.
"""
