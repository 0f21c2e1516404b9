"""The numba kernels against the public engine's per-op vectors and the released MXFP4 bytes.

Every conformance vector (tests/conformance.py) that is one op is recomputed with
``libk3.kernels`` alone, and the KDA layer vectors with the engine's own ``Forward._kda``;
float32 weights go through the f32 path of the dense kernels. Each is checked
element-wise within the manifest tolerance; each test puts its worst element, as a
fraction of tolerance, in its assertion message, its ``record_property`` and its
captured stdout (``pytest -rP`` shows them; README section 2 lists the baselines).
layer_kda.json / layer_mla.json (whole decoder layers) are left to the model tests.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from libk3.io import mxfp4 as io_mxfp4
from libk3.kernels import activations, attnres, bf16, kda, mla, moe, mxfp4, norms, router
from libk3.model.forward import Forward

from .conformance import load, require, worst_fraction


def _within(record_property, name, got, want):
    frac = worst_fraction(got, want)
    record_property(name, frac)
    print(f"{name}: worst element {frac:.4f}x tolerance")
    assert frac <= 1.0, f"{name}: worst element {frac:.3f}x tolerance"
    return frac


def _mm(W, X):
    """Rows of X times W^T through the kernel (f32 weights), as a new [T, O] array."""
    Y = np.empty((X.shape[0], W.shape[0]), dtype=np.float32)
    bf16.matmul(np.ascontiguousarray(W), np.ascontiguousarray(X), Y)
    return Y


def _c(a):
    return np.ascontiguousarray(a, dtype=np.float32)


# ----------------------------------------------------------------------------- norms, SiTU

def test_kernels_rmsnorm_eps_inside_root_and_mean(record_property):
    """Catches eps outside the root, sum instead of mean, a missing gain."""
    d = load("rmsnorm.json")
    out = np.empty_like(d["in"])
    norms.rmsnorm(d["in"], d["weight"], d["eps"], out)
    _within(record_property, "rmsnorm", out, d["out"])


def test_kernels_situ_caps_saturate_with_sigmoid_on_uncapped_gate(record_property):
    """Catches caps omitted, sigmoid of the capped gate, gate/up swapped, |out| > 100."""
    d = load("situ_glu.json")
    n = d["in"].shape[1] // 2
    gate = _c(d["in"][:, :n]).reshape(-1)
    up = _c(d["in"][:, n:]).reshape(-1)
    out = np.empty_like(gate)
    activations.situ(gate, up, d["beta"], d["linear_beta"], out)
    _within(record_property, "situ_glu", out.reshape(-1, n), d["out"])
    assert np.abs(out).max() <= d["beta"] * d["linear_beta"] + 0.01


# ----------------------------------------------------------------------------- KDA pieces

def _conv_w(w):
    return _c(w[:, 0, :])


def test_kernels_shortconv_history_is_pre_activation_inputs(record_property):
    """Catches reversed taps, SiLU on the inputs, outputs stored as history, and a kernel
    that writes its history but ignores the incoming one (the continuation check)."""
    d = load("shortconv.json")
    w = _conv_w(d["weight"])
    hist = np.zeros((d["channels"], d["kernel"] - 1), dtype=np.float32)
    out = np.empty_like(d["in"][0])
    kda.short_conv(d["in"][0], w, hist, out)
    _within(record_property, "shortconv", out, d["out"][0])
    _within(record_property, "shortconv_state_after", hist, d["state_after"][0])
    nxt = np.empty_like(d["in_next"][0])
    kda.short_conv(d["in_next"][0], w, hist, nxt)
    _within(record_property, "shortconv_continuation", nxt, d["out_next"][0])


def test_kernels_shortconv_continuation_control_zero_history_differs():
    """Control for the continuation check: the same step from a ZERO history must miss
    out_next, or that check could not see an ignored history."""
    d = load("shortconv.json")
    hist = np.zeros((d["channels"], d["kernel"] - 1), dtype=np.float32)
    nxt = np.empty_like(d["in_next"][0])
    kda.short_conv(d["in_next"][0], _conv_w(d["weight"]), hist, nxt)
    assert worst_fraction(nxt, d["out_next"][0]) > 1.0


def test_kernels_kda_decay_a_log_per_head(record_property):
    """Catches A_log indexed per channel, a missing dt_bias, the softplus decay form."""
    d = load("kda_decay.json")
    z = d["z"][0]
    g = np.empty_like(z)
    alpha = np.empty_like(z)
    kda.kda_decay(z, d["A_log"], d["dt_bias"], d["lower_bound"], g, alpha)
    dg = float(np.abs(g.reshape(d["g"].shape) - d["g"]).max())
    da = float(np.abs(alpha.reshape(d["alpha"].shape) - d["alpha"]).max())
    record_property("kda_decay_abs_g", dg)
    record_property("kda_decay_abs_alpha", da)
    print(f"kda_decay: max |dg| {dg:.2e}, max |dalpha| {da:.2e} (limit 1e-5)")
    assert dg <= 1e-5 and da <= 1e-5, (dg, da)


@pytest.mark.parametrize("name", ["kda_recur1.json", "kda_recur8.json"])
def test_kernels_kda_recurrence_decay_read_write_output_order(record_property, name):
    """Catches any other order of decay/read/write/output, output before the write, a
    transposed state, beta per channel, alpha on the value axis."""
    d = load(name)
    S = np.zeros((d["H"], d["d_k"], d["d_v"]), dtype=np.float32)
    out = np.empty_like(d["v"])
    kda.kda_recurrence(d["q"], d["k"], d["v"], d["alpha"], d["beta"], d["q_scale"], S, out)
    _within(record_property, name + ":out", out, d["out"])
    _within(record_property, name + ":state", S, d["state_out"])


def _kda_layer(d):
    """model.md §5.5's KDA layer as the engine composes it: ``Forward._kda`` itself, driven by
    the vector's f32 weights (x already normalised), from a zero state."""
    H, D, K = d["H"], d["d_k"], d["conv_k"]
    fwd = Forward.__new__(Forward)          # only the config the KDA path reads
    fwd.cfg = SimpleNamespace(num_heads=H, head_dim=D, gate_lower_bound=d["lower_bound"],
                              rms_norm_eps=d["rms_eps"])
    state = SimpleNamespace(kda_conv={0: np.zeros((3, H * D, K - 1), np.float32)},
                            kda_S={0: np.zeros((H, D, D), np.float32)})
    lw = {f"self_attn.{name}": d[key] for name, key in (
        ("q_proj.weight", "q_proj"), ("k_proj.weight", "k_proj"), ("v_proj.weight", "v_proj"),
        ("q_conv1d.weight", "q_conv"), ("k_conv1d.weight", "k_conv"),
        ("v_conv1d.weight", "v_conv"), ("b_proj.weight", "b_proj"),
        ("f_a_proj.weight", "f_a"), ("f_b_proj.weight", "f_b"), ("A_log", "A_log"),
        ("dt_bias", "dt_bias"), ("g_proj.weight", "g_proj"), ("o_norm.weight", "o_norm"),
        ("o_proj.weight", "o_proj"))}
    x = d["in"][0]
    seq = SimpleNamespace(state=state, r0=0, r1=x.shape[0])      # one sequence's pass
    return fwd._kda(0, lw, x, [seq]), state.kda_S[0]


@pytest.mark.parametrize("name", ["kda_layer1.json", "kda_layer8.json"])
def test_kernels_kda_layer_norm_before_gate(record_property, name):
    """Catches gate before the head norm, L2 on v, a missing q scale, and the decay or
    recurrence mistakes compounded over 8 tokens."""
    d = load(name)
    y, S = _kda_layer(d)
    _within(record_property, name + ":out", y, d["out"][0])
    _within(record_property, name + ":state", S, d["state_out"][0])


# ----------------------------------------------------------------------------- router, MoE

def _route(gate_weight, bias, x, top_k, renorm, scale):
    logits = _mm(gate_weight, x)
    idx = np.empty((x.shape[0], top_k), dtype=np.int64)
    w = np.empty((x.shape[0], top_k), dtype=np.float32)
    router.router_topk(logits, bias, top_k, bool(renorm), scale, idx, w)
    return idx, w


def test_kernels_router_bias_selects_but_does_not_weigh(record_property):
    """Catches ignoring the bias, weights from biased scores, softmax instead of sigmoid,
    a missing renormalisation (ids compared as sets, weights matched by id)."""
    d = load("router.json")
    idx, w = _route(d["gate_weight"], d["bias"], d["in"], d["top_k"], True, 1.0)
    want_idx = d["topk_idx"].astype(np.int64)
    worst = 0.0
    for t in range(idx.shape[0]):
        assert set(idx[t]) == set(want_idx[t]), (t, idx[t], want_idx[t])
        order = [list(idx[t]).index(e) for e in want_idx[t]]
        worst = max(worst, worst_fraction(w[t, order], d["topk_weight"][t]))
    record_property("router_weights", worst)
    print(f"router weights: worst element {worst:.4f}x tolerance (id sets equal)")
    assert worst <= 1.0, worst


def test_kernels_router_control_without_bias_selects_differently():
    """Control: routing without the bias must change some selections (the file says 5 of
    6 rows), or the selection test above could not see an ignored bias."""
    d = load("router.json")
    idx, _ = _route(d["gate_weight"], np.zeros_like(d["bias"]), d["in"], d["top_k"], True, 1.0)
    want = d["topk_idx"].astype(np.int64)
    changed = sum(set(idx[t]) != set(want[t]) for t in range(idx.shape[0]))
    assert changed == d["rows_where_bias_changed_selection"]


def _moe(d):
    """The LatentMoE of model.md §5.8 with the vector's plain f32 experts."""
    x = d["in"][0]
    T, k = x.shape[0], d["top_k"]
    idx, w = _route(d["gate_weight"], d["e_score_correction_bias"], x, k, d["renorm"],
                    d["routed_scale"])
    z = _mm(d["down_weight"], x)
    e_out = np.empty((T, k, z.shape[1]), dtype=np.float32)
    for t in range(T):
        for j in range(k):
            e = idx[t, j]
            moe.situ_mlp(d[f"experts_{e}_w1_weight"], d[f"experts_{e}_w3_weight"],
                         d[f"experts_{e}_w2_weight"], z[t:t + 1], d["situ_b1"],
                         d["situ_b2"], e_out[t, j:j + 1])
    u = np.empty_like(z)
    moe.combine_routed(e_out, w, u)
    norms.rmsnorm(u, d["norm_weight"], d["rms_eps"], u)
    y_routed = _mm(d["up_weight"], u)
    y_shared = np.empty_like(y_routed)
    moe.situ_mlp(d["shared_w1_weight"], d["shared_w3_weight"], d["shared_w2_weight"], x,
                 d["situ_b1"], d["situ_b2"], y_shared)
    return y_routed + y_shared


def test_kernels_moe_routes_on_full_width_norms_aggregate(record_property):
    """Catches routing on the latent, norming per expert, weighting the shared expert,
    weights from biased scores, and a non-libm SiTU (README section 2: 1.15-1.3x)."""
    d = load("moe.json")
    frac = _within(record_property, "moe", _moe(d), d["out"][0])
    assert frac < 0.75, f"moe margin {frac:.3f}: the libm-f32 SiTU path gives 0.53"


# ----------------------------------------------------------------------------- AttnRes, MLA

def test_kernels_attnres_mixes_raw_sources(record_property):
    """Catches mixing the normalised keys, the gain on the values, sum instead of mean."""
    d = load("attnres.json")
    blocks = _c(d["block_residual"].transpose(1, 0, 2))          # (S-1, T, E)
    f = (d["norm_weight"] * d["proj_weight"]).astype(np.float32)
    out = np.empty_like(d["prefix_sum"])
    attnres.attnres(blocks, blocks.shape[0], d["prefix_sum"], f, d["eps"], out)
    _within(record_property, "attnres", out, d["out"])


def _mla_inputs(d):
    x = d["in"][0]
    T, H = x.shape[0], d["n_heads"]
    nope, rope, r = d["qk_nope"], d["qk_rope"], d["kv_lora"]
    cq = _mm(d["q_a_proj_weight"], x)
    norms.rmsnorm(cq, d["q_a_layernorm_weight"], d["rms_eps"], cq)
    q = _mm(d["q_b_proj_weight"], cq).reshape(T, H, nope + rope)
    c = _mm(d["kv_a_proj_with_mqa_weight"], x)
    latent = _c(c[:, :r])
    norms.rmsnorm(latent, d["kv_a_layernorm_weight"], d["rms_eps"], latent)
    return x, _c(q[:, :, :nope]), _c(q[:, :, nope:]), latent, _c(c[:, r:])


def _mla_out(d, x, attn):
    T = x.shape[0]
    gate = _mm(d["g_proj_weight"], x)
    flat = attn.reshape(-1)
    activations.gate_mul(flat, gate.reshape(-1), flat)
    return _mm(d["o_proj_weight"], attn.reshape(T, -1))


def test_kernels_mla_scale_over_full_qk_width(record_property):
    """Catches scale over nope only, a rotated or normalised key slice, per-head keys, a
    gate after o_proj; also checks the cache contents (normalised latent, raw k_rope)."""
    d = load("mla.json")
    x, q_nope, q_rope, latent, k_rope = _mla_inputs(d)
    T, H = x.shape[0], d["n_heads"]
    _within(record_property, "mla_kv_latent", latent, d["kv_latent"][0])
    _within(record_property, "mla_k_rope", k_rope, d["k_rope"][0])
    attn = np.empty((T, H, d["v_head"]), dtype=np.float32)
    mla.mla_attention(q_nope, q_rope, np.arange(T, dtype=np.int64), latent, k_rope,
                      d["kv_b_proj_weight"], (d["qk_nope"] + d["qk_rope"]) ** -0.5, attn)
    _within(record_property, "mla", _mla_out(d, x, attn), d["out"][0])


def test_kernels_mla_decode_one_position_at_a_time_equals_prefill():
    """Catches a decode path that differs from prefill (different cache view, causality
    off by one): positions fed one by one against a growing cache give identical bits."""
    d = load("mla.json")
    x, q_nope, q_rope, latent, k_rope = _mla_inputs(d)
    T, H, v = x.shape[0], d["n_heads"], d["v_head"]
    scale = (d["qk_nope"] + d["qk_rope"]) ** -0.5
    full = np.empty((T, H, v), dtype=np.float32)
    mla.mla_attention(q_nope, q_rope, np.arange(T, dtype=np.int64), latent, k_rope,
                      d["kv_b_proj_weight"], scale, full)
    cache_l = np.full_like(latent, np.nan)          # rows beyond the position: poison
    cache_r = np.full_like(k_rope, np.nan)
    for t in range(T):
        cache_l[t] = latent[t]
        cache_r[t] = k_rope[t]
        one = np.empty((1, H, v), dtype=np.float32)
        mla.mla_attention(q_nope[t:t + 1], q_rope[t:t + 1], np.array([t], np.int64),
                          cache_l, cache_r, d["kv_b_proj_weight"], scale, one)
        assert np.array_equal(one[0].view(np.uint32), full[t].view(np.uint32)), t


# ----------------------------------------------------------------------------- MXFP4

@pytest.fixture(scope="module")
def released():
    doc = json.loads((require() / "mxfp4.json").read_text())
    packed = np.asarray(doc["packed"]["data"], dtype=np.uint8).reshape(doc["packed"]["shape"])
    scales = np.asarray(doc["scales"]["data"], dtype=np.uint8).reshape(doc["scales"]["shape"])
    want = np.asarray(doc["expected"]["data"], dtype=np.float64).astype(np.float32)
    swapped = np.asarray(doc["expected_swapped_nibbles"]["first64"], np.float64).astype(np.float32)
    return packed, scales, want.reshape(doc["expected"]["shape"]), swapped


def test_kernels_mxfp4_decode_of_released_bytes_is_exact(released):
    """Catches a nibble swap, a wrong exponent bias, groups that are not 32 consecutive
    inputs: the kernel applied to one-hot inputs reproduces every released weight exactly,
    and so does the numpy decode the float64 reference uses."""
    packed, scales, want, _ = released
    R, C = want.shape
    assert np.array_equal(io_mxfp4.decode(packed, scales).view(np.uint32), want.view(np.uint32))
    got = np.empty((C, R), dtype=np.float32)
    for lo in range(0, C, 512):                        # column j = kernel(e_j)
        eye = np.zeros((min(512, C - lo), C), dtype=np.float32)
        eye[np.arange(eye.shape[0]), lo + np.arange(eye.shape[0])] = 1.0
        mxfp4.matmul(packed, scales, eye, got[lo:lo + eye.shape[0]])
    assert np.array_equal(got.T, want)      # by value: a -0 weight * 1 summed from +0 is +0


def test_kernels_mxfp4_nibble_order_control(released):
    """Control: row 0's first 64 values differ from the swapped-nibble decode."""
    packed, scales, want, swapped = released
    assert not np.array_equal(want[0, :64], swapped)
    y = np.empty((64, packed.shape[0]), dtype=np.float32)
    eye = np.eye(64, want.shape[1], dtype=np.float32)
    mxfp4.matmul(packed, scales, eye, y)
    assert np.array_equal(y[:, 0], want[0, :64]) and not np.array_equal(y[:, 0], swapped)


def test_kernels_mxfp4_matvec_matches_decode_then_multiply(released):
    """Catches a packed matvec that drifts from dequantise-then-multiply (float64)."""
    packed, scales, want, _ = released
    x = np.random.default_rng(7).standard_normal(want.shape[1]).astype(np.float32)
    y = np.empty(want.shape[0], dtype=np.float32)
    mxfp4.matvec(packed, scales, x, y)
    ref = want.astype(np.float64) @ x.astype(np.float64)
    scale = np.abs(want.astype(np.float64)) @ np.abs(x.astype(np.float64))
    assert np.max(np.abs(y - ref) / scale) <= 1e-6


def test_kernels_mxfp4_scale_255_group_contributes_nothing():
    """Catches a 255 scale decoded as 2^128 or as 0 * x (NaN under an inf input): with an
    inf in that group's inputs the row stays finite and equals the row without the group.
    Control: the same bytes with scale 127 do contribute."""
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, size=(4, 64), dtype=np.uint8)     # 4 rows x 128 inputs
    scales = np.full((4, 4), 127, dtype=np.uint8)
    x = rng.standard_normal(128).astype(np.float32)
    base = np.empty(4, np.float32)
    mxfp4.matvec(packed, scales, x, base)
    scales[1, 2] = 255
    x_inf = x.copy()
    x_inf[70] = np.inf                                              # inside group 2
    got = np.empty(4, np.float32)
    mxfp4.matvec(packed, scales, x_inf, got)
    zeroed = packed.copy()
    zeroed[1, 32:48] = 0                                            # group 2 of row 1
    want = np.empty(4, np.float32)
    x_zero = x.copy()
    x_zero[64:96] = 0.0
    mxfp4.matvec(zeroed, np.full((4, 4), 127, np.uint8), x_zero, want)
    assert np.isfinite(got[1]) and got[1] == want[1]
    assert got[1] != base[1]                                        # control: it mattered
    assert np.isnan(got[0]) or np.isinf(got[0])                     # row 0 does see the inf
