"""The checkpoint index (libk3/io/checkpoint.py): shard discovery, the name table,
validation against the config, reads, expert and trunk runs, identity.

Each negative test makes one mutation of a valid toy checkpoint (tests/ckpt_helpers.py)
and opens an unmutated control first. Conformance fixtures: st/ (shard ordering by
listing, vision-style names ignored) and cache/ (expert runs at the documented offsets).
Not covered: real-scale timing (measured by hand, see the module docstring).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from libk3 import names
from libk3.errors import CheckpointError, ConfigError
from libk3.io import inventory
from libk3.io.checkpoint import Checkpoint
from libk3.io.shards import survey_shards
from libk3.io.dtypes import widen

from .ckpt_helpers import shard_of_layer, toy_config, toy_plan, write_toy
from .conformance import ROOT

CACHE = ROOT / "cache"
ST = ROOT / "st"
RUN_OFFSETS = [0, 512, 544, 1056, 1088, 1600]       # conformance README section 8


@pytest.fixture
def plan():
    return toy_plan()


@pytest.fixture
def toy(tmp_path, plan):
    return write_toy(tmp_path / "toy", plan)


def _control(tmp_path, plan=None):
    d = write_toy(tmp_path / "control", plan or toy_plan())
    with Checkpoint.open(d) as ck:
        assert len(ck) == sum(len(v) for v in toy_plan().values())


def _bad(tmp_path, plan, **kw):
    _control(tmp_path)
    return write_toy(tmp_path / "bad", plan, **kw)


# ---- valid checkpoints ------------------------------------------------------------------

def test_checkpoint_reads_every_tensor_back_exactly(toy, plan):
    """Catches: offsets off by the header length, a table mixing up shards, widening
    that differs from dtypes.widen, or read_raw/read_matrix returning the wrong bytes."""
    with Checkpoint.open(toy) as ck:
        for tensors in plan.values():
            for name, dtype, shape, data in tensors:
                raw = ck.read_raw(name)
                assert raw.tobytes() == data, name
                arr = ck.read(name)
                want = widen(np.frombuffer(data, np.uint8), dtype, shape)
                assert arr.shape == tuple(shape)
                assert np.array_equal(arr.view(np.uint8), want.view(np.uint8)), name
                if dtype in ("BF16", "F32"):
                    m = ck.read_matrix(name)
                    assert m.dtype == (np.uint16 if dtype == "BF16" else np.float32)
                    assert m.shape == tuple(shape) and m.tobytes() == data


def test_checkpoint_read_into_preallocated_out(toy):
    """Catches: ignoring ``out`` (allocating anyway) or writing past nbytes into it."""
    name = names.layer(1, "self_attn.q_proj.weight")
    with Checkpoint.open(toy) as ck:
        ent = ck.entry(name)
        buf = np.full(ent.nbytes + 16, 0xAB, np.uint8)
        got = ck.read_raw(name, out=buf)
        assert np.shares_memory(got, buf) and got.size == ent.nbytes
        assert (buf[ent.nbytes:] == 0xAB).all()
        out = np.empty(int(np.prod(ent.shape)), np.float32)
        arr = ck.read(name, out=out)
        assert np.shares_memory(arr, out) and arr.tobytes() == ck.read(name).tobytes()


def test_checkpoint_without_index_scans_shards(tmp_path, plan):
    """Catches: a reader that requires model.safetensors.index.json (unverified in the
    release, model.md §3.1)."""
    d = write_toy(tmp_path / "noindex", plan, index=False)
    with Checkpoint.open(d) as ck:
        assert len(ck) == sum(len(v) for v in plan.values())
        assert [os.path.basename(p) for p in ck.shards] == sorted(plan)


def test_checkpoint_single_model_safetensors(tmp_path, plan):
    """Catches: shard discovery that only matches the model-XXXXX-of-YYYYY pattern."""
    d = tmp_path / "single"
    flat = [t for tensors in plan.values() for t in tensors]
    write_toy(d, {"model.safetensors": flat}, index=False)
    with Checkpoint.open(d) as ck:
        assert [os.path.basename(p) for p in ck.shards] == ["model.safetensors"]
        assert ck.expert_run(2, 3).nbytes == toy_config().expert_bytes


def test_checkpoint_ignores_vision_tensors(tmp_path, plan):
    """Catches: indexing vision_tower/mm_projector tensors, which validation would then
    reject as unexpected (the release ships 168 of them)."""
    plan["model-99999-of-99999.safetensors"] = [
        ("vision_tower.blocks.0.weight", "BF16", (4, 4), bytes(32)),
        ("mm_projector.proj.weight", "F32", (2,), bytes(8))]
    d = write_toy(tmp_path / "vision", plan)
    with Checkpoint.open(d) as ck:
        assert "vision_tower.blocks.0.weight" not in ck
        assert all(n.startswith("language_model.") for n in ck.names())


def test_expert_run_matches_expert_table_and_bytes(toy, plan):
    """Catches: run offsets that are not the minimum tensor offset (experts are stored out
    of id order), sub-offsets in the wrong part order, or a table built for the wrong
    layers (dense layer 0 must have none)."""
    cfg = toy_config()
    data = {t[0]: t[3] for ts in plan.values() for t in ts}
    with Checkpoint.open(toy) as ck:
        table = ck.expert_table()
        assert (table.shard[0] == -1).all()
        for L in cfg.moe_layers:
            for e in range(cfg.num_experts):
                run = ck.expert_run(L, e)
                assert run.nbytes == cfg.expert_bytes
                assert table.paths[table.shard[L, e]] == run.path
                assert table.offset[L, e] == run.offset
                assert table.nbytes[L, e] == run.nbytes
                got = ck.read_span(run.path, run.offset, run.nbytes)
                for k, (wp, (sub, nb, shape)) in enumerate(run.parts.items()):
                    assert wp == names.EXPERT_PARTS[k]
                    assert table.part_offset[L, e, k] == sub and table.part_nbytes[L, e, k] == nb
                    assert got[sub:sub + nb].tobytes() == data[names.expert(L, e, *wp)]
        assert len({int(table.offset[1, e]) for e in range(cfg.num_experts)}) == cfg.num_experts


def test_layer_trunk_run_is_one_span_holding_every_trunk_tensor(toy, plan):
    """Catches: a trunk run that leaves out a tensor (e.g. A_log with its unknown shape),
    includes experts, or reports sub-offsets from the file start instead of the run."""
    cfg = toy_config()
    data = {t[0]: t[3] for ts in plan.values() for t in ts}
    with Checkpoint.open(toy) as ck:
        for L in range(cfg.num_hidden_layers):
            path, start, nbytes, tensors = ck.layer_trunk_run(L)
            want = {s.name for s in inventory.layer_trunk(cfg, L)}
            assert set(tensors) == want
            blob = ck.read_span(path, start, nbytes).tobytes()
            for name, (sub, nb, dtype, shape) in tensors.items():
                assert blob[sub:sub + nb] == data[name]
            assert sum(t[1] for t in tensors.values()) == nbytes


def test_identity_names_fingerprint_and_shard_sizes(toy):
    """Catches: an identity that misses a shard or its size (a re-downloaded shard would
    then pass for the old one) or does not change with the config."""
    with Checkpoint.open(toy) as ck:
        ident = ck.identity()
    assert ident["config_fingerprint"] == toy_config().fingerprint()
    assert ident["shards"] == [[p.name, p.stat().st_size]
                               for p in sorted(toy.glob("*.safetensors"))]
    json.dumps(ident)
    with Checkpoint.open(toy, config=toy_config(routed_scaling_factor=2.0)) as ck:
        assert ck.identity()["config_fingerprint"] != ident["config_fingerprint"]


def test_survey_reports_truncation_per_shard(toy):
    """Catches: a doctor check that stops at the first bad shard or reports healthy
    shards (control: no problems before the cut)."""
    assert survey_shards(toy).problems == []
    shards = sorted(toy.glob("*.safetensors"))
    for p in shards[1:3]:
        os.truncate(p, p.stat().st_size - 3)
    with open(shards[0], "ab") as f:
        f.write(b"xx")
    survey = survey_shards(toy)
    problems = survey.problems
    assert sorted(os.path.basename(e.path) for e in problems) == \
        sorted(p.name for p in shards[:3])
    assert sum("truncated" in str(e) for e in problems) == 2
    assert list(survey.headers) == [str(p) for p in shards[3:]]    # only the sound ones
    with pytest.raises(ValueError):
        Checkpoint.open(toy, survey=survey)


def test_open_from_a_survey_reads_no_header_again_and_indexes_the_same(toy, monkeypatch):
    """Catches the doctor parsing every shard's header twice (once to measure, once to
    open), or a survey whose rows differ from the ones an open reads: the table from the
    survey equals a plain open's with header reads disabled."""
    from libk3.io import checkpoint as ckpt_mod
    with Checkpoint.open(toy) as plain:
        want = dict(plain._table)
    survey = survey_shards(toy)

    def no_read(path):
        raise AssertionError(f"{path} read again")
    monkeypatch.setattr(ckpt_mod, "read_header", no_read)
    monkeypatch.setattr(ckpt_mod, "find_shards", no_read)
    with Checkpoint.open(toy, survey=survey) as again:
        assert again._table == want and len(want) > 0
    with pytest.raises(AssertionError, match="read again"):          # control
        Checkpoint.open(toy)


# ---- one defect each --------------------------------------------------------------------

def test_checkpoint_refuses_truncated_shard(tmp_path, plan):
    """Catches: a reader that opens a truncated shard and fails (or reads zeros) only when
    the missing tensor is first used."""
    d = _bad(tmp_path, plan)
    victim = d / shard_of_layer(plan, 2)
    os.truncate(victim, victim.stat().st_size - 1)
    with pytest.raises(CheckpointError, match="truncated") as info:
        Checkpoint.open(d)
    assert str(victim) in str(info.value)


def test_checkpoint_refuses_index_naming_a_tensor_missing_from_header(tmp_path, plan):
    """Catches: trusting the index's weight_map without checking the shard header."""
    wm = {t[0]: f for f, ts in plan.items() for t in ts}
    ghost = names.layer(1, "self_attn.ghost.weight")
    wm[ghost] = shard_of_layer(plan, 1)
    d = _bad(tmp_path, plan, weight_map=wm)
    with pytest.raises(CheckpointError, match="header lacks it") as info:
        Checkpoint.open(d)
    assert info.value.tensor == ghost


def test_checkpoint_refuses_missing_shard_named_by_index(tmp_path, plan):
    """Catches: silently skipping a shard the index names (its layer would be absent)."""
    d = _bad(tmp_path, plan)
    gone = shard_of_layer(plan, 3)
    (d / gone).unlink()
    with pytest.raises(CheckpointError, match="missing") as info:
        Checkpoint.open(d)
    assert gone in str(info.value)
    assert any(gone in str(e) for e in survey_shards(d).missing)


def test_checkpoint_refuses_tensor_missing_against_config(tmp_path, plan):
    """Catches: validation that checks only the tensors present, not the inventory; the
    message must give the count and name the tensor."""
    fname = shard_of_layer(plan, 2)
    victim = names.expert(2, 1, "w3", "weight_scale")
    plan[fname] = [t for t in plan[fname] if t[0] != victim]
    d = _bad(tmp_path, plan)
    with pytest.raises(CheckpointError, match="1 tensor") as info:
        Checkpoint.open(d)
    assert info.value.tensor == victim
    with Checkpoint.open(d, validate=False) as ck:           # still indexable
        with pytest.raises(CheckpointError, match="layer 2 expert 1"):
            ck.expert_run(2, 1)


def test_checkpoint_refuses_non_contiguous_expert_run(tmp_path, plan):
    """Catches: locating an expert by its first tensor and reading a fixed size, which
    would hand out another expert's bytes when the six tensors are interleaved."""
    fname = shard_of_layer(plan, 1)
    ts = plan[fname]
    a = next(i for i, t in enumerate(ts) if t[0] == names.expert(1, 0, "w2", "weight_scale"))
    b = next(i for i, t in enumerate(ts) if t[0] == names.expert(1, 2, "w2", "weight_scale"))
    ts[a], ts[b] = ts[b], ts[a]                             # same sizes, swapped places
    d = _bad(tmp_path, plan)
    with pytest.raises(CheckpointError, match="not one contiguous run") as info:
        Checkpoint.open(d)
    assert "layer 1 expert" in str(info.value)
    with Checkpoint.open(d, validate=False) as ck:
        ck.expert_run(1, 1)                                 # the others still locate
        with pytest.raises(CheckpointError, match="layer 1 expert 0"):
            ck.expert_run(1, 0)


def test_checkpoint_refuses_name_in_two_shards(tmp_path, plan):
    """Catches: a table where the later shard silently wins."""
    dup = next(t for t in plan[shard_of_layer(plan, 1)]
               if t[0] == names.layer(1, "input_layernorm.weight"))
    plan[shard_of_layer(plan, 3)].append(dup)
    d = _bad(tmp_path, plan, index=False)
    with pytest.raises(CheckpointError, match="two shards") as info:
        Checkpoint.open(d)
    assert info.value.tensor == dup[0]


def test_checkpoint_refuses_unexpected_language_model_tensor(tmp_path, plan):
    """Catches: validation that ignores extra tensors (a config from another model
    with fewer layers or experts would then pass)."""
    extra = names.expert(1, 4, "w1", "weight_packed")       # num_experts is 4: ids 0..3
    plan[shard_of_layer(plan, 1)].append((extra, "U8", (64, 16), bytes(1024)))
    d = _bad(tmp_path, plan)
    with pytest.raises(CheckpointError, match="does not describe") as info:
        Checkpoint.open(d)
    assert info.value.tensor == extra


def test_checkpoint_refuses_wrong_shape(tmp_path, plan):
    """Catches: validation by name only (a transposed o_proj would be read as garbage)."""
    fname = shard_of_layer(plan, 2)
    name = names.layer(2, "self_attn.o_proj.weight")
    plan[fname] = [(n, d, tuple(reversed(s)), b) if n == name else (n, d, s, b)
                   for n, d, s, b in plan[fname]]
    d = _bad(tmp_path, plan)
    with pytest.raises(CheckpointError, match="wrong shape") as info:
        Checkpoint.open(d)
    assert info.value.tensor == name


def test_checkpoint_refuses_nonzero_a_log_padding(tmp_path, plan):
    """Catches: reading A_log per channel or ignoring its padding (model.md §3.4: entries
    >= num_heads are zero; non-zero means the layout is not what k3 assumes)."""
    fname = shard_of_layer(plan, 1)
    name = names.layer(1, "self_attn.A_log")
    cfg = toy_config()
    i = next(i for i, t in enumerate(plan[fname]) if t[0] == name)
    v = np.frombuffer(plan[fname][i][3], "<f4").copy()
    v[cfg.num_heads + 3] = 0.5
    plan[fname][i] = plan[fname][i][:3] + (v.tobytes(),)
    d = _bad(tmp_path, plan)
    with pytest.raises(CheckpointError, match="A_log padding") as info:
        Checkpoint.open(d)
    assert info.value.tensor == name and f"A_log[{cfg.num_heads + 3}]" in str(info.value)


def test_checkpoint_refuses_config_without_mxfp4_widths(toy):
    """Catches: accepting an expert width that is not a multiple of the MXFP4 group."""
    with Checkpoint.open(toy):
        pass
    with pytest.raises(CheckpointError, match="MXFP4"):
        Checkpoint.open(toy, config=toy_config(moe_intermediate_size=48))


def test_checkpoint_refuses_missing_config(tmp_path, plan):
    """Catches: opening with built-in dimensions when config.json is absent."""
    d = _bad(tmp_path, plan)
    (d / "config.json").unlink()
    with pytest.raises(ConfigError):
        Checkpoint.open(d)


def test_layer_trunk_run_refuses_gapped_trunk(tmp_path, plan):
    """Catches: k3-pack copying min..max of a trunk that has an expert inside it (the
    pack would carry foreign bytes at the wrong sub-offsets)."""
    fname = shard_of_layer(plan, 3)
    ts = plan[fname]
    n_trunk = sum(1 for t in ts if ".experts." not in t[0])
    run = ts[n_trunk:n_trunk + 6]
    plan[fname] = ts[:2] + run + ts[2:n_trunk] + ts[n_trunk + 6:]
    d = _bad(tmp_path, plan)
    with Checkpoint.open(d) as ck:                          # reading by name still works
        ck.layer_trunk_run(1)
        with pytest.raises(CheckpointError, match="layer 3: trunk tensors are not one"):
            ck.layer_trunk_run(3)


def test_read_matrix_keeps_the_stored_dtype_and_refuses_u8(toy):
    """Catches: handing F32 bytes to a BF16 kernel as pairs of 16-bit halves, rounding an
    F32 tensor to BF16, or treating packed U8 expert bytes as a float matrix."""
    with Checkpoint.open(toy) as ck:
        assert ck.read_matrix(names.layer(1, "self_attn.q_proj.weight")).dtype == np.uint16
        a_log = names.layer(1, "self_attn.A_log")                   # stored F32
        got = ck.read_matrix(a_log)
        assert got.dtype == np.float32 and got.tobytes() == ck.read_raw(a_log).tobytes()
        with pytest.raises(CheckpointError, match="not a float matrix"):
            ck.read_matrix(names.expert(1, 0, "w1", "weight_packed"))
        with pytest.raises(CheckpointError, match="no such tensor"):
            ck.read(names.layer(1, "self_attn.nope"))


def test_checkpoint_close_releases_descriptors(toy):
    """Catches: leaking one descriptor per shard per open (a long session reopening the
    checkpoint would exhaust the fd limit)."""
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    with Checkpoint.open(toy) as ck:
        for L in range(4):
            ck.read_raw(names.layer(L, "input_layernorm.weight"))
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before


# ---- conformance fixtures ---------------------------------------------------------------

def test_checkpoint_cache_fixture_experts_at_documented_offsets():
    """Catches: header-padding mistakes and O_DIRECT-style arithmetic that only works for
    4096-multiple experts; every byte encodes its expert so slot aliasing shows."""
    if not CACHE.is_dir():
        pytest.skip("shared conformance data not present")
    with Checkpoint.open(CACHE, config=toy_config(), validate=False) as ck:
        for e in range(24):
            run = ck.expert_run(0, e)
            assert run.offset == 20608 + 1632 * e and run.nbytes == 1632
            assert [v[0] for v in run.parts.values()] == RUN_OFFSETS
            got = ck.read_span(run.path, run.offset, run.nbytes)
            for k, (w, part) in enumerate(names.EXPERT_PARTS):
                sub, nb, _ = run.parts[(w, part)]
                base = (977 * e + 31 * int(w[1:]) - 31 + (7 if part == "weight_scale" else 0)) % 256
                want = (np.arange(nb) + base) % 251
                assert np.array_equal(got[sub:sub + nb], want.astype(np.uint8)), (e, w, part)


def test_checkpoint_st_fixture_orders_shards_by_listing():
    """Catches: shard names formatted from a pattern (st/ uses 5-digit totals, the
    release 6) and indexing non-language_model tensors."""
    if not ST.is_dir():
        pytest.skip("shared conformance data not present")
    with Checkpoint.open(ST, config=toy_config(), validate=False) as ck:
        assert [os.path.basename(p) for p in ck.shards] == [
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        assert sorted(ck.names()) == [names.expert(0, e, "w1", "weight_packed") for e in (0, 1)]
        assert ck.entry(names.expert(0, 1, "w1", "weight_packed")).offset == 2730
        raw = ck.read(names.expert(0, 0, "w1", "weight_packed"))
        assert raw.dtype == np.uint8 and raw.shape == (2, 32)
