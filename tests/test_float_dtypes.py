"""Any float dtype for any trunk or model-level tensor, matrices included (issue 13): the
dtype comes from the shard header and is computed exactly, resident, streamed and from
a pack. The checkpoints are fixtures/tiny with some tensors re-stored (same names,
shards and layout; tests/ckpt_helpers.rewrite_checkpoint)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from libk3 import names
from libk3.engine.generate import GenSettings, generate
from libk3.engine.session import open_session
from libk3.errors import CheckpointError
from libk3.io import inventory
from libk3.io.checkpoint import Checkpoint
from libk3.io.dtypes import bf16_to_f32, f32_to_bf16, widen
from libk3.pack.writer import pack
from libk3.budget import ModelSizes, minimum_budget

from .ckpt_helpers import rewrite_checkpoint
from .scripts import k3_here
from .test_run_cli import _pack

IDS = [5, 17, 300, 42, 7, 99, 128, 3, 250, 11]
GEN = 4
ROUTER = "block_sparse_moe.gate.weight"


def _matrix_names(cfg) -> set:
    """Every tensor the forward pass hands to the dense kernels: trunk matrices, the
    embedding and lm_head."""
    out = {names.EMBED, names.LM_HEAD}
    for L in range(cfg.num_hidden_layers):
        out |= {s.name for s in inventory.layer_trunk(cfg, L) if s.kind == inventory.MATRIX}
    return out


def _restore(src, dst, pick, store):
    """Rewrite ``src`` into ``dst``, re-storing every BF16 tensor ``pick(name)`` selects
    as ``store(f32 values) -> (dtype, bytes)``."""
    def convert(name, dtype, shape, raw):
        if dtype != "BF16" or not pick(name):
            return None
        return store(widen(raw, dtype, shape))
    return rewrite_checkpoint(src, dst, convert)


def _sizes(model):
    with Checkpoint.open(model) as ckpt:
        return ModelSizes.from_checkpoint(ckpt)


def _logits(model, mode, tmp_path=None):
    """Greedy logits of IDS + GEN tokens, resident, streamed from the shards at the
    floor budget (ring and pins), or streamed from a fresh pack."""
    kw = {}
    if mode != "resident":
        floor = minimum_budget(_sizes(model))
        kw = dict(trunk_bytes=floor.trunk_bytes + 1, cache_bytes=floor.cache_bytes + 1)
    if mode == "pack":
        out = tmp_path / f"{model.name}.pack"
        with Checkpoint.open(model) as ckpt:
            pack(ckpt, out, progress=False)
        kw["pack"] = out
    s = open_session(model, **kw)
    try:
        res = generate(s.forward, s.new_state(), IDS, GenSettings(gen=GEN), keep_logits=True)
    finally:
        s.weights.close()
        s.ckpt.close()
    return res.logits


@pytest.fixture(scope="module")
def tiny_cfg(tiny_dir):
    with Checkpoint.open(tiny_dir) as ckpt:
        return ckpt.config


@pytest.fixture(scope="module")
def bf16_logits(tiny_dir):
    return _logits(tiny_dir, "resident")


@pytest.mark.parametrize("mode", ["resident", "streamed", "pack"])
def test_float_dtypes_f32_matrices_give_the_bf16_logits_bit_for_bit(
        mode, tiny_dir, tiny_cfg, bf16_logits, tmp_path):
    """Catches a reader that refuses F32 matrices, reads their 4-byte rows as pairs of
    BF16 (embedding rows, lm_head, any trunk matrix, MLA kv_b), or computes them in any
    other order than the BF16 path: every matrix re-stored as F32 holding the same values
    must give byte-identical logits."""
    matrices = _matrix_names(tiny_cfg)
    model = _restore(tiny_dir, tmp_path / "f32", matrices.__contains__,
                     lambda v: ("F32", v.astype("<f4").tobytes()))
    got = _logits(model, mode, tmp_path)
    assert got.view(np.uint32).tobytes() == bf16_logits.view(np.uint32).tobytes()
    with Checkpoint.open(model) as ckpt:                  # control: F32 really is stored
        assert {n for n in matrices if ckpt.entry(n).dtype == "F32"} == matrices


@pytest.mark.parametrize("mode", ["resident", "streamed"])
def test_float_dtypes_f16_matrices_are_widened_exactly(mode, tiny_dir, tiny_cfg, tmp_path):
    """Catches F16 bytes read as BF16 (or refused): every matrix stored as F16 computes
    exactly like the same values stored as BF16. Values F16 cannot hold exactly (below
    its normal range) are zeroed in both checkpoints."""
    matrices = _matrix_names(tiny_cfg)

    def f16_exact(v):
        keep = v.astype(np.float16).astype(np.float32) == v
        return np.where(keep, v, np.float32(0))

    bf16 = _restore(tiny_dir, tmp_path / "bf16z", matrices.__contains__,
                    lambda v: ("BF16", f32_to_bf16(f16_exact(v)).tobytes()))
    f16 = _restore(tiny_dir, tmp_path / "f16", matrices.__contains__,
                   lambda v: ("F16", f16_exact(v).astype("<f2").tobytes()))
    want = _logits(bf16, "resident")
    got = _logits(f16, mode, tmp_path)
    assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()
    bs, fs = _sizes(bf16), _sizes(f16)                    # the widened copy is budgeted
    assert all(f >= 2 * b for f, b in zip(fs.layer_bytes, bs.layer_bytes))
    assert fs.lm_head_bytes >= 2 * bs.lm_head_bytes


def _router_checkpoints(tiny_dir, tmp_path):
    """(F32 router, the same router rounded to BF16): every MoE layer's gate.weight made
    F32 with values a fraction of a BF16 step above the fixture's, so that rounding it
    to BF16 gives back exactly the fixture."""
    is_router = lambda n: n.endswith("." + ROUTER)  # noqa: E731

    def f32_router(v):
        bits = v.view(np.uint32) + np.uint32(1 << 12)       # 1/16 of a BF16 step
        return "F32", bits.view(np.float32).astype("<f4").tobytes()

    f32 = _restore(tiny_dir, tmp_path / "router_f32", is_router, f32_router)
    bf16 = rewrite_checkpoint(f32, tmp_path / "router_bf16", lambda n, dt, sh, raw: (
        "BF16", f32_to_bf16(widen(raw, dt, sh)).tobytes()) if is_router(n) else None)
    return f32, bf16


def test_float_dtypes_f32_router_runs_everywhere_and_matches_bf16_within_rounding(
        tiny_dir, tmp_path):
    """The issue's case: a router gate.weight stored F32 (as the public engine's test
    generator writes it) runs through k3-run resident, streamed and from a pack, with the
    same logits in all three; it matches the router rounded to BF16 within that rounding
    but not bit for bit (so the F32 values were used, not rounded on load)."""
    f32, bf16 = _router_checkpoints(tiny_dir, tmp_path)
    with Checkpoint.open(bf16) as ckpt, Checkpoint.open(tiny_dir) as fixture:
        for L in ckpt.config.moe_layers:                  # control: rounding gives the fixture
            name = names.layer(L, ROUTER)
            assert ckpt.read_raw(name).tobytes() == fixture.read_raw(name).tobytes()
    floor = minimum_budget(_sizes(f32))
    budget = ("--trunk-gb", f"{(floor.trunk_bytes + 1) / 1e9:.9f}",
              "--cache-gb", f"{(floor.cache_bytes + 1) / 1e9:.9f}")
    pack_dir = tmp_path / "router.pack"
    _pack(f32, pack_dir)
    runs = {"resident": (f32, "--resident"), "streamed": (f32, *budget),
            "pack": (f32, *budget, "--pack", pack_dir), "bf16": (bf16, "--resident")}
    logits, reports = {}, {}
    for key, (model, *flags) in runs.items():
        out, rep = tmp_path / f"{key}.npy", tmp_path / f"{key}.json"
        p = k3_here(model, "--ids", ",".join(map(str, IDS)), "--gen", GEN, *flags,
                    "--logits-out", out, "--report-json", rep)
        assert p.returncode == 0, (key, p.stderr)
        logits[key], reports[key] = np.load(out), json.loads(rep.read_text())
    for key in ("streamed", "pack"):
        assert logits[key].tobytes() == logits["resident"].tobytes(), key
    a, b = logits["resident"], logits["bf16"]
    assert a.tobytes() != b.tobytes()                     # the F32 values were used
    assert reports["resident"]["generated_ids"] == reports["bf16"]["generated_ids"]
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-2 * float(np.abs(b).max()))
    man = json.loads((pack_dir / "trunk.json").read_text())     # the pack keeps the dtype
    moe = next(lay for lay in man["layers"] if ROUTER in lay["tensors"])
    assert moe["tensors"][ROUTER]["dtype"] == "F32"


def test_float_dtypes_u8_matrix_is_refused_naming_the_tensor(tiny_dir, tiny_cfg, tmp_path):
    """Catches a loader that accepts any dtype for a matrix: a router stored as U8 (the
    same byte count as a BF16 one would need half the elements) is refused at open,
    naming the tensor; control: the same router as F32 opens."""
    L = tiny_cfg.moe_layers[0]
    name = names.layer(L, ROUTER)
    ok = _restore(tiny_dir, tmp_path / "ok", lambda n: n == name,
                  lambda v: ("F32", v.astype("<f4").tobytes()))
    Checkpoint.open(ok).close()
    bad = rewrite_checkpoint(tiny_dir, tmp_path / "bad", lambda n, dt, sh, raw: (
        "U8", raw[:int(np.prod(sh))].tobytes()) if n == name else None)
    with pytest.raises(CheckpointError, match="wrong shape or dtype") as e:
        Checkpoint.open(bad)
    assert e.value.tensor == name


def test_float_dtypes_bf16_rounding_helper_is_exact():
    """Control for the router test's construction: adding 1/16 of a BF16 step to a BF16
    value and rounding to nearest BF16 gives the value back."""
    bits = np.arange(0x3C00, 0x3D00, dtype=np.uint16)
    v = bf16_to_f32(bits)
    nudged = (v.view(np.uint32) + np.uint32(1 << 12)).view(np.float32)
    assert np.array_equal(f32_to_bf16(nudged), bits) and not np.array_equal(nudged, v)
