"""The weight provider: the interface ``Forward`` (libk3.model.forward) reads weights through.

Owns: the declaration of exactly the members ``Forward`` uses, as a ``typing.Protocol``.
Does not own: any implementation (``libk3.model.weights``: resident and streamed), nor
what the engine calls on a provider besides (``close``, ``stats``: libk3.engine.session).

A matrix is in its stored dtype, as ``io.dtypes.matrix_operand`` gives it (BF16 as uint16
bits widened on the fly by the kernels, F32 as float32, F16 widened to float32); vectors
are float32; every float dtype is computed exactly. A routed expert is the tuple of its
six uint8 tensors in ``names.EXPERT_PARTS`` order.
"""

from __future__ import annotations

from typing import Mapping, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class WeightProvider(Protocol):
    """What ``Forward`` calls, in the order a pass calls it."""

    def embed(self, ids) -> np.ndarray:
        """Embedding rows of the token ids, widened: (T, hidden_size) float32."""

    def layer(self, L: int) -> Mapping[str, np.ndarray]:
        """Layer L's trunk: suffix after ``layers.{L}.`` (names.py) -> array. Valid until
        ``release(L)``."""

    def release(self, L: int) -> None:
        """The pass is done with layer L's trunk (a ring slot may be reused)."""

    @property
    def max_batch(self) -> int:
        """The most distinct experts one ``experts_start`` may ask for."""

    def experts_start(self, L: int, ids):
        """Begin fetching the distinct experts ``ids`` (at most ``max_batch``) of MoE layer
        L; returns a handle for ``experts_finish``."""

    def experts_finish(self, handle) -> dict:
        """Wait for a fetch: {expert id: six uint8 arrays}, valid until the next start."""

    def experts_ahead(self, L: int):
        """Layer L's trunk (as ``layer``) when the provider reads experts ahead and holds
        that trunk without waiting for a read, else None: ``Forward`` then predicts
        nothing for layer L."""

    def experts_prefetch(self, L: int, ids) -> None:
        """Begin reading the experts MoE layer L is predicted to route to (distinct, best
        first) in the background. Only ``experts_start`` decides what a layer uses: a
        wrong guess costs bytes, never a value."""

    def model(self) -> dict:
        """Model-level tensors: lm_head [V, E] matrix; norm, output_attn_res_norm,
        output_attn_res_proj float32. Asked for after the first pass's layers."""
