"""Weight providers: where the forward pass gets its tensors from.

Owns: ``ResidentWeights``, which reads every tensor once from a checkpoint into RAM, and
``StreamedWeights``, which puts the model-level tensors in RAM and delegates the trunk
and the routed experts to ``libk3.stream``; both satisfy ``provider.WeightProvider``, so
the math never changes with the budget. Does not own: streaming, pinning or caching
(``libk3.stream``), the interface itself (``libk3.model.provider``).

``embed`` of the streamed provider reads just the rows asked for (14 KB each on K3
instead of a resident 2.35 GB table).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import names
from ..config import K3Config
from ..io import inventory
from ..io.dtypes import widen


def load_layer(ckpt, cfg: K3Config, L: int) -> dict:
    """Read layer L's trunk tensors: matrices in their stored dtype, vectors as f32."""
    out = {}
    prefix = names.layer_prefix(L)
    for spec in inventory.layer_trunk(cfg, L):
        suffix = spec.name[len(prefix):]
        if spec.kind == inventory.MATRIX:
            out[suffix] = ckpt.read_matrix(spec.name)
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
        "lm_head": ckpt.read_matrix(names.LM_HEAD),
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
        ent = ckpt.entry(names.EMBED)
        self._embed_dtype = ent.dtype
        self._embed = ckpt.read_raw(names.EMBED).reshape(ent.shape[0], -1)   # (V, row bytes)
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
        ids = np.asarray(ids)
        return widen(self._embed[ids], self._embed_dtype, (len(ids), self.cfg.hidden_size))

    def layer(self, L: int) -> dict:
        return self._layers[L]

    def release(self, L: int) -> None:
        pass

    @property
    def max_batch(self) -> int:
        return self.cfg.num_experts

    def experts_start(self, L: int, ids):
        return (L, ids)

    def experts_finish(self, handle) -> dict:
        L, ids = handle
        return {int(e): self._experts[(L, int(e))] for e in ids}

    def experts_ahead(self, L: int):
        return None                          # every expert is in RAM: nothing to read ahead

    def experts_prefetch(self, L: int, ids) -> None:
        pass


class StreamedWeights:
    """Model-level tensors resident; trunk layers from a TrunkStreamer (pinned + ring);
    experts from an ExpertCache. Same interface, same arrays, same math as resident.

    The model-level tensors (2.35 GB of lm_head for K3) are read by a background thread
    started here, so the read overlaps the first forward's layers; ``model()`` waits for
    it (and raises its error, if any). Why: read up front it was the largest share of
    start-up on real dimensions (bench/README.md, "Start-up")."""

    def __init__(self, ckpt, trunk, cache, files=None):
        self.cfg = ckpt.config
        self._embed = ckpt.entry(names.EMBED)
        self._ckpt = ckpt
        self.trunk = trunk
        self.cache = cache
        self._files = files             # the FileSet both read through; closed last
        self._model_reader = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="k3-model-read")
        self._model = self._model_reader.submit(load_model_level, ckpt)

    def model(self) -> dict:
        return self._model.result()

    def embed(self, ids) -> np.ndarray:
        """Read just the rows of ``ids`` from the shard (positioned reads), in the
        embedding's stored dtype, widened to f32."""
        ent = self._embed
        row = ent.nbytes // ent.shape[0]
        raw = np.empty((len(ids), row), np.uint8)
        for t, i in enumerate(ids):
            self._ckpt.read_span(ent.path, ent.offset + int(i) * row, row, raw[t])
        return widen(raw, ent.dtype, (len(ids), self.cfg.hidden_size))

    def layer(self, L: int) -> dict:
        return self.trunk.layer(L)

    def release(self, L: int) -> None:
        self.trunk.release(L)

    @property
    def max_batch(self) -> int:
        return self.cache.max_batch

    def experts_start(self, L: int, ids):
        return self.cache.start(L, ids)

    def experts_finish(self, handle) -> dict:
        return self.cache.finish(handle)

    def experts_ahead(self, L: int):
        """Layer L's trunk if it is pinned (read now if this is its first use: the pass
        reads it next anyway) and the cache reads ahead; a ring layer is not waited for."""
        if self.cache.prefetch_slots == 0 or L not in self.trunk.pinned_plan:
            return None
        return self.trunk.layer(L)

    def experts_prefetch(self, L: int, ids) -> None:
        self.cache.prefetch(L, ids)

    def model_bytes(self) -> int:
        return sum(a.nbytes for a in self.model().values())

    def close(self) -> None:
        self._model_reader.shutdown(wait=True)       # before the checkpoint's files close
        self.trunk.close()
        self.cache.close()
        if self._files is not None:
            self._files.close()

    def stats(self) -> dict:
        return {"trunk": dict(self.trunk.stats, **self.trunk.describe()),
                "experts": dict(self.cache.stats, slots=self.cache.n_slots,
                                slot_bytes=self.cache.slot_bytes,
                                policy=self.cache.policy.name),
                "drives": self._files.drive_stats()}
