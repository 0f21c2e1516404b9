"""Config reader: both shapes, strictness, structural checks (model.md §2)."""

from __future__ import annotations

import copy
import json

import pytest

from libk3.config import config_from_dict, load_config
from libk3.errors import ConfigError
from libk3.synth.checkpoint import nested_config
from libk3.k3_dims import REAL
from libk3.synth.presets import TINY

from .conformance import ROOT


def _nested(flat=REAL):
    return nested_config(dict(flat), n_ranks=flat["vocab_size"] - 256)


def test_config_nested_and_flat_give_the_same_config():
    """Catches a nested reader that drops keys the flat reader sees (or the reverse)."""
    a = config_from_dict(_nested(), "nested.json")
    b = config_from_dict(dict(REAL), "flat.json")
    assert a.fingerprint() == b.fingerprint()
    assert a.layer_map.count("M") == 24 and a.is_mla(91) and a.is_mla(92) and a.is_mla(3)
    assert not a.is_mla(0) and a.is_dense(0) and not a.is_dense(1)
    assert [L for L in range(93) if a.is_boundary(L)] == [0, 12, 24, 36, 48, 60, 72, 84]
    assert a.expert_bytes == 17_547_264


def test_config_kda_head_dim_not_shadowed_by_resaved_text_head_dim():
    """Catches the C engine's lookup order: text_config.head_dim=74 shadowing KDA's 128."""
    doc = _nested()
    doc["text_config"]["head_dim"] = 74
    cfg = config_from_dict(doc, "resaved.json")
    assert cfg.head_dim == 128 and cfg.num_heads == 96


def test_config_reports_every_missing_key_at_once():
    """Catches a reader that stops at the first gap, or silently defaults one."""
    doc = _nested()
    del doc["text_config"]["linear_attn_config"]["full_attn_layers"]
    del doc["text_config"]["vocab_size"]
    del doc["text_config"]["activation_situ_beta"]
    with pytest.raises(ConfigError) as e:
        config_from_dict(doc, "cfg.json")
    msg = str(e.value)
    assert "cfg.json" in msg and "\n" not in msg
    for key in ("full_attn_layers", "vocab_size", "activation_situ_beta"):
        assert key in msg


def test_config_optional_booleans_default_but_ints_do_not():
    """Catches defaulting a required int; control: optional booleans may be absent."""
    flat = dict(TINY)
    for k in ("mla_use_output_gate", "moe_renormalize", "latent_moe_use_norm",
              "tie_word_embeddings"):
        flat.pop(k)
    cfg = config_from_dict(flat)
    assert cfg.mla_use_output_gate and cfg.moe_renormalize and not cfg.tie_word_embeddings
    flat.pop("first_k_dense_replace")
    with pytest.raises(ConfigError, match="first_k_dense_replace"):
        config_from_dict(flat)


@pytest.mark.parametrize("key,value,match", [
    ("full_attn_layers", [0, 4], "ONE-based"),
    ("full_attn_layers", [4, 4], "duplicate"),
    ("num_experts_per_token", 9, "num_experts_per_token"),
    ("attn_res_block_size", 0, "attn_res_block_size"),
    ("hidden_size", "128", "hidden_size"),
    ("hidden_size", True, "hidden_size"),
    ("rms_norm_eps", -1.0, "rms_norm_eps"),
])
def test_config_structural_checks_refuse(key, value, match):
    """Catches each structural rule of model.md §2.2 being skipped."""
    flat = dict(TINY)
    flat[key] = value
    with pytest.raises(ConfigError, match=match):
        config_from_dict(flat, "x.json")


def test_config_kda_layers_must_be_the_complement():
    """Catches accepting a kda_layers list that disagrees with full_attn_layers."""
    doc = _nested(TINY)
    config_from_dict(copy.deepcopy(doc))                    # control
    doc["text_config"]["linear_attn_config"]["kda_layers"] = [1, 2]
    with pytest.raises(ConfigError, match="complement"):
        config_from_dict(doc)


@pytest.mark.parametrize("value", [[None, None], [1, "2"], [1.0, 2.0], [True, 2]])
def test_config_kda_layers_of_other_types_refused_not_crashed(value):
    """Catches kda_layers entries that are not integers reaching sorted() (a TypeError
    traceback for [null, null], found by the hostile-config property test) or being
    taken as layer numbers (1.0, true)."""
    doc = _nested(TINY)
    doc["text_config"]["linear_attn_config"]["kda_layers"] = value
    with pytest.raises(ConfigError, match="complement"):
        config_from_dict(doc)


def test_config_quantization_config_asserted_when_present():
    """Catches reading an MXFP4 checkpoint whose quantization says another scheme."""
    doc = _nested(TINY)
    doc["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    with pytest.raises(ConfigError, match="group_size"):
        config_from_dict(doc)
    doc = _nested(TINY)
    q = doc["text_config"].pop("quantization_config")
    q["format"] = "nvfp4-pack-quantized"
    doc["quantization_config"] = q                          # accepted at the root too
    with pytest.raises(ConfigError, match="format"):
        config_from_dict(doc)


def test_config_file_errors_name_the_file(tmp_path):
    """Catches a traceback or a nameless message on unreadable config files."""
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY)))
    assert load_config(tmp_path).num_hidden_layers == 13


@pytest.mark.parametrize("name,key", [("no_layermap.json", "full_attn_layers"),
                                      ("bad_layer_index.json", "full_attn_layers"),
                                      ("bad_topk.json", "num_experts_per_token")])
def test_config_conformance_bad_configs_rejected(name, key):
    """The public engine's malformed configs must each fail naming file and key."""
    if not ROOT.is_dir():
        pytest.skip("shared conformance data not present")
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "cfg" / name)
    assert name in str(e.value) and key in str(e.value)


def test_config_conformance_manifest_config_accepted():
    """Control for the rejections: the manifest's flat config (wrapped in "config") loads."""
    if not ROOT.is_dir():
        pytest.skip("shared conformance data not present")
    cfg = load_config(ROOT / "ops" / "MANIFEST.json")
    assert cfg.layer_map == "KKKMKKKMKKKMM"
