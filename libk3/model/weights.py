"""Weight providers: where the forward pass gets its tensors from.

Owns: the provider interface the forward pass is written against, and the simplest
provider, ``ResidentWeights``, which reads every tensor once from a checkpoint into RAM.
Does not own: streaming, pinning or caching (``libk3.stream``), which implement the same
interface so the math never changes with the budget.

Interface: ``model()`` -> dict(lm_head: uint16 BF16 bits [V, E]; norm,
output_attn_res_norm, output_attn_res_proj: float32); ``embed(ids)`` -> [T, E] float32
rows (the streamed provider reads just those rows: 14 KB each instead of a resident
2.35 GB table); ``layer(L)`` -> mapping suffix ->
array (BF16 matrices stay uint16 bits, widened on the fly by the kernels; small vectors
are float32); ``release(L)`` when the forward is done with layer L; ``experts(L, ids)`` ->
{id: (w1_packed, w1_scale, w2_packed, w2_scale, w3_packed, w3_scale)} uint8 arrays.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import names
from ..config import K3Config
from ..io import inventory
from ..io.dtypes import bf16_to_f32


def load_layer(ckpt, cfg: K3Config, L: int) -> dict:
    """Read layer L's trunk tensors: matrices as BF16 bits, vectors widened to f32."""
    out = {}
    prefix = names.layer_prefix(L)
    for spec in inventory.layer_trunk(cfg, L):
        suffix = spec.name[len(prefix):]
        if spec.dtypes == inventory.MATRIX:
            out[suffix] = ckpt.read_bf16(spec.name)
        else:
            out[suffix] = np.ascontiguousarray(ckpt.read(spec.name), dtype=np.float32)
    return out


def split_expert_run(run, raw: np.ndarray) -> tuple:
    """Slice one expert's run bytes into its six shaped uint8 tensors (EXPERT_PARTS order)."""
    out = []
    for key in names.EXPERT_PARTS:
        sub, nbytes, shape = run.parts[key]
        out.append(raw[sub:sub + nbytes].reshape(shape))
    return tuple(out)


def load_model_level(ckpt) -> dict:
    return {
        "lm_head": ckpt.read_bf16(names.LM_HEAD),
        "norm": ckpt.read(names.NORM).astype(np.float32),
        "output_attn_res_norm": ckpt.read(names.OUTPUT_ATTN_RES_NORM).astype(np.float32),
        "output_attn_res_proj": ckpt.read(names.OUTPUT_ATTN_RES_PROJ).astype(np.float32).reshape(-1),
    }


class ResidentWeights:
    """Everything in RAM, read once at construction (for small models and tests)."""

    def __init__(self, ckpt):
        self.cfg = ckpt.config
        cfg = self.cfg
        self._model = load_model_level(ckpt)
        self._embed = ckpt.read_bf16(names.EMBED)
        self._layers = [load_layer(ckpt, cfg, L) for L in range(cfg.num_hidden_layers)]
        self._experts = {}
        for L in cfg.moe_layers:
            for e in range(cfg.num_experts):
                run = ckpt.expert_run(L, e)
                raw = np.empty(run.nbytes, np.uint8)
                ckpt.read_span(run.path, run.offset, run.nbytes, raw)
                self._experts[(L, e)] = split_expert_run(run, raw)

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def model(self) -> dict:
        return self._model

    def embed(self, ids) -> np.ndarray:
        return bf16_to_f32(self._embed[np.asarray(ids)])

    def layer(self, L: int) -> dict:
        return self._layers[L]

    def release(self, L: int) -> None:
        pass

    @property
    def max_batch(self) -> int:
        return self.cfg.num_experts

    def experts(self, L: int, ids) -> dict:
        return {int(e): self._experts[(L, int(e))] for e in ids}

    def experts_start(self, L: int, ids):
        return (L, ids)

    def experts_finish(self, handle) -> dict:
        return self.experts(*handle)


class StreamedWeights:
    """Model-level tensors resident; trunk layers from a TrunkStreamer (pinned + ring);
    experts from an ExpertCache. Same interface, same arrays, same math as resident.

    The model-level tensors (2.35 GB of lm_head for K3) are read by a background thread
    started here, so the read overlaps the first forward's layers; ``model()`` waits for
    it (and raises its error, if any). Why: read up front it was the largest share of
    start-up on real dimensions (bench/README.md, "Start-up")."""

    def __init__(self, ckpt, trunk, cache):
        self.cfg = ckpt.config
        self._embed = ckpt.entry(names.EMBED)
        self._ckpt = ckpt
        self.trunk = trunk
        self.cache = cache
        self._model_reader = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="k3-model-read")
        self._model = self._model_reader.submit(load_model_level, ckpt)

    def model(self) -> dict:
        return self._model.result()

    def embed(self, ids) -> np.ndarray:
        """Read just the rows of ``ids`` from the shard (positioned reads)."""
        E = self.cfg.hidden_size
        row = 2 * E
        out = np.empty((len(ids), E), np.uint16)
        for t, i in enumerate(ids):
            self._ckpt.read_span(self._embed.path, self._embed.offset + int(i) * row, row,
                                 out[t].view(np.uint8))
        return bf16_to_f32(out)

    def layer(self, L: int) -> dict:
        return self.trunk.layer(L)

    def release(self, L: int) -> None:
        self.trunk.release(L)

    @property
    def max_batch(self) -> int:
        return self.cache.max_batch

    def experts(self, L: int, ids) -> dict:
        return self.cache.fetch(L, ids)

    def experts_start(self, L: int, ids):
        return self.cache.start(L, ids)

    def experts_finish(self, handle) -> dict:
        return self.cache.finish(handle)

    def model_bytes(self) -> int:
        return sum(a.nbytes for a in self.model().values())

    def close(self) -> None:
        self._model_reader.shutdown(wait=True)       # before the checkpoint's files close
        self.trunk.close()
        self.cache.close()

    def stats(self) -> dict:
        return {"trunk": dict(self.trunk.stats, **self.trunk.describe()),
                "experts": dict(self.cache.stats, slots=self.cache.n_slots,
                                slot_bytes=self.cache.slot_bytes,
                                policy=self.cache.policy.name)}
