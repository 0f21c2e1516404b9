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


# Small vectors the release stores as F32 (model.md §3.4); every other float tensor is BF16.
_F32_SUFFIXES = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight",
                 "e_score_correction_bias")


def _expected_tensors(doc: dict) -> dict:
    """name -> (shape, dtype) of every language-model tensor a released-shape config.json
    implies, written out from model.md §3.4 and §4.1. Independent of libk3.io.inventory,
    which the synthetic writer and the checkpoint reader share."""
    t = doc["text_config"]
    lin = t["linear_attn_config"]
    E, V = t["hidden_size"], t["vocab_size"]
    H, D, K = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    P = H * D
    Hm, nope, rope, vd = (t["num_attention_heads"], t["qk_nope_head_dim"],
                          t["qk_rope_head_dim"], t["v_head_dim"])
    rq, rkv = t["q_lora_rank"], t["kv_lora_rank"]
    N, lat, inter = t["num_experts"], t["routed_expert_hidden_size"], t["moe_intermediate_size"]
    S = t["num_shared_experts"] * inter
    mla = {L - 1 for L in lin["full_attn_layers"]}          # 1-based in the file
    p = "language_model.model."
    shapes = {p + "embed_tokens.weight": (V, E), "language_model.lm_head.weight": (V, E),
              p + "norm.weight": (E,), p + "output_attn_res_norm.weight": (E,),
              p + "output_attn_res_proj.weight": (1, E)}
    for L in range(t["num_hidden_layers"]):
        layer = {"input_layernorm.weight": (E,), "post_attention_layernorm.weight": (E,),
                 "self_attention_res_norm.weight": (E,), "mlp_res_norm.weight": (E,),
                 "self_attention_res_proj.weight": (1, E), "mlp_res_proj.weight": (1, E)}
        if L in mla:
            attn = {"q_a_proj.weight": (rq, E), "q_a_layernorm.weight": (rq,),
                    "q_b_proj.weight": (Hm * (nope + rope), rq),
                    "kv_a_proj_with_mqa.weight": (rkv + rope, E),
                    "kv_a_layernorm.weight": (rkv,),
                    "kv_b_proj.weight": (Hm * (nope + vd), rkv),
                    "g_proj.weight": (Hm * vd, E), "o_proj.weight": (E, Hm * vd)}
        else:
            attn = {f"{x}_proj.weight": (P, E) for x in "qkv"}
            attn.update({f"{x}_conv1d.weight": (P, 1, K) for x in "qkv"})
            attn.update({"f_a_proj.weight": (D, E), "f_b_proj.weight": (P, D),
                         "A_log": (max(H, D),),         # per head, zero-padded as released
                         "dt_bias": (P,), "b_proj.weight": (H, E), "g_proj.weight": (P, E),
                         "o_norm.weight": (D,), "o_proj.weight": (E, P)})
        layer.update({"self_attn." + k: v for k, v in attn.items()})
        if L < t["first_k_dense_replace"]:
            Id = t["intermediate_size"]
            layer.update({"mlp.gate_proj.weight": (Id, E), "mlp.up_proj.weight": (Id, E),
                          "mlp.down_proj.weight": (E, Id)})
        else:
            m = "block_sparse_moe."
            layer.update({m + "gate.weight": (N, E), m + "gate.e_score_correction_bias": (N,),
                          m + "routed_expert_down_proj.weight": (lat, E),
                          m + "routed_expert_norm.weight": (lat,),
                          m + "routed_expert_up_proj.weight": (E, lat),
                          m + "shared_experts.gate_proj.weight": (S, E),
                          m + "shared_experts.up_proj.weight": (S, E),
                          m + "shared_experts.down_proj.weight": (E, S)})
            for e in range(N):
                for w, (rows, cols) in (("w1", (inter, lat)), ("w3", (inter, lat)),
                                        ("w2", (lat, inter))):
                    layer[f"{m}experts.{e}.{w}.weight_packed"] = (rows, cols // 2)
                    layer[f"{m}experts.{e}.{w}.weight_scale"] = (rows, cols // 32)
        shapes.update({f"{p}layers.{L}.{k}": v for k, v in layer.items()})
    return {name: (shape, "U8" if ".experts." in name else
                   "F32" if name.endswith(_F32_SUFFIXES) else "BF16")
            for name, shape in shapes.items()}


def test_synth_small_loads_back_with_every_tensor_checked(small_dir):
    """Catches a preset whose tensors disagree with its own config: a missing, extra or
    misnamed tensor, a wrong shape or dtype, against the inventory model.md §3.4 and §4.1
    give for the config.json the preset wrote (not the inventory module both sides use)."""
    d = small_dir                        # synth_checkpoint's "small", made once per run
    assert 1e8 < summary(d)["apparent_bytes"] < 1e9                 # "hundreds of MB"
    want = _expected_tensors(json.loads((d / "config.json").read_text()))
    with Checkpoint.open(d) as ckpt:
        assert ckpt.config.num_experts >= 64
        assert set(ckpt.names()) == set(want), sorted(set(ckpt.names()) ^ set(want))[:5]
        got = {n: (tuple(ckpt.entry(n).shape), ckpt.entry(n).dtype) for n in want}
    wrong = {n: (got[n], want[n]) for n in want if got[n] != want[n]}
    assert not wrong, list(wrong.items())[:5]


def test_synth_expected_tensors_control():
    """Control: the hand-written inventory is the one model.md §3.5 counts for the real
    model (497,220 tensors less the 168 image tensors), so it cannot pass by being empty
    or loose."""
    from libk3.synth.checkpoint import nested_config
    from libk3.k3_dims import REAL
    want = _expected_tensors(nested_config(REAL, n_ranks=163_584))
    assert len(want) == 497_220 - 168
    expert = [s for n, (s, _) in want.items() if ".layers.1.block_sparse_moe.experts.0." in n]
    assert sum(a * b for a, b in expert) == 17_547_264            # model.md §4.1


def test_synth_real_sparse_has_the_real_inventory_without_disk(real_sparse_dir):
    """Catches a generator or reader that cannot cope with 82,432 experts and 497,220
    tensors in 96 shards, or that writes the data instead of leaving holes (the fixture
    runs synth_checkpoint; test_doctor diagnoses the same directory)."""
    d = real_sparse_dir
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


# sha256 over the language-model tensors (name, dtype, shape, bytes, by name) and the
# three tokenizer files, as the presets wrote them before they had an image tower.
LM_DIGEST = {"tiny": "7d280a1e8eb8b94a015d30840f2459ba63430f930ed2b9cf2f3e39565dc5711d",
             "small": "5e50f0fdfdd64f0994a9141847c68b7da8d26c8c1c0e19af9835ce20c19a00ce"}


def _lm_digest(d: Path) -> str:
    import hashlib

    from libk3.io.safetensors import read_header
    h = hashlib.sha256()
    for shard in sorted(d.glob("*.safetensors")):
        with open(shard, "rb") as f:
            for ent in sorted(read_header(shard), key=lambda e: e.name):
                if ent.name.startswith("language_model."):
                    f.seek(ent.offset)
                    for part in (ent.name, ent.dtype, str(tuple(ent.shape))):
                        h.update(part.encode())
                    h.update(f.read(ent.nbytes))
    for fname in ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py"):
        h.update((d / fname).read_bytes())
    return h.hexdigest()


def test_synth_image_tower_leaves_language_model_bytes_unchanged(small_dir, tmp_path):
    """Catches an image tower drawn from a shared generator, or written in a way that
    moves, re-encodes or reorders a language-model tensor or the tokenizer, which would
    change every pinned greedy output (fixtures/tiny is synth tiny, the first test)."""
    assert _lm_digest(FIXTURE) == LM_DIGEST["tiny"]
    assert _lm_digest(small_dir) == LM_DIGEST["small"]
    other = synth_checkpoint(tmp_path / "s1", "tiny", seed=1, progress=False)
    assert _lm_digest(other) != LM_DIGEST["tiny"]             # control: the digest sees data


def _widths(v: dict) -> dict:
    D, heads, Q = v["vt_hidden_size"], v["vt_num_attention_heads"], v["qkv_hidden_size"]
    m = v["merge_kernel_size"][0]
    return {"D": D, "Q": Q, "3Q": 3 * Q, "I": v["vt_intermediate_size"], "M": m * m * D,
            "T": v["text_hidden_size"], "head": Q // heads, "D/heads": D // heads}


def _collisions(v: dict) -> list:
    w = _widths(v)
    out = [f"{a}={b}" for a, b in ((a, b) for a in w for b in w if a < b) if w[a] == w[b]]
    H, W = v["init_pos_emb_height"], v["init_pos_emb_width"]
    if H % 2 == 0 or W % 2 == 0 or H == W:
        out.append(f"table {H}x{W}")
    if w["head"] % 4:
        out.append("head not a multiple of 4")
    return out


def test_synth_shrunk_towers_keep_every_width_distinct():
    """Catches a shrunk preset where two widths coincide (a transposed wqkv, wo or
    projector weight would then load silently) or the position table fits a grid."""
    from libk3.synth.presets import PRESETS, VISIONS
    for preset in ("tiny", "small", "medium"):
        assert not _collisions(VISIONS[preset]), (preset, _collisions(VISIONS[preset]))
        assert VISIONS[preset]["text_hidden_size"] == PRESETS[preset][0]["hidden_size"]
    assert _collisions(dict(VISIONS["tiny"], vt_hidden_size=32)) == ["M=T"]   # control


def test_synth_writes_published_image_config_and_tower(small_dir, real_sparse_dir):
    """Catches a preset without the image files, a real preset whose vision_config is not
    the published one, a preprocessor config shrunk with the tower, or image tensors
    that are not the inventory vision.md §3.1 writes out for the config.json written."""
    from libk3.k3_dims import MEDIA_PROC, VISION
    for d in (FIXTURE, small_dir, real_sparse_dir):
        assert json.loads((d / "preprocessor_config.json").read_text()) == \
            {"media_proc_cfg": MEDIA_PROC}
        doc = json.loads((d / "config.json").read_text())
        v = doc["vision_config"]
        assert len(v) == 25 and set(v) == set(VISION)
        D, Q, I = v["vt_hidden_size"], v["qkv_hidden_size"], v["vt_intermediate_size"]
        p, T = v["patch_size"], v["text_hidden_size"]
        want = {"vision_tower.patch_embed.proj.weight": (D, 3, p, p),
                "vision_tower.patch_embed.pos_emb.weight":
                    (v["init_pos_emb_height"], v["init_pos_emb_width"], D),
                "vision_tower.encoder.final_layernorm.weight": (D,),
                "mm_projector.proj.0.weight": (4 * D, 4 * D),
                "mm_projector.proj.2.weight": (T, 4 * D), "mm_projector.post_norm.weight": (T,)}
        for b in range(v["vt_num_hidden_layers"]):
            blk = f"vision_tower.encoder.blocks.{b}."
            want.update({blk + "norm0.weight": (D,), blk + "norm1.weight": (D,),
                         blk + "wqkv.weight": (3 * Q, D), blk + "wo.weight": (D, Q),
                         blk + "mlp.fc0.weight": (I, D), blk + "mlp.fc1.weight": (D, I)})
        from libk3.io.safetensors import read_header
        got = {e.name: (tuple(e.shape), e.dtype) for s in d.glob("*.safetensors")
               for e in read_header(s) if not e.name.startswith("language_model.")}
        assert got == {n: (s, "BF16") for n, s in want.items()}
        with Checkpoint.open(d) as ckpt:
            assert ckpt.vision_config.text_hidden_size == ckpt.config.hidden_size
    assert {k: v for k, v in doc["vision_config"].items()} == VISION    # real-sparse
    assert len(want) == 168 and doc["media_placeholder_token_id"] == 163605
