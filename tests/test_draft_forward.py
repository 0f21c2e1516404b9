"""The DSpark draft's numba forward (libk3/draft/forward.py) against the float64 reference
(libk3/draft/reference.py), the pitfalls of formats/model/dspark.md §8 each as a test, and the
draft-only kernels (rope_interleaved, silu_mul, logistic_unit) against numpy emulations of
formats/model/numerics.md sections 10 and 11.

The draft is small and random (hidden 64, 5 layers, 4 heads, vocabulary 300) with BF16
weights; no checkpoint file is read. Its YaRN rotation has mscale != mscale_all_dim, so the
cos/sin amplitude is not 1 and a kernel that drops it is seen.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import math

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libk3.draft import reference as ref
from libk3.draft.config import draft_config_from_dict
from libk3.draft.forward import DraftCache, DraftForward
from libk3.io.dtypes import bf16_to_f32, f32_to_bf16
from libk3.kernels import activations, logistic, rope as rope_kernel

PROPS = settings(max_examples=25, deadline=None)
seeds = st.integers(0, 2**32 - 1)
# model.md §7.4's whole-model bound at the draft's width 64: 1.2e-7 * sqrt(64) * 50
RTOL = 1.2e-7 * math.sqrt(64) * 50

PUBLISHED_ROPE = dict(rope_type="yarn", factor=32, original_max_position_embeddings=32768,
                      beta_fast=32, beta_slow=1, mscale=1, mscale_all_dim=1, rope_theta=50000)


def _doc(**over):
    """A small draft config (dspark.md §2.1 keys); ``over`` replaces keys."""
    doc = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=5,
               num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
               qk_rope_head_dim=8, v_head_dim=8, vocab_size=300, rms_norm_eps=1e-5,
               max_position_embeddings=1048576,
               rope_parameters=dict(PUBLISHED_ROPE, mscale=0.8),
               target_layer_ids=[1, 4, 6], target_hidden_size=64, target_num_hidden_layers=8,
               mask_token_id=297, markov_rank=8, enable_confidence_head=True,
               confidence_head_with_markov=True)
    doc.update(over)
    return doc


def _published_doc():
    return _doc(hidden_size=7168, intermediate_size=14336, num_attention_heads=64,
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128, vocab_size=163840, rope_parameters=dict(PUBLISHED_ROPE),
                target_layer_ids=[2, 23, 47, 71, 89], num_target_layers=5,
                target_hidden_size=7168, target_num_hidden_layers=93, mask_token_id=163837,
                markov_rank=256)


class Draft:
    """A random draft: BF16 bits for DraftForward, their float32 values for the reference."""

    def __init__(self, cfg, seed=0):
        rng = np.random.default_rng(seed)
        self.cfg = cfg
        self.bits, self.floats = {}, {}
        for name, shape in cfg.tensor_shapes().items():
            if name == "confidence_head.proj.weight":     # float32, as stored unrounded
                w = (rng.standard_normal(shape) * 0.3).astype(np.float32)
                self.bits[name] = self.floats[name] = w
                continue
            if name == "confidence_head.proj.bias":
                v = np.array([0.2], np.float32)
            elif len(shape) == 1:                          # norm weights
                v = 1.0 + 0.1 * rng.standard_normal(shape)
            elif name == "markov_head.markov_w1.weight":
                v = rng.standard_normal(shape)
            else:
                v = rng.standard_normal(shape) / math.sqrt(shape[1])
            b = f32_to_bf16(np.asarray(v, np.float32))
            self.floats[name] = bf16_to_f32(b)
            self.bits[name] = b if len(shape) == 2 else self.floats[name]
        V, E = cfg.vocab_size, cfg.hidden_size
        self.table = bf16_to_f32(f32_to_bf16(rng.standard_normal((V, E)).astype(np.float32)))
        self.lm_head = f32_to_bf16((rng.standard_normal((V, E)) / math.sqrt(E))
                                   .astype(np.float32))
        self.lm_head_f32 = bf16_to_f32(self.lm_head)
        self.taps = rng.standard_normal((40, cfg.n_taps * cfg.target_hidden_size)) \
            .astype(np.float32)

    def embed(self, ids):
        return self.table[np.asarray(ids)]

    def get(self, name):
        return self.floats[name]

    def forward(self, weights=None, embed=None, cfg=None):
        return DraftForward(cfg or self.cfg, self.bits if weights is None else weights,
                            embed or self.embed, self.lm_head)


@pytest.fixture(scope="module")
def draft():
    return Draft(draft_config_from_dict(_doc()))


def _rel(got, want):
    """max |got - want| over max |want|: the error relative to the array's scale."""
    want = np.asarray(want, np.float64)
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def _ingested(fw, taps, chunks=None):
    cache = fw.new_cache()
    for part in (np.split(taps, chunks) if chunks else [taps]):
        fw.ingest(cache, part)
    return cache


# --------------------------------------------------------- against the float64 reference

@pytest.mark.parametrize("p", [0, 1, 6, 23])
def test_draft_block_matches_the_float64_reference(draft, p):
    """Catches any departure from dspark.md §5.1-§5.3, §5.5 (a missed norm, a wrong slice,
    the wrong rows attended, a wrong position): the context rows and the block's
    final-normed rows after ``p`` ingested positions, against reference.py."""
    fw = draft.forward()
    cache = _ingested(fw, draft.taps[:p])
    want_rows = ref.ingest(draft.cfg, draft.get, draft.taps[:p], np.arange(p))
    assert cache.length == p and cache.rows().shape == want_rows.shape
    if p:
        assert _rel(cache.rows(), want_rows) < RTOL
    anchor = 17 + p
    got = fw.block(cache, anchor)
    ids = [anchor] + [draft.cfg.mask_token_id] * (draft.cfg.block_size - 1)
    want = ref.block(draft.cfg, draft.get, draft.embed(ids), p, want_rows)
    assert got.shape == (draft.cfg.block_size, draft.cfg.hidden_size) and got.dtype == np.float32
    assert _rel(got, want) < RTOL
    assert cache.length == p                                 # the block's rows are scratch


def test_draft_propose_matches_the_reference_markov_unroll(draft):
    """Catches a wrong Markov unroll (bias from the anchor for every row, W1/W2 swapped,
    prev not updated, the confidence from the wrong prev or the unnormed row): tokens,
    Markov-corrected and base logits and confidences of a greedy and a custom pick against
    reference.py. Control: the Markov bias moves the logits (it is not a no-op here)."""
    fw = draft.forward()
    p = 9
    cache = _ingested(fw, draft.taps[:p])
    rows = ref.ingest(draft.cfg, draft.get, draft.taps[:p], np.arange(p))
    second = lambda k, logits: int(np.argsort(logits, kind="stable")[-2])  # noqa: E731
    for n, pick in ((draft.cfg.block_size, None), (4, second)):
        got = fw.propose(cache, 5, n, pick)
        tokens, base, logits, conf = ref.propose(draft.cfg, draft.get, draft.embed,
                                                 draft.lm_head_f32, rows, 5, n, pick)
        srt = np.sort(logits, axis=1)
        rank = -1 if pick is None else -2            # the picked value's gap to its rivals
        gap = np.minimum(srt[:, rank] - srt[:, rank - 1],
                         np.inf if rank == -1 else srt[:, -1] - srt[:, -2])
        assert np.all(gap > 1e-3), "margins too small to compare picks at float32"
        assert np.array_equal(got.tokens, tokens)
        assert got.logits.dtype == np.float32 and got.logits.shape == (n, draft.cfg.vocab_size)
        assert _rel(got.base, base) < RTOL and _rel(got.logits, logits) < RTOL
        assert got.confidence.dtype == np.float64
        assert np.max(np.abs(got.confidence - conf)) < 1e-5
        assert _rel(logits - base, base) > 0.1                # control: Markov matters


@pytest.mark.parametrize("with_markov,enabled", [(False, True), (True, False)])
def test_draft_confidence_head_variants_match_the_reference(with_markov, enabled):
    """Catches a confidence head that reads W1 when the config says it does not, or that
    reports anything but 1.0 without a head (dspark.md §3.1)."""
    d = Draft(draft_config_from_dict(_doc(confidence_head_with_markov=with_markov,
                                          enable_confidence_head=enabled)), seed=3)
    fw = d.forward()
    cache = _ingested(fw, d.taps[:4])
    rows = ref.ingest(d.cfg, d.get, d.taps[:4], np.arange(4))
    got = fw.propose(cache, 8, 3)
    want = ref.propose(d.cfg, d.get, d.embed, d.lm_head_f32, rows, 8, 3)[3]
    assert np.max(np.abs(got.confidence - want)) < 1e-5
    if not enabled:
        assert np.all(got.confidence == 1.0)


# ------------------------------------------------------------- dspark.md §8, one by one

def test_draft_rope_is_interleaved_not_half_split():
    """Catches the half-split rotation (dspark.md §8 item 2): the kernel at the published
    frequencies equals a float64 interleaved rotation to 1e-6 of each pair's length and is
    far from the half-split one on the same input."""
    cfg = draft_config_from_dict(_published_doc())
    inv_freq = np.asarray(cfg.rope_inv_freq())
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3, 64)).astype(np.float32)
    pos = np.array([0, 1, 77, 40_000, 1_000_000], np.int64)
    out = np.empty_like(x)
    rope_kernel.rope_interleaved(x, pos, inv_freq, cfg.rope_amplitude(), out)
    ang = pos[:, None, None] * inv_freq[None, None, :]            # (T, 1, half)
    a, b = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    inter = np.stack([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)],
                     axis=-1).reshape(x.shape)
    length = np.repeat(np.hypot(a, b), 2, axis=-1)
    assert np.all(np.abs(out - inter) <= 1e-6 * length)
    lo, hi = x[..., :32].astype(np.float64), x[..., 32:].astype(np.float64)
    half = np.concatenate([lo * np.cos(ang) - hi * np.sin(ang),
                           hi * np.cos(ang) + lo * np.sin(ang)], axis=-1)
    assert _rel(out[1:], half[1:]) > 0.1                  # position 0 turns nothing


def test_draft_softmax_scale_and_yarn_frequencies_of_the_published_config():
    """Catches the scale without YaRN's squared mscale (dspark.md §8 item 3) and a wrong
    YaRN ramp (low 15, high 26, dspark.md §5.4)."""
    cfg = draft_config_from_dict(_published_doc())
    want = 192 ** -0.5 * (0.1 * math.log(32) + 1) ** 2
    assert abs(cfg.softmax_scale() - want) < 1e-9
    assert abs(cfg.softmax_scale() - 0.13086080) < 1e-8
    w = cfg.rope_inv_freq()
    e = [50000 ** (-2 * i / 64) for i in range(32)]
    assert len(w) == 32 and w[0] == 1.0
    assert abs(w[31] / 8.7644e-7 - 1) < 1e-4
    assert all(w[i] == e[i] for i in range(16))               # i <= low: extrapolated
    assert all(abs(w[i] / (e[i] / 32) - 1) < 1e-12 for i in range(26, 32))  # i >= high
    assert all(e[i] / 32 < w[i] < e[i] for i in range(16, 26))            # the ramp
    assert cfg.rope_amplitude() == 1.0


def test_draft_block_attention_is_not_causal(draft):
    """Catches causal attention inside the block (dspark.md §8 item 6): row 0 changes when
    only the block's last input row does (another embedding row, or another mask id).
    Control: the same inputs again give row 0 bit for bit."""
    fw = draft.forward()
    cache = _ingested(fw, draft.taps[:5])
    row0 = fw.block(cache, 11)[0]
    assert np.array_equal(_bits(fw.block(cache, 11)[0]), _bits(row0))      # control

    def last_row_moved(ids):
        e = draft.embed(ids).copy()
        e[-1] += 0.5
        return e
    moved = draft.forward(embed=last_row_moved).block(cache, 11)[0]
    assert _rel(moved, row0) > 1e-3
    other_mask = dataclasses.replace(draft.cfg, mask_token_id=296)
    assert _rel(draft.forward(cfg=other_mask).block(cache, 11)[0], row0) > 1e-3


def test_draft_ingest_in_chunks_equals_ingest_at_once(draft):
    """Catches positions restarting per call or rows depending on their neighbours
    (dspark.md §5.1): one position at a time, uneven chunks and all at once give the same
    cache bits, and the same block after them. Control: a cache of other taps differs."""
    fw = draft.forward()
    taps = draft.taps[:17]
    whole = _ingested(fw, taps)
    for chunks in (list(range(1, 17)), [3, 4, 11]):
        parts = _ingested(fw, taps, chunks)
        assert parts.length == whole.length
        assert np.array_equal(_bits(parts.rows()), _bits(whole.rows()))
        assert np.array_equal(_bits(fw.block(parts, 3)), _bits(fw.block(whole, 3)))
    other = _ingested(fw, np.roll(taps, 1, axis=0))
    assert not np.array_equal(_bits(other.rows()), _bits(whole.rows()))


def test_draft_block_leaves_the_committed_context_alone(draft):
    """Catches a block that writes its scratch rows over committed ones or moves
    ``length``: the cache after a block (and a copy taken before it) ingests on to the
    same bits as one that never ran a block."""
    fw = draft.forward()
    cache = _ingested(fw, draft.taps[:6])
    snap = cache.copy()
    fw.block(cache, 4)
    assert cache.length == 6 and np.array_equal(_bits(cache.rows()), _bits(snap.rows()))
    fw.ingest(cache, draft.taps[6:9])
    fw.ingest(snap, draft.taps[6:9])
    fresh = _ingested(fw, draft.taps[:9])
    for c in (cache, snap):
        assert np.array_equal(_bits(c.rows()), _bits(fresh.rows()))


def test_draft_without_markov_proposals_are_the_parallel_argmax(draft):
    """Catches a dropped or shifted row 0 (dspark.md §8 item 4: the anchor's row is the
    first proposal): with W2 = 0 the unrolled proposals are the argmax of each block row's
    base logits. Control: with the real W2 they are not."""
    fw = draft.forward()
    cache = _ingested(fw, draft.taps[:8])
    B = draft.cfg.block_size
    parallel = np.argmax(fw.base_logits(fw.block(cache, 2)), axis=1)
    flat = dict(draft.bits)
    flat["markov_head.markov_w2.weight"] = np.zeros_like(flat["markov_head.markov_w2.weight"])
    got = draft.forward(weights=flat).propose(cache, 2, B)
    assert np.array_equal(got.tokens, parallel)
    assert np.array_equal(_bits(got.logits), _bits(got.base))
    assert not np.array_equal(fw.propose(cache, 2, B).tokens, parallel)      # control


def test_draft_block_does_not_depend_on_thread_count():
    """Catches a sum split across threads in any op of the pass: a block (large enough
    for the matmuls, the attention and the MLP product to run in parallel) and its
    proposals are bit-identical at 1 and 2 numba threads."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has fewer than 2 threads here")
    d = Draft(draft_config_from_dict(_doc(hidden_size=256, target_hidden_size=256,
                                          intermediate_size=768, num_attention_heads=8,
                                          kv_lora_rank=64)), seed=7)
    fw = d.forward()
    before = numba.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            numba.set_num_threads(n)
            cache = _ingested(fw, d.taps)
            prop = fw.propose(cache, 1, d.cfg.block_size)
            outs.append((cache.rows(), fw.block(cache, 1), prop.logits, prop.confidence))
    finally:
        numba.set_num_threads(before)
    for one, two in zip(*outs):
        assert np.array_equal(np.ascontiguousarray(one).view(np.uint8),
                              np.ascontiguousarray(two).view(np.uint8))


def test_draft_forward_refuses_missing_and_misshapen_weights(draft):
    """Catches weights taken on trust: a missing tensor, a wrong shape and a float64
    matrix are each named in one error. Control: the full set is accepted."""
    draft.forward()
    bad = dict(draft.bits)
    del bad["layers.2.mlp.up_proj.weight"]
    bad["final_norm.weight"] = bad["final_norm.weight"][:-1]
    bad["context_proj.weight"] = draft.floats["context_proj.weight"].astype(np.float64)
    with pytest.raises(ValueError) as e:
        draft.forward(weights=bad)
    for name in ("layers.2.mlp.up_proj.weight", "final_norm.weight", "context_proj.weight"):
        assert name in str(e.value)
    fw = draft.forward()
    with pytest.raises(ValueError, match="anchor"):
        fw.block(fw.new_cache(), -1)


# ------------------------------------------------- the draft-only kernels, bit for bit

def _libm():
    lib = ctypes.CDLL(ctypes.util.find_library("m"))
    lib.expf.restype, lib.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    return lib


def _rope_emulated(x, pos, inv_freq, amp):
    """formats/model/numerics.md section 10 in numpy: f64 angle, libm cos/sin, one rounding each
    for c and s, then f32 products and sums."""
    T, H, D = x.shape
    c = np.empty((T, D // 2), np.float32)
    s = np.empty((T, D // 2), np.float32)
    for t in range(T):
        for i in range(D // 2):
            angle = float(pos[t]) * float(inv_freq[i])
            c[t, i] = np.float32(math.cos(angle) * amp)
            s[t, i] = np.float32(math.sin(angle) * amp)
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = c[:, None, :], s[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = (a * c).astype(np.float32) - (b * s).astype(np.float32)
    out[..., 1::2] = (a * s).astype(np.float32) + (b * c).astype(np.float32)
    return out


@PROPS
@given(seeds, st.integers(1, 6), st.integers(1, 5), st.sampled_from([2, 8, 64]),
       st.sampled_from([1.0, 0.8, 1.25]))
def test_rope_kernel_matches_its_documented_roundings(seed, T, H, D, amp):
    """Catches an f32 angle or cos/sin, the amplitude applied after rounding, a fused
    multiply-add, half-split pairs, or frequencies indexed by 2i: the kernel equals the
    numerics.md section 10 emulation bit for bit and a float64 rotation to 1e-6 of each
    pair's length; a T-row call equals T one-row calls, and out may be x."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    pos = rng.integers(0, 2_000_000, T).astype(np.int64)
    inv_freq = 50000.0 ** (-np.arange(0, D, 2) / D) * rng.uniform(0.5, 1.0, D // 2)
    out = np.empty_like(x)
    rope_kernel.rope_interleaved(x, pos, inv_freq, amp, out)
    assert np.array_equal(_bits(out), _bits(_rope_emulated(x, pos, inv_freq, amp)))
    ang = pos[:, None, None] * inv_freq
    a, b = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    want = np.stack([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)],
                    axis=-1).reshape(x.shape) * amp
    assert np.all(np.abs(out - want) <= 1e-6 * amp * np.repeat(np.hypot(a, b), 2, axis=-1))
    for t in range(T):
        one = np.empty_like(x[t:t + 1])
        rope_kernel.rope_interleaved(x[t:t + 1].copy(), pos[t:t + 1], inv_freq, amp, one)
        assert np.array_equal(_bits(one[0]), _bits(out[t]))
    inplace = x.copy()
    rope_kernel.rope_interleaved(inplace, pos, inv_freq, amp, inplace)
    assert np.array_equal(_bits(inplace), _bits(out))


@PROPS
@given(seeds, st.integers(1, 300), st.sampled_from([1.0, 8.0, 60.0]))
def test_silu_mul_matches_its_documented_roundings(seed, n, spread):
    """Catches gate and up swapped, a float64 SiLU, numpy's vectorised expf, or SiTU's
    caps: silu_mul equals f32(f32(g * f32(1 / (1 + expf(-g)))) * u) bit for bit (libm
    expf through ctypes) and the float64 formula to 1e-6 relative (overflowing expf
    included: g < -88.7 gives -0.0 or +0.0, not NaN)."""
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * spread).astype(np.float32)
    u = (rng.standard_normal(n) * spread).astype(np.float32)
    out = np.empty(n, np.float32)
    activations.silu_mul(g, u, out)
    lib, one = _libm(), np.float32(1.0)
    sig = np.array([one / (one + np.float32(lib.expf(-float(v)))) for v in g], np.float32)
    want_bits = ((g * sig).astype(np.float32) * u).astype(np.float32)
    assert np.array_equal(_bits(out), _bits(want_bits))
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    want = g64 / (1.0 + np.exp(-g64)) * u64
    assert np.all(np.abs(out - want) <= 1e-6 * np.abs(want) + 1e-30)
    assert not np.isnan(out).any()


@PROPS
@given(seeds, st.integers(1, 80), st.sampled_from(["f32", "bf16"]))
def test_logistic_unit_is_one_f64_dot_then_the_f64_sigmoid(seed, n, kind):
    """Catches a float32 sum or sigmoid, or a sum in another order: logistic_unit equals
    1 / (1 + exp(-(S + b))) with S the numerics.md section 2 order over all n products,
    bit for bit; a bias far below zero gives 0.0, not an error."""
    rng = np.random.default_rng(seed)
    w32 = (rng.standard_normal(n) * 0.5).astype(np.float32)
    w = f32_to_bf16(w32) if kind == "bf16" else w32
    wf = bf16_to_f32(w) if kind == "bf16" else w32
    x = rng.standard_normal(n).astype(np.float32)
    prod = wf.astype(np.float64) * x.astype(np.float64)
    n16 = n - n % 16
    acc = np.zeros(16)
    for i in range(0, n16, 16):
        acc = acc + prod[i:i + 16]
    b = [(acc[j] + acc[j + 4]) + (acc[j + 8] + acc[j + 12]) for j in range(4)]
    s = (b[0] + b[1]) + (b[2] + b[3])
    for i in range(n16, n):
        s += prod[i]
    bias = float(rng.standard_normal())
    assert logistic.logistic_unit(w, x, bias) == 1.0 / (1.0 + math.exp(-(s + bias)))
    assert logistic.logistic_unit(w, x, -1e6) == 0.0


def test_draft_kernels_leave_the_team_as_they_found_it():
    """Catches a draft kernel that narrows the team for a small call and never widens it."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has fewer than 2 threads here")
    x = np.ones((1, 1, 2), np.float32)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        rope_kernel.rope_interleaved(x, np.zeros(1, np.int64), np.ones(1), 1.0, x.copy())
        assert numba.get_num_threads() == 2
        activations.silu_mul(x.reshape(-1), x.reshape(-1), np.empty(2, np.float32))
        assert numba.get_num_threads() == 2
    finally:
        numba.set_num_threads(before)


def test_draft_cache_grows_by_doubling_and_copies_independently():
    """Catches a reserve that drops committed rows when it grows, or a copy that shares
    its arrays with the original."""
    cfg = draft_config_from_dict(_doc())
    cache = DraftCache(cfg, capacity=2)
    cache.latent[:, :2] = 1.0
    cache.length = 2
    cache.reserve(3)
    assert cache.latent.shape[1] == 5 and np.all(cache.latent[:, :2] == 1.0)
    cache.reserve(1)
    assert cache.latent.shape[1] == 5
    twin = cache.copy()
    twin.latent[:, 0] = 7.0
    assert np.all(cache.latent[:, 0] == 1.0) and twin.length == 2
