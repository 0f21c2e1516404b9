"""Synthetic K3 checkpoints in the released layout (formats/synthetic-checkpoint.md).

Owns: generating a complete model directory from a preset and a seed: nested config.json
with quantization_config and vision_config, model.safetensors.index.json, shards laid out
as the release (one layer per shard, a layer's trunk tensors as one contiguous run, each
routed expert as one contiguous MXFP4 run, experts NOT in id order, the image tower and
projector after the model-level tensors), preprocessor_config.json, tiktoken.model,
tokenizer_config.json and tokenization_kimi.py; with ``draft``, the target's synthetic draft in ``draft/``
(``libk3.synth.draft``). Does not own: the safetensors byte format
(``libk3.io.safetensors``), the per-tensor value streams (``libk3.synth.values``), the
image tensors' recipes (``libk3.synth.vision``) or BPE training (``libk3.synth.bpe``).

Why the weight scales below: a synthetic model must exercise real behaviour. Gate and up
projections are large enough that SiTU's tanh caps engage (some up rows are 10x so the
25-cap bites too); the router bias is large enough to change some selections; A_log is a
per-head ramp so a per-channel misindex shows; the AttnRes projections give scores of
order 1 so the softmax is neither flat nor one-hot; everything stays finite.

Deterministic: each tensor draws from its own generator seeded by (seed, crc32(name)), in
fixed-size row chunks, so the same seed gives the same bytes whatever the order of writing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .. import names
from ..config import K3Config, config_from_dict
from ..errors import UsageError
from ..io import inventory
from ..io.atomic import building_dir, write_json
from ..io.dtypes import ITEMSIZE
from ..io.safetensors import write_shard
from .draft import DRAFT_DIR, write_draft
from .presets import PRESETS
from .values import encode, normal_rows, tensor_rng
from ..vision_config import PREPROCESSOR_FILE
from .vision import preprocessor_doc, preset_vision, root_keys, vision_tensors

F32_SUFFIXES = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "A_log",
                "dt_bias", "o_norm.weight", "e_score_correction_bias")
E2M1_RMS = float(np.sqrt(np.mean(np.array([0, .5, 1, 1.5, 2, 3, 4, 6]) ** 2)))


def shard_name(i: int, n: int) -> str:
    """Released shard naming: 5-digit index, 6-digit total (model.md §3.1)."""
    return f"model-{i:05d}-of-{n:06d}.safetensors"


def _dtype_for(name: str, kind: str) -> str:
    if kind == inventory.PACKED:
        return "U8"
    if kind == inventory.MATRIX:
        return "BF16"
    return "F32" if name.endswith(F32_SUFFIXES) else "BF16"


def _std_and_rows(cfg: K3Config, name: str, shape: tuple):
    """(kind, scale) of the value recipe for one tensor; see the module docstring."""
    suffix = name.rsplit("layers.", 1)[-1].split(".", 1)[-1] if "layers." in name else name
    fan_in = shape[-1] if len(shape) >= 2 else 1
    inv = 1.0 / np.sqrt(fan_in)
    if name == names.EMBED:
        return "normal", 1.0
    if name == names.LM_HEAD:
        return "normal", 2.0 * inv
    if suffix.endswith(("layernorm.weight", "res_norm.weight", "o_norm.weight",
                        "routed_expert_norm.weight")) or name in (names.NORM, names.OUTPUT_ATTN_RES_NORM):
        return "gain", 0.1
    if suffix.endswith("res_proj.weight") or name == names.OUTPUT_ATTN_RES_PROJ:
        return "normal", 2.0 * inv
    if suffix.endswith("conv1d.weight"):
        return "conv", 0.5
    if suffix.endswith("A_log"):
        return "a_log", 0.0
    if suffix.endswith("dt_bias"):
        return "normal", 0.5
    if suffix.endswith("e_score_correction_bias"):
        return "bias", 0.1
    if suffix.endswith(("f_b_proj.weight", "b_proj.weight", "kv_b_proj.weight",
                        "gate.weight")):
        return "normal", 2.0 * inv
    if suffix.endswith(("mlp.gate_proj.weight", "shared_experts.gate_proj.weight")):
        return "normal", 3.0 * inv
    if suffix.endswith(("mlp.up_proj.weight", "shared_experts.up_proj.weight")):
        return "up", 3.0 * inv
    return "normal", inv


def _values(cfg: K3Config, name: str, shape: tuple, seed: int):
    """Yield float32 chunks (row-major) of the tensor's synthetic values."""
    kind, scale = _std_and_rows(cfg, name, shape)
    rng = tensor_rng(seed, name)
    n = int(np.prod(shape)) if shape else 1
    if kind == "a_log":
        v = np.zeros(n, np.float32)
        v[:cfg.num_heads] = np.linspace(-0.5, 1.2, cfg.num_heads, dtype=np.float32)
        yield v
        return
    if kind == "bias":
        v = np.linspace(-scale, scale, n, dtype=np.float32)
        yield v[rng.permutation(n)]
        return
    if kind == "conv":
        v = rng.standard_normal(n, dtype=np.float32) * np.float32(scale)
        v.reshape(-1, shape[-1])[:, -1] += np.float32(1.0)   # tap 3 multiplies the current input
        yield v
        return
    row = shape[-1] if len(shape) >= 2 else n
    for r0, v in normal_rows(rng, shape, scale):
        if kind == "gain":
            v += np.float32(1.0)
        elif kind == "up":
            v2 = v.reshape(-1, row)
            big = (np.arange(r0, r0 + len(v2)) % 7) == 0    # every 7th row 10x: the 25-cap engages
            v2[big] *= np.float32(10.0)
        yield v


def _encoded_chunks(cfg, name, shape, dtype, seed):
    """Yield uint8 chunks of the tensor's bytes in ``dtype``."""
    return encode(_values(cfg, name, shape, seed), dtype)


def _expert_bytes(cfg: K3Config, L: int, e: int, seed: int) -> np.ndarray:
    """One routed expert's six tensors as one run, drawn directly in MXFP4: uniform nibble
    codes and per-group exponents around the value that gives rms ~ target (w1/w3: 3/sqrt(in)
    so SiTU saturates sometimes; w2: 1/sqrt(in))."""
    shapes = inventory.expert_shapes(cfg)
    rng = tensor_rng(seed, names.expert(L, e, "w1", "weight_packed"))
    parts = []
    for w, part in names.EXPERT_PARTS:
        shape = shapes[(w, part)]
        n = shape[0] * shape[1]
        if part == "weight_packed":
            parts.append(rng.integers(0, 256, n, dtype=np.uint8))
        else:
            fan_in = shape[1] * 32
            target = (3.0 if w in ("w1", "w3") else 1.0) / np.sqrt(fan_in)
            e0 = int(np.round(np.log2(target / E2M1_RMS)))
            parts.append((127 + e0 + rng.integers(-1, 1, n, endpoint=True)).astype(np.uint8))
    return np.concatenate(parts)


def _shard_plan(cfg: K3Config, real_layout: bool):
    """[(shard file name, [layer or 'model' or an image part])]. The real layout gives the
    projector and the tower a shard each, as released; the others append both to the
    model-level shard, so the language model's shards keep their names."""
    n = cfg.num_hidden_layers
    groups = [[L] for L in range(n)]
    groups += [["model"], ["projector"], ["vision"]] if real_layout else [["model", "all"]]
    return [(shard_name(i + 1, len(groups)), g) for i, g in enumerate(groups)]


def _layer_tensors(cfg, L, seed, sparse):
    """(name, dtype, shape, data) for layer L: trunk run first, then experts out of id order."""
    out = []
    for spec in inventory.layer_trunk(cfg, L):
        shape = spec.shape if spec.shape is not None else (inventory.a_log_width(cfg),)
        dtype = _dtype_for(spec.name, spec.kind)
        data = None if sparse else (lambda s=spec, sh=shape, d=dtype:
                                    _encoded_chunks(cfg, s.name, sh, d, seed))
        out.append((spec.name, dtype, shape, data))
    if not cfg.is_dense(L):
        order = np.random.default_rng([seed, L, 77]).permutation(cfg.num_experts)
        for e in order:
            e = int(e)
            specs = inventory.expert_specs(cfg, L, e)
            run = None if sparse else _lazy_run(cfg, L, e, seed)
            for k, spec in enumerate(specs):
                out.append((spec.name, "U8", spec.shape, None if sparse else run.part(k)))
    return out


class _lazy_run:
    """Generates an expert run once and hands out its six tensor slices in order."""

    def __init__(self, cfg, L, e, seed):
        self.cfg, self.L, self.e, self.seed = cfg, L, e, seed
        self.buf = None
        sizes = [int(np.prod(s)) for s in inventory.expert_shapes(cfg).values()]
        keys = list(inventory.expert_shapes(cfg).keys())
        order = [keys.index(k) for k in names.EXPERT_PARTS]
        self.sizes = [sizes[i] for i in order]

    def part(self, k):
        def gen():
            if self.buf is None:
                self.buf = _expert_bytes(self.cfg, self.L, self.e, self.seed)
            start = sum(self.sizes[:k])
            chunk = self.buf[start:start + self.sizes[k]]
            if k == 5:
                self.buf = None
            yield chunk
        return gen


def nested_config(flat: dict, n_ranks: int) -> dict:
    """The released nested config.json shape (model.md §2.1) for a flat preset."""
    kda_keys = {"kda_num_heads": "num_heads", "kda_head_dim": "head_dim",
                "short_conv_kernel_size": "short_conv_kernel_size",
                "gate_lower_bound": "gate_lower_bound", "full_attn_layers": "full_attn_layers"}
    lin = {new: flat[old] for old, new in kda_keys.items()}
    n = flat["num_hidden_layers"]
    lin["kda_layers"] = [i for i in range(1, n + 1) if i not in set(flat["full_attn_layers"])]
    lin["use_full_rank_gate"] = True
    text = {k: v for k, v in flat.items() if k not in kda_keys}
    text["activation_situ_beta"] = text.pop("situ_beta")
    text["activation_situ_linear_beta"] = text.pop("situ_linear_beta")
    text.update(architectures=["KimiLinearForCausalLM"], model_type="kimi_linear",
                hidden_act="situ", mla_use_nope=True, moe_router_activation_func="sigmoid",
                num_nextn_predict_layers=0, bos_token_id=n_ranks, eos_token_id=n_ranks + 2,
                pad_token_id=flat["vocab_size"] - 1, linear_attn_config=lin,
                quantization_config={
                    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                    "config_groups": {"group_0": {"weights": {
                        "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                        "symmetric": True, "scale_dtype": "torch.uint8"}}},
                    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*",
                               "lm_head", "vision_tower", "mm_projector"]})
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "dtype": "bfloat16", "bos_token_id": n_ranks, "eos_token_id": n_ranks + 2,
            "pad_token_id": flat["vocab_size"] - 1, "tie_word_embeddings": False,
            "text_config": text}


def synth_checkpoint(out_dir, preset: str = "tiny", seed: int = 0, progress: bool = True,
                     draft: bool = False):
    """Write a synthetic checkpoint of ``preset`` into ``out_dir`` (must not exist yet);
    with ``draft``, also its synthetic DSpark draft into ``out_dir/draft``.

    Built in a hidden sibling directory and renamed into place at the end, so ``out_dir``
    only ever appears complete, draft included. Returns the Path of ``out_dir``."""
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}", hint=f"choose one of {', '.join(PRESETS)}")
    flat, n_special, sparse, real_layout = PRESETS[preset]
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise UsageError("destination exists and is not empty; refusing to overwrite",
                         path=out)
    cfg = config_from_dict(dict(flat), source=f"<preset {preset}>")
    with building_dir(out) as tmp:          # nothing half-built stays behind
        _write_checkpoint(tmp, cfg, flat, n_special, sparse, real_layout, preset, seed,
                          progress)
        if draft:
            (tmp / DRAFT_DIR).mkdir()
            write_draft(tmp, tmp / DRAFT_DIR, seed=seed, preset=preset)
    return out


def _write_checkpoint(tmp: Path, cfg, flat, n_special, sparse, real_layout, preset, seed,
                      progress) -> None:
    """Every file of the checkpoint into the new, empty directory ``tmp``."""
    from .. import progress as _progress
    from .bpe import write_tokenizer_files

    n_ranks = cfg.vocab_size - n_special
    vcfg = preset_vision(preset, cfg, n_ranks)
    plan = _shard_plan(cfg, real_layout)
    weight_map, total = {}, 0
    bar = _progress.bar(total=len(plan), desc=f"synth {preset}", unit="shard", show=progress)
    for fname, groups in plan:
        bar.update(1)
        tensors = []
        for g in groups:
            if g == "model":
                for spec in inventory.model_level(cfg):
                    dtype = _dtype_for(spec.name, spec.kind)
                    data = None if sparse else (lambda s=spec, d=dtype:
                                                _encoded_chunks(cfg, s.name, s.shape, d, seed))
                    tensors.append((spec.name, dtype, spec.shape, data))
            elif g in ("projector", "vision", "all"):
                tensors += vision_tensors(vcfg, seed, sparse, g)
            else:
                tensors += _layer_tensors(cfg, g, seed, sparse)
        write_shard(tmp / fname, tensors)
        for name, dtype, shape, _ in tensors:
            weight_map[name] = fname
            total += math.prod(shape) * ITEMSIZE[dtype]
    write_json(tmp / "model.safetensors.index.json",
               {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json(tmp / "config.json", dict(nested_config(dict(flat), n_ranks),
                                         **root_keys(preset, n_ranks)))
    write_json(tmp / PREPROCESSOR_FILE, preprocessor_doc())
    write_tokenizer_files(tmp, n_ranks=n_ranks, vocab_size=cfg.vocab_size)


def summary(model_dir) -> dict:
    """Shard count, tensor count, apparent and on-disk bytes of a checkpoint directory."""
    d = Path(model_dir)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(d.glob("*.safetensors"))
    apparent = sum(p.stat().st_size for p in shards)
    disk = sum(p.stat().st_blocks * 512 for p in shards)
    return {"path": str(d), "shards": len(shards), "tensors": len(index["weight_map"]),
            "apparent_bytes": apparent, "disk_bytes": disk}
