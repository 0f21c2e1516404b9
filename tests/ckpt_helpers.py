"""Minimal valid K3 checkpoints for the reader's tests (not the synthetic generator).

Owns: a 4-layer toy config (dense KDA, KDA+MoE, MLA+MoE, KDA+MoE) and a writer that
lays it out like the release: one shard per layer with the trunk run first and the
experts after it in a shuffled order, then a model-level shard, plus an index. Tensor
bytes are random (only the A_log padding is zero, as the reader requires); tests mutate
the shard plan before writing to build one defect at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from libk3 import names
from libk3.config import config_from_dict
from libk3.io import inventory
from libk3.io.dtypes import ITEMSIZE
from libk3.io.safetensors import write_shard

TOY = {
    "hidden_size": 32, "num_hidden_layers": 4, "vocab_size": 64, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "kda_num_heads": 2, "kda_head_dim": 16,
    "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "num_attention_heads": 2,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
    "v_head_dim": 8, "mla_use_output_gate": True, "num_experts": 4,
    "num_experts_per_token": 2, "num_shared_experts": 1, "routed_expert_hidden_size": 32,
    "moe_intermediate_size": 64, "routed_scaling_factor": 1.0, "moe_renormalize": True,
    "latent_moe_use_norm": True, "first_k_dense_replace": 1, "intermediate_size": 48,
    "attn_res_block_size": 2, "situ_beta": 4.0, "situ_linear_beta": 25.0,
    "full_attn_layers": [3],
}
F32_SUFFIXES = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")


def toy_config(**overrides):
    return config_from_dict(dict(TOY, **overrides), source="<toy>")


def _dtype(name: str, kind: str) -> str:
    if kind == inventory.PACKED:
        return "U8"
    if kind == inventory.VECTOR and name.endswith(F32_SUFFIXES):
        return "F32"
    return "BF16"


def _data(rng, name: str, dtype: str, shape: tuple, cfg) -> bytes:
    n = int(np.prod(shape)) * ITEMSIZE[dtype]
    if name.endswith("A_log"):
        v = np.zeros(shape, "<f4")
        v[:cfg.num_heads] = rng.uniform(-1, 1, cfg.num_heads)
        return v.tobytes()
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def toy_plan(cfg=None, seed: int = 0) -> dict:
    """{shard file name: [(name, dtype, shape, bytes), ...]} for a valid checkpoint."""
    cfg = cfg or toy_config()
    rng = np.random.default_rng(seed)
    n_shards = cfg.num_hidden_layers + 1
    plan = {}
    for L in range(cfg.num_hidden_layers):
        tensors = []
        for spec in inventory.layer_trunk(cfg, L):
            shape = spec.shape if spec.shape is not None else (inventory.a_log_width(cfg),)
            dtype = _dtype(spec.name, spec.kind)
            tensors.append((spec.name, dtype, shape, _data(rng, spec.name, dtype, shape, cfg)))
        if not cfg.is_dense(L):
            for e in rng.permutation(cfg.num_experts):
                for spec in inventory.expert_specs(cfg, L, int(e)):
                    tensors.append((spec.name, "U8", spec.shape,
                                    _data(rng, spec.name, "U8", spec.shape, cfg)))
        plan[f"model-{L + 1:05d}-of-{n_shards:06d}.safetensors"] = tensors
    plan[f"model-{n_shards:05d}-of-{n_shards:06d}.safetensors"] = [
        (spec.name, _dtype(spec.name, spec.kind), spec.shape,
         _data(rng, spec.name, _dtype(spec.name, spec.kind), spec.shape, cfg))
        for spec in inventory.model_level(cfg)]
    return plan


def write_toy(directory, plan: dict, cfg=None, index: bool = True,
              weight_map: dict | None = None) -> Path:
    """Write config.json, the shards of ``plan`` and (unless ``index`` is False) an
    index built from the plan, or the given ``weight_map``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg = cfg or toy_config()
    (d / "config.json").write_text(json.dumps(cfg.to_flat_dict()))
    for fname, tensors in plan.items():
        write_shard(d / fname, tensors)
    if index:
        if weight_map is None:
            weight_map = {t[0]: fname for fname, tensors in plan.items() for t in tensors}
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return d


def shard_of_layer(plan: dict, L: int) -> str:
    prefix = names.layer_prefix(L)
    return next(f for f, ts in plan.items() if any(t[0].startswith(prefix) for t in ts))


def rewrite_checkpoint(src, dst, convert) -> Path:
    """Copy the checkpoint directory ``src`` to ``dst`` with some tensors re-stored:
    ``convert(name, dtype, shape, raw uint8 array)`` returns None (keep the tensor) or
    (new dtype, new bytes). Every shard keeps its tensors in their order, laid out back
    to back, so names, shards, index and trunk runs keep the released layout."""
    import shutil

    from libk3.io.safetensors import read_header

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    for shard in sorted(src.glob("*.safetensors")):
        blob = shard.read_bytes()
        head = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
        tensors = []
        for ent in read_header(shard):
            raw = np.frombuffer(blob, np.uint8, ent.nbytes, ent.offset)
            new = convert(ent.name, ent.dtype, ent.shape, raw)
            dtype, data = new if new is not None else (ent.dtype, raw.tobytes())
            tensors.append((ent.name, dtype, ent.shape, data))
        write_shard(dst / shard.name, tensors, head.get("__metadata__"))
    return dst
