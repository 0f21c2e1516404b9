"""Synthetic checkpoints: released layout, determinism, every preset readable."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import numpy as np
import pytest

from libk3 import names
from libk3.io.checkpoint import Checkpoint
from libk3.synth.checkpoint import summary, synth_checkpoint

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"


def test_synth_tiny_is_byte_identical_across_runs_and_matches_fixture(tmp_path):
    """Catches unseeded randomness, dict-order or time-dependent bytes, a stale fixture."""
    a = synth_checkpoint(tmp_path / "a", "tiny", seed=0, progress=False)
    b = synth_checkpoint(tmp_path / "b", "tiny", seed=0, progress=False)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    assert mismatch == [] and errors == []
    match, mismatch, errors = filecmp.cmpfiles(a, FIXTURE, files, shallow=False)
    assert mismatch == [] and errors == [], "fixtures/tiny is stale: regenerate with k3-pack synth"
    c = synth_checkpoint(tmp_path / "c", "tiny", seed=1, progress=False)
    assert not filecmp.cmp(a / files[1], c / files[1], shallow=False)   # control: seed matters


def test_synth_layout_experts_out_of_id_order_and_contiguous():
    """Catches a generator that writes experts in id order (the release does not)."""
    with Checkpoint.open(FIXTURE) as ckpt:
        cfg = ckpt.config
        for L in cfg.moe_layers:
            runs = [ckpt.expert_run(L, e) for e in range(cfg.num_experts)]
            offsets = [r.offset for r in runs]
            assert offsets != sorted(offsets)
            trunk = ckpt.layer_trunk_run(L)
            assert all(r.path == trunk.path for r in runs)        # one layer per shard
            assert all(r.nbytes == cfg.expert_bytes for r in runs)
        config = json.loads((FIXTURE / "config.json").read_text())
        assert "text_config" in config and "linear_attn_config" in config["text_config"]
        assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"


def test_synth_small_vectors_use_released_dtypes():
    """Catches all-BF16 or all-F32 small vectors (the release mixes them, model.md §3.4)."""
    with Checkpoint.open(FIXTURE) as ckpt:
        assert ckpt.entry(names.layer(1, "self_attn.A_log")).dtype == "F32"
        assert ckpt.entry(names.layer(1, "self_attn.q_conv1d.weight")).dtype == "F32"
        assert ckpt.entry(names.layer(1, "input_layernorm.weight")).dtype == "BF16"
        assert ckpt.entry(names.layer(1, "block_sparse_moe.gate.e_score_correction_bias")).dtype == "F32"
        a_log = ckpt.read(names.layer(1, "self_attn.A_log"))
        H = ckpt.config.num_heads
        assert a_log.shape[0] > H and np.all(a_log[H:] == 0) and len(set(a_log[:H])) == H


def test_synth_small_loads_back_with_every_tensor_checked(tmp_path_factory):
    """Catches a preset whose tensors disagree with its own config."""
    d = synth_checkpoint(tmp_path_factory.mktemp("s") / "small", "small", progress=False)
    info = summary(d)
    assert 1e8 < info["apparent_bytes"] < 1e9
    with Checkpoint.open(d) as ckpt:
        assert ckpt.config.num_experts >= 64


def test_synth_real_sparse_has_the_real_inventory_without_disk(tmp_path_factory):
    """Catches a generator or reader that cannot cope with 82,432 experts and 497,220
    tensors in 96 shards, or that writes the data instead of leaving holes."""
    d = synth_checkpoint(tmp_path_factory.mktemp("rs") / "real-sparse", "real-sparse",
                         progress=False)
    info = summary(d)
    assert info["shards"] == 96 and info["tensors"] == 497_220
    assert 1.55e12 < info["apparent_bytes"] < 1.57e12
    assert info["disk_bytes"] < 2e8
    assert (d / "model-00001-of-000096.safetensors").is_file()
    with Checkpoint.open(d) as ckpt:
        cfg = ckpt.config
        assert cfg.num_hidden_layers == 93 and cfg.num_experts == 896
        assert ckpt.expert_run(92, 895).nbytes == 17_547_264
        assert ckpt.layer_trunk_run(0).nbytes == 2_341_213_184
        assert ckpt.layer_trunk_run(1).nbytes == 1_267_744_256
        assert ckpt.layer_trunk_run(3).nbytes == 844_335_616


def test_synth_refuses_to_overwrite(tmp_path):
    """Catches a generator that silently clobbers an existing directory."""
    out = tmp_path / "x"
    out.mkdir()
    (out / "keep").write_text("mine")
    with pytest.raises(Exception, match="not empty"):
        synth_checkpoint(out, "tiny", progress=False)
    assert (out / "keep").read_text() == "mine"
