"""The image tower, merger and projector on the numba kernels against the float64
reference (formats/model/vision.md §5-§7): fixtures/tiny's tower and the small synthetic
preset, odd and smallest grids, thread counts, misshapen tensors, and the pieces (position
table resize, rotary angles, merge order, GELUs, attention) on their own."""

from __future__ import annotations

import ctypes
import math

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libk3 import names
from libk3.errors import CheckpointError
from libk3.io.checkpoint import Checkpoint
from libk3.io.dtypes import bf16_to_f32
from libk3.kernels import activations, vit
from libk3.model import vision_reference as ref
from libk3.model.vision import (VisionTower, merge, read_vision_tensors, resize_table,
                                rope_tables)

from .test_kernels_props import _bits, _libm, _order16

# Max |engine - reference| / max |reference| allowed for the tower rows and the projected
# rows (formats/model/vision.md §7.3; the measured errors: bench/README.md, "Vision tower").
REL_BOUND = 4e-6


def _load(model_dir):
    with Checkpoint.open(model_dir) as ck:
        return ck.vision_config, read_vision_tensors(ck)


@pytest.fixture(scope="module")
def tiny_tower(tiny_dir):
    vcfg, tensors = _load(tiny_dir)
    return VisionTower(vcfg, tensors), tensors


@pytest.fixture(scope="module")
def small_tower(small_dir):
    vcfg, tensors = _load(small_dir)
    return VisionTower(vcfg, tensors), tensors


def _getter(tensors):
    def get(name):
        a = tensors[name]
        return (bf16_to_f32(a) if a.dtype == np.uint16 else a).astype(np.float64)
    return get


def _patches(grid, p, seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, (grid[0] * grid[1], 3, p, p)).astype(np.float32)


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def _compare(tower, tensors, grid, seed=0):
    vcfg = tower.vcfg
    patches = _patches(grid, vcfg.patch_size, seed)
    got = tower.encode(patches, grid)
    t, merged, rows = ref.encode(vcfg, _getter(tensors), patches, grid)
    assert got.tower.shape == t.shape and got.rows.shape == rows.shape
    assert got.rows.shape[1] == vcfg.text_hidden_size
    return _rel(got.tower, t), _rel(got.merged, merged), _rel(got.rows, rows)


@pytest.mark.parametrize("grid", [(2, 2), (2, 6), (6, 2), (4, 10)])
def test_tiny_tower_matches_float64_reference(tiny_tower, grid):
    """Catches any misreading the engine and the reference do not share (rotary pairing,
    resize, merge order, a GELU swap, an eps): the smallest grid and non-square ones,
    tower and projected rows within REL_BOUND of the float64 evaluation."""
    errs = _compare(*tiny_tower, grid)
    assert max(errs) < REL_BOUND, errs


@pytest.mark.parametrize("grid", [(2, 2), (4, 6), (10, 8)])
def test_small_preset_tower_matches_float64_reference(small_tower, grid):
    """The same on the small preset (four heads of 36, a 11 x 15 table, three blocks)."""
    errs = _compare(*small_tower, grid)
    assert max(errs) < REL_BOUND, errs


@settings(max_examples=12, deadline=None)
@given(gh=st.integers(1, 6), gw=st.integers(1, 6), seed=st.integers(0, 2 ** 16))
def test_tiny_tower_any_grid(tiny_tower, gh, gw, seed):
    """Every even grid up to 12 x 12 patches (a grid is always a multiple of the merge)."""
    errs = _compare(*tiny_tower, (2 * gh, 2 * gw), seed)
    assert max(errs) < REL_BOUND, errs


def test_reference_comparison_sees_a_swapped_rotary_order(tiny_tower, monkeypatch):
    """Catches a comparison too loose to matter: the reference with the row and column
    angles swapped (the release's docstring's reading, vision.md §5.3) is far outside
    REL_BOUND on a non-square grid, and so is one with the projector's GELU in the MLP."""
    original = ref.rope_angles

    def swapped(gh, gw, hd):
        a = original(gh, gw, hd)
        out = a.copy()
        out[:, 0::2], out[:, 1::2] = a[:, 1::2], a[:, 0::2]
        return out
    monkeypatch.setattr(ref, "rope_angles", swapped)
    assert _compare(*tiny_tower, (2, 6))[0] > 50 * REL_BOUND
    monkeypatch.setattr(ref, "rope_angles", original)
    monkeypatch.setattr(ref, "gelu_tanh", ref.gelu_erf)
    assert _compare(*tiny_tower, (2, 6))[0] > 20 * REL_BOUND


def test_tower_rows_identical_at_one_and_two_threads(small_tower):
    """Catches a sum split across threads in any kernel of the tower: the rows of a
    grid large enough for every kernel to run in parallel are the same bytes."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has fewer than 2 threads here")
    tower, _ = small_tower
    grid = (10, 12)
    patches = _patches(grid, tower.vcfg.patch_size, 3)
    before = numba.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            numba.set_num_threads(n)
            r = tower.encode(patches, grid)
            outs.append((r.tower, r.merged, r.rows))
    finally:
        numba.set_num_threads(before)
    for one, two in zip(*outs):
        assert one.tobytes() == two.tobytes()


@pytest.mark.parametrize("victim,edit", [
    (names.vision_block(1, "wqkv.weight"), lambda a: np.ascontiguousarray(a.T)),
    (names.PROJECTOR_PROJ2, lambda a: a[:-1]),
    (names.VISION_POS_EMB, lambda a: np.ascontiguousarray(a.transpose(1, 0, 2))),
    (names.VISION_FINAL_NORM, None),
])
def test_misshapen_or_missing_tensor_refused_naming_it(tiny_tower, victim, edit):
    """Catches a tower that runs on a transposed, cut or missing tensor: a one-line
    CheckpointError naming the tensor (exit code 3)."""
    tower, tensors = tiny_tower
    bad = dict(tensors)
    if edit is None:
        del bad[victim]
    else:
        bad[victim] = edit(bad[victim])
    with pytest.raises(CheckpointError) as e:
        VisionTower(tower.vcfg, bad)
    line = e.value.one_line()
    assert victim in line and "\n" not in line and e.value.exit_code == 3


def test_patches_must_fill_the_grid(tiny_tower):
    tower, _ = tiny_tower
    with pytest.raises(ValueError, match="do not fill grid"):
        tower.tower(_patches((2, 4), tower.vcfg.patch_size), (4, 4))
    with pytest.raises(ValueError, match="multiple of the merge"):
        tower.tower(_patches((3, 4), tower.vcfg.patch_size), (3, 4))


@given(n_in=st.integers(1, 70), n_out=st.integers(1, 80))
@settings(max_examples=40, deadline=None)
def test_resize_table_matches_reference_loop(n_in, n_out):
    """The vectorised bilinear resize equals the reference's cell-by-cell loop (rounded
    to float32), and returns the table itself at its own size."""
    rng = np.random.default_rng(n_in * 100 + n_out)
    table = rng.normal(size=(n_in, n_in + 1, 3)).astype(np.float32)
    got = resize_table(table, n_out, n_out + 2)
    want = ref.resize_table(table.astype(np.float64), n_out, n_out + 2)
    assert np.array_equal(got, want.reshape(got.shape).astype(np.float32))
    same = resize_table(table, n_in, n_in + 1)
    assert np.array_equal(same, table.reshape(-1, 3))


def test_rope_tables_are_the_reference_angles():
    """cos and sin are of the same float32 angles the reference computes, width first:
    pair 0 of patch (y, x) = (0, 1) turns, pair 1 does not (vision.md §5.3)."""
    for gh, gw, hd in [(2, 2, 24), (4, 6, 36), (6, 4, 128)]:
        cos, sin = rope_tables(gh, gw, hd)
        ang = ref.rope_angles(gh, gw, hd)
        assert np.array_equal(cos, np.cos(ang).astype(np.float32))
        assert np.array_equal(sin, np.sin(ang).astype(np.float32))
    cos, sin = rope_tables(2, 2, 8)
    assert sin[1, 0] == np.float32(math.sin(1.0)) and sin[1, 1] == 0.0
    assert sin[2, 0] == 0.0 and sin[2, 1] == np.float32(math.sin(1.0))


def test_merge_order():
    """Blocks row-major, inside a block (0,0), (0,1), (1,0), (1,1) (vision.md §6.1)."""
    gh, gw = 4, 6
    t = np.arange(gh * gw, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    m = merge(t, (gh, gw), 2)
    assert m.shape == (6, 8)
    assert list(m[4, 0::2]) == [14, 15, 20, 21]        # block (1, 1): rows 2-3, cols 2-3
    assert np.array_equal(m, ref.merge(t.astype(np.float64), (gh, gw), 2))


def test_gelu_kernels_against_float64():
    """Each GELU within a few float32 ulps of its float64 formula, and each far from the
    other where they differ most (|u| about 2.7)."""
    u = np.linspace(-6, 6, 4001).astype(np.float32)
    tanh_, erf_ = np.empty_like(u), np.empty_like(u)
    activations.gelu_tanh(u, tanh_)
    activations.gelu_erf(u, erf_)
    scale = np.maximum(np.abs(u), 1e-3)
    assert np.abs(tanh_ - ref.gelu_tanh(u.astype(np.float64))).max() < 4e-7 * scale.max()
    assert np.abs(erf_ - ref.gelu_erf(u.astype(np.float64))).max() < 4e-7 * scale.max()
    assert np.abs(tanh_ - erf_).max() > 4e-4


@pytest.mark.parametrize("L", [1, 5, 7, 13])
def test_attention_kernel_against_float64(L):
    """Bidirectional (the first query sees the last key) at lengths that leave a short
    last block of queries; within float32 rounding of the float64 softmax mix."""
    rng = np.random.default_rng(L)
    H, hd = 3, 20
    q, k, v = (rng.normal(size=(H, L, hd)).astype(np.float32) for _ in range(3))
    out = np.empty((L, H * hd), np.float32)
    vit.attention(q, k, v, 1 / math.sqrt(hd), out)
    s = np.einsum("hld,hsd->hls", q.astype(np.float64), k.astype(np.float64)) / math.sqrt(hd)
    p = np.exp(s - s.max(axis=2, keepdims=True))
    p /= p.sum(axis=2, keepdims=True)
    want = np.einsum("hls,hsd->lhd", p, v.astype(np.float64)).reshape(L, H * hd)
    assert np.abs(out - want).max() < 1e-5 * np.abs(want).max()


def _libm_f32(name):
    lib = _libm()
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return lambda a: np.array([fn(float(v)) for v in np.ravel(a)], np.float32).reshape(np.shape(a))


def test_gelus_are_the_documented_float32_order():
    """Catches a float64 or numpy-vectorised GELU, or another operation order: both
    equal the C library's tanhf / erff evaluation of formats/model/vision.md §7.2 bit for bit."""
    tanhf, erff = _libm_f32("tanhf"), _libm_f32("erff")
    rng = np.random.default_rng(5)
    u = (rng.standard_normal(2000) * 10.0 ** rng.uniform(-2, 1, 2000)).astype(np.float32)
    f = np.float32
    inner = f(math.sqrt(2 / math.pi)) * (u + f(0.044715) * ((u * u) * u))
    want_tanh = (f(0.5) * u) * (f(1) + tanhf(inner))
    want_erf = (f(0.5) * u) * (f(1) + erff(u * f(1 / math.sqrt(2))))
    got = np.empty_like(u)
    activations.gelu_tanh(u, got)
    assert np.array_equal(_bits(got), _bits(want_tanh))
    activations.gelu_erf(u, got)
    assert np.array_equal(_bits(got), _bits(want_erf))


def test_split_heads_and_attention_are_the_documented_order():
    """Catches another rounding or summation order in the rotation, the scores, the
    softmax or the mix (formats/model/vision.md §7.2): bit for bit against a numpy emulation."""
    expf = _libm_f32("expf")
    rng = np.random.default_rng(9)
    H, L, hd = 2, 9, 20
    qkv = rng.normal(size=(L, 3 * H * hd)).astype(np.float32)
    cos, sin = rope_tables(3, 3, hd)
    q, k, v = (np.empty((H, L, hd), np.float32) for _ in range(3))
    vit.split_heads(qkv, 0, cos, sin, True, q)
    vit.split_heads(qkv, 1, cos, sin, True, k)
    vit.split_heads(qkv, 2, cos, sin, False, v)
    part = qkv[:, H * hd:2 * H * hd].reshape(L, H, hd).transpose(1, 0, 2)
    a, b = part[..., 0::2], part[..., 1::2]
    want_k = np.empty_like(k)
    want_k[..., 0::2] = a * cos[None] - b * sin[None]
    want_k[..., 1::2] = a * sin[None] + b * cos[None]
    assert np.array_equal(_bits(k), _bits(want_k))
    assert np.array_equal(v, qkv[:, 2 * H * hd:].reshape(L, H, hd).transpose(1, 0, 2))
    scale = 1 / math.sqrt(hd)
    out = np.empty((L, H * hd), np.float32)
    vit.attention(q, k, v, scale, out)
    for h in range(H):
        prod = q[h].astype(np.float64)[:, None, :] * k[h].astype(np.float64)[None, :, :]
        s = _order16(prod).astype(np.float32) * np.float32(scale)       # (L, L)
        e = expf(s - s.max(axis=1, keepdims=True))
        z = np.zeros(L)
        for j in range(L):
            z = z + e[:, j].astype(np.float64)
        p = (e.astype(np.float64) / z[:, None]).astype(np.float32)
        mix = np.zeros((L, hd))
        for j in range(L):
            mix = mix + p[:, j:j + 1].astype(np.float64) * v[h, j].astype(np.float64)[None]
        assert np.array_equal(_bits(out[:, h * hd:(h + 1) * hd]), _bits(mix.astype(np.float32)))
