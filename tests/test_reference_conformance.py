"""The float64 reference forward against the public engine's op vectors (whole blocks)."""

from __future__ import annotations

import numpy as np
import pytest

from libk3.config import config_from_dict
from libk3.model import reference as ref

from .conformance import layer_key, load, manifest, worst_fraction


@pytest.fixture(scope="module")
def tiny_cfg():
    return config_from_dict(manifest()["config"], source="MANIFEST.json")


def _f64(a):
    return np.asarray(a, np.float64)


def test_reference_kda_layer8_order_of_recurrence(tiny_cfg):
    """Catches a KDA layer with gate before norm, L2 on v, no q scale, wrong update order."""
    d = load("kda_layer8.json")
    short = {"self_attn.q_proj.weight": "q_proj", "self_attn.k_proj.weight": "k_proj",
             "self_attn.v_proj.weight": "v_proj", "self_attn.g_proj.weight": "g_proj",
             "self_attn.o_proj.weight": "o_proj", "self_attn.f_a_proj.weight": "f_a",
             "self_attn.f_b_proj.weight": "f_b", "self_attn.b_proj.weight": "b_proj",
             "self_attn.q_conv1d.weight": "q_conv", "self_attn.k_conv1d.weight": "k_conv",
             "self_attn.v_conv1d.weight": "v_conv", "self_attn.A_log": "A_log",
             "self_attn.dt_bias": "dt_bias", "self_attn.o_norm.weight": "o_norm"}
    y, S = ref.kda_attention(tiny_cfg, _f64(d["in"][0]), lambda s: _f64(d[short[s]]))
    assert worst_fraction(y, d["out"][0]) <= 1.0
    assert worst_fraction(S, d["state_out"][0]) <= 1.0


def test_reference_mla_scale_is_over_full_qk_width(tiny_cfg):
    """Catches scale over nope only, a rotated or normalised key slice, gate after o_proj."""
    d = load("mla.json")
    y, latent, k_rope = ref.mla_attention(
        tiny_cfg, _f64(d["in"][0]), lambda s: _f64(d[s.replace(".", "_").replace("self_attn_", "")]),
        eps_latent=d["rms_eps"])
    assert worst_fraction(y, d["out"][0]) <= 1.0
    assert worst_fraction(latent, d["kv_latent"][0]) <= 1.0
    assert worst_fraction(k_rope, d["k_rope"][0]) <= 1.0


def test_reference_attnres_mixes_raw_sources(tiny_cfg):
    """Catches mixing the normalised keys instead of the raw values, or gain on values."""
    d = load("attnres.json")
    sources = [_f64(d["block_residual"][:, s]) for s in range(d["block_residual"].shape[1])]
    out = ref.attn_res(sources + [_f64(d["prefix_sum"])], _f64(d["norm_weight"]),
                       _f64(d["proj_weight"]), d["eps"])
    assert worst_fraction(out, d["out"]) <= 1.0


@pytest.mark.parametrize("name", ["layer_kda.json", "layer_mla.json"])
def test_reference_decoder_layer_attnres_bookkeeping(tiny_cfg, name):
    """Catches adding the aggregate instead of replacing, pushing the snapshot after
    attention, not clearing the partial sum at a boundary, swapped res pairs."""
    d = load(name)
    L = int(d["layer_idx"])
    assert tiny_cfg.is_mla(L) == bool(d["is_mla"])
    W = lambda s: _f64(d[layer_key(s)])  # noqa: E731
    expert = lambda e, w: _f64(d[f"mlp_experts_{e}_{w}_weight"])  # noqa: E731
    blocks = [_f64(d["block_residual_in"][:, s]) for s in range(d["block_residual_in"].shape[1])]
    out = ref.decoder_layer(tiny_cfg, L, _f64(d["in"][0]), blocks, W, expert)
    assert worst_fraction(out, d["out"][0]) <= 1.0
    want_blocks = d["block_residual_out"]
    assert len(blocks) == want_blocks.shape[1]
    for s, b in enumerate(blocks):
        assert worst_fraction(b, want_blocks[:, s]) <= 1.0


def test_reference_router_weights_come_from_unbiased_scores(tiny_cfg):
    """Catches ignoring the bias, weights from biased scores, softmax, no renormalisation."""
    d = load("router.json")
    for t in range(d["in"].shape[0]):
        ids, w = ref.route(tiny_cfg, _f64(d["in"][t]), _f64(d["gate_weight"]), _f64(d["bias"]))
        want_ids = d["topk_idx"][t].astype(int)
        assert set(ids.tolist()) == set(want_ids.tolist())
        by_id = dict(zip(ids.tolist(), w))
        got = np.array([by_id[i] for i in want_ids])
        assert worst_fraction(got, d["topk_weight"][t]) <= 1.0
