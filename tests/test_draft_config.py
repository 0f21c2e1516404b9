"""A draft's config.json is read strictly (dspark.md §2): what k3 does not implement is
refused with the reason, every problem named in one error, the derived numbers right."""

from __future__ import annotations

import copy
import math

import pytest

from libk3.draft.config import draft_config_from_dict
from libk3.errors import ConfigError
from libk3.k3_dims import DSPARK


def published():
    return copy.deepcopy(DSPARK)


def refused(doc) -> str:
    with pytest.raises(ConfigError) as e:
        draft_config_from_dict(doc, source="draft/config.json")
    line = e.value.one_line()
    assert "draft/config.json" in line and "\n" not in line
    return line


def test_published_config_loads_with_its_derived_numbers():
    """Catches a softmax scale without YaRN's squared mscale, half-split or misindexed
    frequencies, and a wrong trained context (dspark.md §5.4, §7)."""
    cfg = draft_config_from_dict(published())
    assert abs(cfg.softmax_scale() - 192 ** -0.5 * (0.1 * math.log(32) + 1) ** 2) < 1e-12
    assert abs(cfg.softmax_scale() - 0.1308608) < 1e-7
    w = cfg.rope_inv_freq()
    assert len(w) == 32 and w[0] == 1.0
    assert abs(w[15] / 6.2713e-3 - 1) < 1e-4 and abs(w[31] / 8.7644e-7 - 1) < 1e-4
    assert cfg.rope_amplitude() == 1.0 and cfg.trained_context == 3 * 32768
    assert cfg.block_size == 7 and cfg.aux_hidden_stream == "prefix" and not cfg.fc_norm


@pytest.mark.parametrize("key, value, words", [
    ("mla_use_nope", True, "NoPE"),
    ("mla_use_output_gate", True, "gated"),
    ("hidden_act", "gelu", "SiLU"),
    ("markov_head_type", "gated", "vanilla"),
    ("rope_interleave", False, "rope_interleave"),
    ("aux_hidden_stream", "mean", "aux_hidden_stream"),
])
def test_what_k3_does_not_implement_is_refused_with_the_reason(key, value, words):
    """Catches a variant that would load and run approximately (and accept nothing)."""
    doc = published()
    draft_config_from_dict(doc)                                     # control
    doc[key] = value
    line = refused(doc)
    assert "not implemented" in line and words in line


@pytest.mark.parametrize("change, words", [
    (lambda d: d.pop("mask_token_id"), "missing required key(s): mask_token_id"),
    (lambda d: d.update(hidden_size="7168"), "hidden_size='7168' is not a valid int"),
    (lambda d: d.update(target_layer_ids=[2, 23, 23, 71, 89]), "strictly ascending"),
    (lambda d: d.update(num_target_layers=4), "num_target_layers 4"),
    (lambda d: d["rope_parameters"].update(rope_type="linear"), "rope_type 'linear'"),
    (lambda d: d["rope_parameters"].update(beta_slow=64), "beta_slow < beta_fast"),
    (lambda d: d.update(qk_rope_head_dim=63), "even"),
    (lambda d: d.update(markov_rank=0), "markov_rank must be 1"),
    (lambda d: d.update(intermediate_size=1 << 40), "intermediate_size must be 1"),
])
def test_each_inconsistency_is_one_error_naming_the_key(change, words):
    """Catches a guessed default, a silently accepted duplicate tap, an odd rotation
    width or a size that would be allocated before it is checked."""
    doc = published()
    change(doc)
    assert words in refused(doc)


def test_every_problem_is_reported_at_once():
    """Catches an error that stops at the first problem (the user fixes one a run)."""
    doc = published()
    del doc["markov_rank"], doc["vocab_size"]
    doc["mla_use_nope"] = True
    line = refused(doc)
    assert "markov_rank" in line and "vocab_size" in line and "NoPE" in line


def test_block_size_of_the_verify_width_convention_means_seven():
    """Catches a checkpoint's block_size 8 (anchor + 7, another convention) read as 8
    proposals per pass."""
    doc = published()
    doc["block_size"] = 8
    assert draft_config_from_dict(doc).block_size == 7
