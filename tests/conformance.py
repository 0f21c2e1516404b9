"""Loading ../shared/conformance vectors for tests (never copied into the project)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1].parent / "shared" / "conformance"

# checkpoint suffix (after layers.{L}.) -> key prefix in the layer vectors (README 4.12)
_MOE_KEYS = {
    "block_sparse_moe.gate.weight": "mlp_gate_weight",
    "block_sparse_moe.gate.e_score_correction_bias": "mlp_e_score_correction_bias",
    "block_sparse_moe.routed_expert_down_proj.weight": "mlp_down_weight",
    "block_sparse_moe.routed_expert_up_proj.weight": "mlp_up_weight",
    "block_sparse_moe.routed_expert_norm.weight": "mlp_norm_weight",
    "block_sparse_moe.shared_experts.gate_proj.weight": "mlp_shared_w1_weight",
    "block_sparse_moe.shared_experts.up_proj.weight": "mlp_shared_w3_weight",
    "block_sparse_moe.shared_experts.down_proj.weight": "mlp_shared_w2_weight",
}


def require():
    if not ROOT.is_dir():
        pytest.skip("shared conformance data not present")
    return ROOT


def load(name: str) -> dict:
    """A vector file with every tensor parsed to float32 of its shape."""
    doc = json.loads((require() / "ops" / name).read_text())
    out = {}
    for k, v in doc.items():
        if isinstance(v, dict) and "shape" in v and "data" in v:
            out[k] = np.asarray(v["data"], dtype=np.float64).astype(np.float32).reshape(v["shape"])
        else:
            out[k] = v
    return out


def manifest() -> dict:
    return json.loads((require() / "ops" / "MANIFEST.json").read_text())


def tolerance():
    t = manifest()["tolerance"]
    return t["fp32_abs"], t["fp32_rel"]


def worst_fraction(got, want) -> float:
    """Worst element's |got - want| as a fraction of atol + rtol*|want| (pass iff <= 1)."""
    atol, rtol = tolerance()
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want) / (atol + rtol * np.abs(want))))


def layer_key(suffix: str) -> str:
    """Checkpoint suffix -> key in layer_kda.json / layer_mla.json."""
    if suffix in _MOE_KEYS:
        return _MOE_KEYS[suffix]
    return suffix.replace(".", "_")
