"""The DSpark draft checkpoint (libk3/draft/checkpoint.py) and synthetic drafts
(libk3/synth/draft.py, `k3-pack synth --draft`).

The committed draft `fixtures/tiny/draft` is the control: it loads. Each negative test
rewrites it with one defect and requires one error line naming the file and the tensor
(or the config), of the class the tools map to exit 3. The expected inventory is written
out here from dspark.md §3.1, independently of `DraftConfig.tensor_shapes`, which the
writer and the reader share.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libk3 import names
from libk3.config import config_from_dict, load_config
from libk3.draft import checkpoint as draft_ckpt
from libk3.draft.checkpoint import load_draft
from libk3.draft.config import draft_config_from_dict
from libk3.errors import CheckpointError, ConfigError
from libk3.io.checkpoint import Checkpoint
from libk3.io.dtypes import bf16_to_f32
from libk3.io.safetensors import read_header, write_shard
from libk3.synth.draft import draft_config_doc, synth_draft
from libk3.synth.presets import DRAFTS, PRESETS

from .hostile import run_script, script

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
DRAFT = FIXTURE / "draft"
EMBED = "embed_tokens.weight"

# The published draft's config.json, written out from dspark.md §2.1.
PUBLISHED = {
    "architectures": ["K3DSparkModel"], "model_type": "k3_dspark",
    "hidden_size": 7168, "intermediate_size": 14336, "num_hidden_layers": 5,
    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 163840, "rms_norm_eps": 1e-05, "max_position_embeddings": 1048576,
    "rope_parameters": {"rope_type": "yarn", "factor": 32, "original_max_position_embeddings":
                        32768, "beta_fast": 32, "beta_slow": 1, "mscale": 1,
                        "mscale_all_dim": 1, "rope_theta": 50000},
    "target_layer_ids": [2, 23, 47, 71, 89], "num_target_layers": 5,
    "target_hidden_size": 7168, "target_num_hidden_layers": 93, "mask_token_id": 163837,
    "markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}


def _spec_inventory(doc: dict) -> dict:
    """{bare name: shape} of dspark.md §3.1 for a config.json ``doc`` (confidence head
    with the Markov input, no per-tap norms)."""
    E, V, R = doc["hidden_size"], doc["vocab_size"], doc["markov_rank"]
    H, nope, rope, v = (doc["num_attention_heads"], doc["qk_nope_head_dim"],
                        doc["qk_rope_head_dim"], doc["v_head_dim"])
    q, kv, F = doc["q_lora_rank"], doc["kv_lora_rank"], doc["intermediate_size"]
    out = {"embed_tokens.weight": (V, E),
           "context_proj.weight": (E, len(doc["target_layer_ids"]) * doc["target_hidden_size"]),
           "context_norm.weight": (E,), "final_norm.weight": (E,),
           "markov_head.markov_w1.weight": (V, R), "markov_head.markov_w2.weight": (V, R),
           "confidence_head.proj.weight": (1, E + R), "confidence_head.proj.bias": (1,)}
    for i in range(doc["num_hidden_layers"]):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        out.update({f"layers.{i}.input_layernorm.weight": (E,),
                    f"layers.{i}.post_attention_layernorm.weight": (E,),
                    a + "q_a_proj.weight": (q, E), a + "q_a_layernorm.weight": (q,),
                    a + "q_b_proj.weight": (H * (nope + rope), q),
                    a + "kv_a_proj_with_mqa.weight": (kv + rope, E),
                    a + "kv_a_layernorm.weight": (kv,),
                    a + "kv_b_proj.weight": (H * (nope + v), kv),
                    a + "o_proj.weight": (E, H * v),
                    m + "gate_proj.weight": (F, E), m + "up_proj.weight": (F, E),
                    m + "down_proj.weight": (E, F)})
    return out


@pytest.fixture(scope="module")
def target():
    return load_config(FIXTURE)


def _tensors(d: Path = DRAFT) -> list:
    """[name, dtype, shape, bytes] of a one-file draft, in file order."""
    blob = (d / "model.safetensors").read_bytes()
    return [[e.name, e.dtype, list(e.shape), blob[e.offset:e.offset + e.nbytes]]
            for e in read_header(d / "model.safetensors")]


def _write(d: Path, tensors: list, config: dict | None = None) -> Path:
    """A draft directory: the fixture's config.json (with ``config`` keys replaced) and
    one model.safetensors holding ``tensors``."""
    d.mkdir(parents=True)
    doc = json.loads((DRAFT / "config.json").read_text())
    doc.update(config or {})
    (d / "config.json").write_text(json.dumps(doc))
    write_shard(d / "model.safetensors", [tuple(t) for t in tensors])
    return d


def _same(a, b) -> None:
    assert a.weights.keys() == b.weights.keys()
    for name, arr in a.weights.items():
        other = b.weights[name]
        assert arr.dtype == other.dtype and arr.shape == other.shape, name
        assert np.array_equal(arr, other), name
    assert a.nbytes == b.nbytes and a.cfg.tensor_shapes() == b.cfg.tensor_shapes()


def _refused(exc_type, d: Path, target, *words) -> str:
    """load_draft raises ``exc_type`` as one line naming every one of ``words``."""
    with pytest.raises(exc_type) as info:
        load_draft(d, target)
    line = str(info.value)
    assert "\n" not in line and info.value.exit_code == 3
    assert all(str(w) in line for w in words), (words, line)
    return line


# ---- the valid draft ------------------------------------------------------------------------

def test_draft_fixture_loads_in_the_kernels_forms(target):
    """Catches a reader that widens matrices (the kernels take BF16 bits), leaves vectors
    as bits, reads other bytes than the header's, or miscounts the RAM it holds."""
    ck = load_draft(DRAFT, target)
    ck.cfg.check_against(target)
    raw = {n: b for n, _, _, b in _tensors()}
    assert set(ck.weights) == set(raw) - {EMBED} and len(ck.weights) == 67
    for name, arr in ck.weights.items():
        bits = np.frombuffer(raw[name], "<u2")
        if arr.ndim == 2 and name != "confidence_head.proj.weight":
            assert arr.dtype == np.uint16 and np.array_equal(arr.reshape(-1), bits), name
        else:
            assert arr.dtype == np.float32, name
            assert np.array_equal(arr.reshape(-1), bf16_to_f32(bits)), name
    E, R = ck.cfg.hidden_size, ck.cfg.markov_rank
    assert ck.weights["confidence_head.proj.weight"].shape == (1, E + R)
    assert ck.nbytes == sum(a.nbytes for a in ck.weights.values())
    assert ck.source == str(DRAFT)


def test_draft_synthetic_inventory_is_the_spec_one():
    """Catches a writer or an inventory that drifts from dspark.md §3.1: a name, a shape,
    a dtype other than BF16, or a tensor count other than 68."""
    doc = json.loads((DRAFT / "config.json").read_text())
    want = _spec_inventory(doc)
    got = {n: (tuple(s), dt) for n, dt, s, _ in _tensors()}
    assert len(want) == 68 and set(got) == set(want)
    assert all(got[n] == (want[n], "BF16") for n in want), \
        [(n, got[n], want[n]) for n in want if got[n] != (want[n], "BF16")][:5]
    assert draft_config_from_dict(doc).tensor_shapes() == want


def test_draft_published_totals_match_the_ledger():
    """Catches an inventory that miscounts the published draft: dspark.md §3.3's
    3,562,312,961 parameters, 409,419,776 per layer, 68 tensors."""
    shapes = draft_config_from_dict(PUBLISHED).tensor_shapes()
    assert shapes == _spec_inventory(PUBLISHED) and len(shapes) == 68
    count = {n: math.prod(s) for n, s in shapes.items()}
    assert sum(count.values()) == 3_562_312_961
    assert 2 * sum(count.values()) == 7_124_625_922
    assert sum(c for n, c in count.items() if n.startswith("layers.0.")) == 409_419_776


def test_draft_model_prefix_loads_identically(target, tmp_path):
    """Catches a reader that accepts only bare names (the `model.` form is allowed)."""
    d = _write(tmp_path / "p", [["model." + n, *rest] for n, *rest in _tensors()])
    _same(load_draft(d, target), load_draft(DRAFT, target))


def _sharded(d: Path, tensors: list, weight_map_edit=None) -> Path:
    """The draft split into two shards (first half, second half) with an index."""
    d.mkdir(parents=True)
    (d / "config.json").write_text((DRAFT / "config.json").read_text())
    half = len(tensors) // 2
    files = {"model-00001-of-00002.safetensors": tensors[:half],
             "model-00002-of-00002.safetensors": tensors[half:]}
    weight_map = {}
    for fname, part in files.items():
        write_shard(d / fname, [tuple(t) for t in part])
        weight_map.update({t[0]: fname for t in part})
    if weight_map_edit:
        weight_map_edit(weight_map)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


def test_draft_index_sharded_loads_identically(target, tmp_path):
    """Catches a reader that knows only the one-file form (dspark.md §3.2)."""
    d = _sharded(tmp_path / "s", _tensors())
    _same(load_draft(d, target), load_draft(DRAFT, target))


def test_draft_index_naming_a_missing_shard_is_refused(target, tmp_path):
    """Catches a sharded draft loaded from the shards that happen to be there."""
    d = _sharded(tmp_path / "s", _tensors())
    (d / "model-00002-of-00002.safetensors").unlink()
    _refused(CheckpointError, d, target, d / "model-00002-of-00002.safetensors")


def test_draft_index_placing_a_tensor_in_the_wrong_shard_is_refused(target, tmp_path):
    """Catches an index that is believed without checking the headers."""
    def move(wm):
        wm["final_norm.weight"] = next(f for f in set(wm.values()) if f != wm["final_norm.weight"])
    d = _sharded(tmp_path / "s", _tensors(), move)
    wrong = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    _refused(CheckpointError, d, target, d / wrong["final_norm.weight"], "final_norm.weight")


# ---- one defect each ------------------------------------------------------------------------

def _drop(ts, name):
    return [t for t in ts if t[0] != name]


def _set(ts, which, **kw):
    """The tensor list with tensor ``which``'s name, dtype, shape or data replaced."""
    out = []
    for t in ts:
        t = list(t)
        if t[0] == which:
            t[0] = kw.get("name", t[0])
            t[1] = kw.get("dtype", t[1])
            t[2] = kw.get("shape", t[2])
            t[3] = kw.get("data", t[3])
        out.append(t)
    return out


def _as_f32(raw: bytes) -> bytes:
    return bf16_to_f32(np.frombuffer(raw, "<u2")).astype("<f4").tobytes()


E, TAPS = 128, 5                     # the tiny draft's hidden width and tap count
DEFECTS = {
    # name: (edit of the tensor list, words the error must contain)
    "missing": (lambda ts: _drop(ts, "layers.2.mlp.up_proj.weight"),
                ("layers.2.mlp.up_proj.weight", "missing")),
    "extra": (lambda ts: ts + [["fc.weight", "BF16", [E, TAPS * E], bytes(2 * E * TAPS * E)]],
              ("fc.weight", "does not describe")),
    "renamed": (lambda ts: _set(ts, "context_proj.weight", name="fc.weight"),
                ("context_proj.weight", "fc.weight")),
    "shape": (lambda ts: _set(ts, "context_proj.weight", shape=[TAPS * E, E]),
              ("context_proj.weight", f"[{E}, {TAPS * E}]", f"[{TAPS * E}, {E}]")),
    "f16-matrix": (lambda ts: _set(ts, "layers.0.self_attn.o_proj.weight", dtype="F16"),
                   ("layers.0.self_attn.o_proj.weight", "dtype BF16", "F16")),
    "f32-matrix": (lambda ts: [t if t[0] != "layers.4.self_attn.kv_b_proj.weight" else
                               [t[0], "F32", t[2], _as_f32(t[3])] for t in ts],
                   ("layers.4.self_attn.kv_b_proj.weight", "dtype BF16", "F32")),
    "f32-norm": (lambda ts: [t if t[0] != "final_norm.weight" else
                             [t[0], "F32", t[2], _as_f32(t[3])] for t in ts],
                 ("final_norm.weight", "dtype BF16", "F32")),
    "mixed-prefix": (lambda ts: [["model." + t[0], *t[1:]] if t[0] != "context_norm.weight"
                                 else t for t in ts],
                     ("context_norm.weight", "mix bare and")),
}


def test_draft_control_rewrite_loads_identically(target, tmp_path):
    """Control for every defect below: the rewrite itself changes nothing."""
    _same(load_draft(_write(tmp_path / "c", _tensors()), target), load_draft(DRAFT, target))


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_draft_defect_is_one_line_naming_file_and_tensor(defect, target, tmp_path):
    """Catches a lenient reader: a missing or extra tensor (the `fc.weight` pitfall of
    dspark.md §8), another shape, a matrix or norm stored F16/F32, mixed prefixes."""
    edit, words = DEFECTS[defect]
    d = _write(tmp_path / "d", edit(_tensors()))
    _refused(CheckpointError, d, target, d / "model.safetensors", *words)


def test_draft_confidence_head_may_be_f32(target, tmp_path):
    """Catches a reader that refuses the F32 confidence head dspark.md §3.1 allows, or
    keeps it in another form than float32 [1, E + R]."""
    f32 = {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    d = _write(tmp_path / "f", [t if t[0] not in f32 else [t[0], "F32", t[2], _as_f32(t[3])]
                                for t in _tensors()])
    _same(load_draft(d, target), load_draft(DRAFT, target))


def test_draft_truncated_file_names_the_last_tensor(target, tmp_path):
    """Catches a reader that trusts the header's offsets past the end of the file."""
    d = _write(tmp_path / "t", _tensors())
    last = _tensors()[-1][0]
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(d / "model.safetensors") - 1)
    _refused(CheckpointError, d, target, d / "model.safetensors", last, "past the end")


def test_draft_embedding_past_the_end_is_refused_though_never_read(target, tmp_path):
    """Catches a reader that skips every check of the embedding copy along with its read."""
    ts = _tensors()
    ts = [t for t in ts if t[0] != EMBED] + [t for t in ts if t[0] == EMBED]
    d = _write(tmp_path / "e", ts)
    load_draft(d, target)                                     # control: intact, it loads
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(d / "model.safetensors") - 1)
    _refused(CheckpointError, d, target, d / "model.safetensors", EMBED)


@pytest.mark.parametrize("change,words", [
    ({"hidden_size": 256, "target_hidden_size": 256}, ("hidden_size 256",)),
    ({"vocab_size": 1024}, ("vocab_size 1024",)),
    ({"target_num_hidden_layers": 14}, ("target_num_hidden_layers 14",)),
    ({"target_layer_ids": [1, 3, 6, 9, 13]}, ("target_layer_ids", "past")),
    # with equal vocabularies the config's own range check refuses this one first
    ({"mask_token_id": 512}, ("mask_token_id 512",)),
])
def test_draft_made_for_another_target_is_refused(change, words, target, tmp_path):
    """Catches a draft checked only against itself (dspark.md §2.3): another width,
    vocabulary or depth, a tap past the target's last layer, a mask id outside the
    vocabulary; refused as a config error naming config.json, before any tensor."""
    d = _write(tmp_path / "x", _tensors(), config=change)
    _refused(ConfigError, d, target, d / "config.json", *words)


def test_draft_config_implying_huge_depth_is_refused_quickly(target, tmp_path):
    """Catches a reader that builds the inventory of a config before comparing it with
    the files (a million layers, twelve million names, must not be listed)."""
    d = _write(tmp_path / "h", _tensors(), config={"num_hidden_layers": 10**6})
    line = _refused(CheckpointError, d, target, d / "model.safetensors", "layers.5.")
    assert "12000008 tensors" in line


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_draft_any_single_tensor_defect_is_named(data):
    """Catches any tensor whose removal, rename, reshape or retype slips through."""
    target = load_config(FIXTURE)
    ts = _tensors()
    name = data.draw(st.sampled_from([t[0] for t in ts]))
    kind = data.draw(st.sampled_from(["drop", "rename", "reshape", "f16"]))
    if kind == "drop":
        ts = _drop(ts, name)
    elif kind == "rename":
        ts = _set(ts, name, name="x" + name)
    elif kind == "reshape":
        shape = next(t[2] for t in ts if t[0] == name)
        ts = _set(ts, name, shape=[1] + shape if math.prod(shape) else shape)
    else:
        ts = _set(ts, name, dtype="F16")
    with tempfile.TemporaryDirectory() as tmp:
        d = _write(Path(tmp) / "d", ts)
        _refused(CheckpointError, d, target, d / "model.safetensors", name)


# ---- the embedding copy is never read -------------------------------------------------------

def test_draft_embedding_copy_is_never_read(target, tmp_path, monkeypatch):
    """Catches a reader that loads the 2.3 GB embedding copy k3 never uses
    (dspark.md §3.1): no read touches its bytes, every other tensor is read once."""
    d = _write(tmp_path / "n", _set(_tensors(), EMBED, data=b"\xff" * len(
        next(t[3] for t in _tensors() if t[0] == EMBED))))   # NaN everywhere
    reads = []
    real = draft_ckpt.pread_into

    def spy(fd, offset, buf, path=None, tensor=None):
        reads.append((offset, memoryview(buf).nbytes, tensor))
        return real(fd, offset, buf, path=path, tensor=tensor)
    monkeypatch.setattr(draft_ckpt, "pread_into", spy)
    ck = load_draft(d, target)
    ents = {e.name: e for e in read_header(d / "model.safetensors")}
    emb = ents[EMBED]
    assert EMBED not in ck.weights
    assert not [r for r in reads if r[0] < emb.offset + emb.nbytes and emb.offset < r[0] + r[1]]
    assert sorted(r[2] for r in reads) == sorted(n for n in ents if n != EMBED)   # control


# ---- synthetic drafts -----------------------------------------------------------------------

def test_synth_draft_is_deterministic_and_matches_fixture(tmp_path):
    """Catches unseeded or order-dependent draft values and a stale fixtures/tiny/draft."""
    a = synth_draft(FIXTURE, tmp_path / "a", seed=0)
    b = synth_draft(FIXTURE, tmp_path / "b", seed=0)
    for f in ("config.json", "model.safetensors"):
        assert (a / f).read_bytes() == (b / f).read_bytes() == (DRAFT / f).read_bytes(), \
            f"fixtures/tiny/draft/{f} is stale: regenerate with k3-pack synth --draft"
    c = synth_draft(FIXTURE, tmp_path / "c", seed=1)
    assert (c / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]   # no build dirs


def test_synth_draft_embedding_is_the_targets_bytes():
    """Catches a draft whose embedding copy is drawn afresh instead of copied."""
    ents = {e.name: e for e in read_header(DRAFT / "model.safetensors")}
    blob = (DRAFT / "model.safetensors").read_bytes()
    mine = blob[ents[EMBED].offset:ents[EMBED].offset + ents[EMBED].nbytes]
    with Checkpoint.open(FIXTURE) as ckpt:
        theirs = ckpt.read_raw(names.EMBED).tobytes()
        other = ckpt.read_raw(names.LM_HEAD).tobytes()
    assert mine == theirs and mine != other                    # control: not any tensor


def test_synth_draft_values_are_order_one():
    """Catches scales that saturate or vanish: norm gains near 1, projections whose
    outputs have unit scale for unit-scale inputs, no NaN or Inf."""
    ck = load_draft(DRAFT, load_config(FIXTURE))
    for name, arr in ck.weights.items():
        w = bf16_to_f32(arr) if arr.dtype == np.uint16 else arr
        assert np.all(np.isfinite(w)), name
        if name.endswith("norm.weight"):
            assert 0.5 < w.mean() < 1.5, name
        elif w.ndim == 2 and name != "markov_head.markov_w1.weight":
            assert 0.5 < float(np.sqrt((w.astype(np.float64) ** 2).sum(1).mean())) < 2, name


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_draft_presets_fit_their_targets(preset):
    """Catches a draft preset made for another target: taps past its layers, or not
    mixing KDA and MLA layers, a mask id outside the special-token slots, a file far
    larger than its preset promises."""
    flat, n_special, _, _ = PRESETS[preset]
    tcfg = config_from_dict(dict(flat))
    cfg = draft_config_from_dict(draft_config_doc(tcfg, preset))
    cfg.check_against(tcfg)
    taps = cfg.target_layer_ids
    if tcfg.num_hidden_layers >= 5:
        assert len(taps) == 5 and {tcfg.is_mla(L) for L in taps} == {True, False}
    else:
        assert taps == tuple(range(tcfg.num_hidden_layers))
    assert tcfg.vocab_size - n_special <= cfg.mask_token_id < tcfg.vocab_size
    size = 2 * sum(math.prod(s) for s in cfg.tensor_shapes().values())
    limit = {"tiny": 1e6, "small": 5e7, "medium": 1e9}.get(preset)
    if limit:
        assert size < limit
    else:                                   # the published dimensions
        for key in ("intermediate_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "markov_rank"):
            assert getattr(cfg, key) == PUBLISHED[key], key
    if preset == "real-sparse":
        assert list(taps) == PUBLISHED["target_layer_ids"]
    assert set(DRAFTS) == set(PRESETS)


def test_synth_draft_refuses_a_target_of_no_preset(tmp_path):
    """Catches a draft guessed for a target it was not designed for."""
    d = tmp_path / "t"
    d.mkdir()
    doc = json.loads((FIXTURE / "config.json").read_text())
    doc["text_config"]["intermediate_size"] = 100
    (d / "config.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="no synthetic preset"):
        synth_draft(d, tmp_path / "draft")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_synth_with_draft_failing_leaves_nothing(tmp_path, monkeypatch):
    """Catches a target left behind without the draft it was asked for."""
    import libk3.synth.draft as synth_draft_mod
    from libk3.synth.checkpoint import synth_checkpoint

    def boom(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(synth_draft_mod, "write_shard", boom)
    with pytest.raises(Exception, match="No space left"):
        synth_checkpoint(tmp_path / "m", "tiny", progress=False, draft=True)
    assert list(tmp_path.iterdir()) == []


def test_synth_real_sparse_draft_is_holes_with_the_published_inventory(real_sparse_dir,
                                                                       tmp_path):
    """Catches a real-sparse draft written dense (7 GB) or with other than the published
    shapes and taps."""
    d = synth_draft(real_sparse_dir, tmp_path / "draft")
    f = d / "model.safetensors"
    shapes = {e.name: e.shape for e in read_header(f)}
    assert shapes == _spec_inventory(PUBLISHED)
    assert f.stat().st_size > 7_124_625_922 and f.stat().st_blocks * 512 < 1e7
    load_draft_cfg = draft_config_from_dict(json.loads((d / "config.json").read_text()))
    assert list(load_draft_cfg.target_layer_ids) == PUBLISHED["target_layer_ids"]
    assert load_draft_cfg.mask_token_id == PUBLISHED["mask_token_id"]


def test_k3_pack_synth_draft_end_to_end(tmp_path):
    """Catches `k3-pack synth --draft` not writing the draft, writing another than the
    library's (the fixture), or a summary that does not mention it."""
    out = tmp_path / "m"
    p = run_script([script("k3-pack"), "synth", out, "--preset", "tiny", "--draft", "--json",
                    "--quiet"])
    assert p.code == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["draft"]["tensors"] == 68 and info["draft"]["path"] == str(out / "draft")
    for f in ("config.json", "model.safetensors"):
        assert (out / "draft" / f).read_bytes() == (DRAFT / f).read_bytes()
    for f in ("config.json", "model.safetensors.index.json", "model-00014-of-000014.safetensors"):
        assert (out / f).read_bytes() == (FIXTURE / f).read_bytes()       # the target unchanged
    assert load_draft(out / "draft", load_config(out)).cfg.n_taps == 5
    plain = run_script([script("k3-pack"), "synth", tmp_path / "n", "--quiet"])
    assert plain.code == 0 and not (tmp_path / "n" / "draft").exists()   # control


def test_draft_check_only_counts_what_a_read_would_hold(tiny_dir):
    """Catches a memory figure (budgets, the doctor) that differs from what loading the
    draft holds, or a check-only load that reads the weights anyway."""
    from libk3.io.checkpoint import Checkpoint
    with Checkpoint.open(tiny_dir) as ckpt:
        full = load_draft(tiny_dir / "draft", ckpt.config)
        check = load_draft(tiny_dir / "draft", ckpt.config, read=False)
    assert full.nbytes == sum(a.nbytes for a in full.weights.values()) == check.nbytes
    assert check.weights == {} and check.cfg == full.cfg
