"""The image-input config reader: vision_config and preprocessor_config.json (formats/model/vision.md §2)."""

from __future__ import annotations

import copy
import json

import pytest

from libk3.config import load_config
from libk3.errors import ConfigError
from libk3.k3_dims import MEDIA_PROC, VISION, real_config
from libk3.vision_config import (PREPROCESSOR_FILE, load_vision_config, media_from_dict,
                                 vision_from_dict)


def _docs():
    """(config.json root, preprocessor_config.json) as published."""
    return ({"vision_config": copy.deepcopy(VISION), "media_placeholder_token_id": 163605},
            {"media_proc_cfg": copy.deepcopy(MEDIA_PROC)})


def _build(root, proc):
    media = media_from_dict(proc, source="pp.json")
    return vision_from_dict(root, real_config(), media, source="config.json")


def test_vision_config_published_values_give_head_width_from_qkv():
    """Catches a head width taken as vt_hidden_size / heads (85.3) instead of
    qkv_hidden_size / heads (128), or a merged row not of 2 x 2 patches."""
    v = _build(*_docs())
    assert (v.vt_head_dim, v.merged_width, v.patch_inputs) == (128, 4096, 588)
    assert v.media.background.gray_value == 180 and v.media.transparent_bg_fill_stage == "after_resize"
    assert v.media_placeholder_token_id == 163605 and v.merge_kernel_size == (2, 2)


def test_vision_config_every_missing_key_reported_at_once():
    """Catches a reader that stops at the first gap, or fills one with a default (the
    release's class defaults differ from its published files)."""
    root, proc = _docs()
    for key in ("qkv_hidden_size", "pos_emb_interpolation_mode", "attn_bias"):
        del root["vision_config"][key]
    del root["media_placeholder_token_id"]
    with pytest.raises(ConfigError) as e:
        _build(root, proc)
    msg = str(e.value)
    for key in ("qkv_hidden_size", "pos_emb_interpolation_mode", "attn_bias",
                "media_placeholder_token_id"):
        assert key in msg, msg
    assert msg.startswith("config.json:") and "\n" not in msg
    del proc["media_proc_cfg"]["transparent_bg_fill_stage"]
    del proc["media_proc_cfg"]["transparent_bg_config"]["chessboard_gray_value"]
    del proc["media_proc_cfg"]["fixed_output_tokens"]
    with pytest.raises(ConfigError) as e:
        media_from_dict(proc, source="pp.json")
    for key in ("transparent_bg_fill_stage", "chessboard_gray_value", "fixed_output_tokens"):
        assert key in str(e.value), str(e.value)
    _build(*_docs())                                          # control: complete files read


def _set(path, value):
    def edit(root, proc):
        where, key = path.split(".", 1)
        doc = root["vision_config"] if where == "v" else proc["media_proc_cfg"]
        *parents, last = key.split(".")
        for p in parents:
            doc = doc[p]
        doc[last] = value
    return edit


@pytest.mark.parametrize("edit,needle", [
    (_set("v.norm_type", "layernorm"), "norm_type"),
    (_set("v.pos_emb_interpolation_mode", "bicubic"), "pos_emb_interpolation_mode"),
    (_set("v.mm_projector_type", "patchmerger"), "mm_projector_type"),
    (_set("v.projector_hidden_act", "gelu_pytorch_tanh"), "projector_hidden_act"),
    (_set("v.linear_bias", True), "linear_bias"),
    (_set("v.qkv_hidden_size", 1530), "qkv_hidden_size"),             # not divisible by 12
    (_set("v.qkv_hidden_size", 1320), "qkv_hidden_size"),             # head 110: not 4 k
    (_set("v.mm_hidden_size", 1152), "mm_hidden_size"),
    (_set("v.text_hidden_size", 4096), "text_hidden_size"),
    (_set("v.merge_kernel_size", [2, 1]), "merge_kernel_size"),
    (_set("v.patch_size", 16), "patch_size"),                         # differs between files
    (_set("v.vt_hidden_size", True), "vt_hidden_size"),               # a bool is not an int
    (_set("p.merge_kernel_size", 3), "merge_kernel_size"),
    (_set("p.patch_limit_on_one_side", 513), "patch_limit_on_one_side"),
    (_set("p.fixed_output_tokens", 256), "fixed_output_tokens"),
    (_set("p.transparent_bg_fill_stage", "never"), "transparent_bg_fill_stage"),
    (_set("p.transparent_bg_config.pattern", "black"), "pattern"),
    (_set("p.image_std", [0.5, 0.0, 0.5]), "image_std"),
    (_set("p.image_mean", [0.5, 0.5]), "image_mean"),
])
def test_vision_config_unsupported_value_refused_naming_key(edit, needle):
    """Catches a reader that accepts a tower k3 does not implement (another norm, a bias,
    a head split the 2D rotary code cannot take) or files that disagree with each other."""
    root, proc = _docs()
    edit(root, proc)
    with pytest.raises(ConfigError, match=needle):
        _build(root, proc)


def test_vision_config_unsupported_value_control():
    """Control: an edit to a key k3 does not read (video only) is accepted."""
    root, proc = _docs()
    root["vision_config"]["init_pos_emb_time"] = 8
    proc["media_proc_cfg"]["sample_fps"] = 2.0
    assert _build(root, proc).vt_num_hidden_layers == 27


def test_vision_config_absent_is_a_text_model(tiny_dir, tmp_path):
    """Catches a reader that demands image keys of a text-only checkpoint, or that
    ignores vision_config when it is there."""
    d = tmp_path / "text"
    d.mkdir()
    doc = json.loads((tiny_dir / "config.json").read_text())
    assert "vision_config" in doc                              # the fixture carries a tower
    text = load_config(tiny_dir)
    assert load_vision_config(tiny_dir, text).text_hidden_size == text.hidden_size
    del doc["vision_config"]
    (d / "config.json").write_text(json.dumps(doc))
    assert load_vision_config(d, text) is None                 # no preprocessor file needed


def test_vision_config_without_preprocessor_file_refused(tiny_dir, tmp_path):
    """Catches a reader that falls back to built-in preprocessing values when
    preprocessor_config.json is absent or unreadable."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_bytes((tiny_dir / "config.json").read_bytes())
    text = load_config(d)
    with pytest.raises(ConfigError, match=PREPROCESSOR_FILE) as e:
        load_vision_config(d, text)
    assert str(d / PREPROCESSOR_FILE) in str(e.value)
    (d / PREPROCESSOR_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_vision_config(d, text)
    (d / PREPROCESSOR_FILE).write_bytes((tiny_dir / PREPROCESSOR_FILE).read_bytes())
    assert load_vision_config(d, text) is not None             # control
