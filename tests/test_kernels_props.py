"""Property tests of libk3.kernels against plain numpy written here (no conformance data).

Two kinds of oracle: numpy emulations of the exact summation orders of
formats/model/numerics.md (bit-for-bit checks: the documented order IS the implemented one),
and float64 implementations of the spec math (tolerance checks, model.md §7.4). Plus the
invariants every kernel promises: a T-token call equals T one-token calls bit for bit,
and results do not depend on the thread count.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libk3.io import mxfp4 as io_mxfp4
from libk3.io.dtypes import bf16_to_f32
from libk3.kernels import activations, attnres, bf16, kda, mla, moe, mxfp4, norms, router
from libk3.kernels import _mxfp4_tile as _tile
from libk3.kernels._simd import widen_f32

PROPS = settings(max_examples=25, deadline=None)
seeds = st.integers(0, 2**32 - 1)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def _close(got, want, atol=1e-5, rtol=1e-4):
    """model.md §7.4 per-op rule, every element."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return bool(np.all(np.abs(got - want) <= atol + rtol * np.abs(want)))


def _finite_bf16(rng, shape):
    """Random BF16 bit patterns of finite values (subnormals and both zeros included)."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint32).astype(np.uint16)
    inf_nan = (bits & 0x7F80) == 0x7F80
    bits[inf_nan] ^= np.uint16(0x0080)                  # exponent 0xFF -> 0xFE
    return bits


# ----------------------------------------------------------------------------- oracles

def _order16(prod):
    """numerics.md section 2 on the last axis of exact f64 products; returns f64."""
    n = prod.shape[-1]
    n16 = n - n % 16
    a = np.zeros(prod.shape[:-1] + (16,))
    for i in range(0, n16, 16):
        a = a + prod[..., i:i + 16]
    b = [(a[..., l] + a[..., l + 4]) + (a[..., l + 8] + a[..., l + 12]) for l in range(4)]
    s = (b[0] + b[1]) + (b[2] + b[3])
    for i in range(n16, n):
        s = s + prod[..., i]
    return s


def _order_mxfp4(packed, scales, x):
    """numerics.md section 3: per group 8 sequential lanes, fixed tree, x 2^(s-127)."""
    R = packed.shape[0]
    codes = np.empty((R, packed.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2] = packed & 15
    codes[:, 1::2] = packed >> 4
    prod = io_mxfp4.E2M1[codes].astype(np.float64) * x.astype(np.float64)
    G = scales.shape[1]
    prod = prod.reshape(R, G, 4, 8)
    lanes = np.zeros((R, G, 8))
    for c in range(4):
        lanes = lanes + prod[:, :, c, :]
    s = lanes
    gs = (((s[..., 0] + s[..., 4]) + (s[..., 1] + s[..., 5]))
          + ((s[..., 2] + s[..., 6]) + (s[..., 3] + s[..., 7])))
    acc = np.zeros(R)
    for g in range(G):
        live = scales[:, g] != 255
        term = gs[:, g] * np.ldexp(1.0, scales[:, g].astype(np.int64) - 127)
        acc = np.where(live, acc + term, acc)
    return acc


# ----------------------------------------------------------------------------- widening

def test_kernels_bf16_widening_equals_io_widening_for_all_patterns():
    """Catches a numba widening that differs from io.dtypes.bf16_to_f32 anywhere (NaN
    payloads, -0, subnormals): all 65536 patterns compared bit for bit."""
    @numba.njit
    def widen_all(bits, out):
        for i in range(bits.shape[0]):
            out[i] = widen_f32(bits[i])

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(bits.shape[0], np.float32)
    widen_all(bits, out)
    assert np.array_equal(_bits(out), _bits(bf16_to_f32(bits)))


# ----------------------------------------------------------------------------- dense matvec

@PROPS
@given(seeds, st.integers(1, 30), st.integers(1, 90))
def test_kernels_bf16_matvec_random_finite_patterns(seed, O, I):
    """Catches a wrong widening, an f32 accumulator, a skipped tail, a drift from the
    float64 product, on random finite BF16 patterns (subnormals, both zeros, huge
    exponents); bit-exact against numerics.md section 2 (the order itself is pinned by
    the cancellation test, which random data rarely could)."""
    rng = np.random.default_rng(seed)
    W = _finite_bf16(rng, (O, I))
    x = (rng.standard_normal(I) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
    y = np.empty(O, np.float32)
    bf16.matvec(W, x, y)
    prod = bf16_to_f32(W).astype(np.float64) * x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        want = _order16(prod).astype(np.float32)
    assert np.array_equal(_bits(y), _bits(want))
    mag = np.abs(prod).sum(axis=1)
    ok = np.isfinite(mag) & (mag < 1e38)
    assert np.all(np.abs(y[ok] - prod.sum(axis=1)[ok]) <= 1e-6 * mag[ok] + 1e-30)


def _cancelling(rng, n):
    """n values: equal numbers of +2^60 and -2^60 (exact in BF16 and E2M1 x f32) among
    small integers. The exact sum is small, but an f64 partial sum holding 2^60 drops
    any small term added to it (ulp 256), so the result depends on the association of
    every addition: a summation order other than the documented one shows up as an
    integer-sized difference that no f32 rounding can hide."""
    m = int(rng.integers(0, n // 2 + 1))
    vals = np.concatenate([np.full(m, 2.0 ** 60), np.full(m, -(2.0 ** 60)),
                           rng.integers(-100, 101, size=n - 2 * m).astype(np.float64)])
    return rng.permutation(vals)


@PROPS
@given(seeds, st.integers(1, 30), st.integers(2, 100))
def test_kernels_dense_matvec_order_shows_under_cancellation(seed, O, I):
    """Catches a summation order other than numerics.md section 2 (lane mapping, the
    reduction tree, the tail), for BF16 bits and f32 weights, single- and twelve-row paths,
    which random data rarely can (f64 differences vanish in the f32 rounding). Checked by
    mutation: swapping b1 and b2 in the final reduction fails here and nowhere else."""
    rng = np.random.default_rng(seed)
    W = np.stack([_cancelling(rng, I) for _ in range(O)]).astype(np.float32)
    x = rng.choice(np.array([1.0, -1.0, 0.5], np.float32), size=I)
    want = _order16(W.astype(np.float64) * x.astype(np.float64)).astype(np.float32)
    y = np.empty(O, np.float32)
    for weights in (W, (W.view(np.uint32) >> 16).astype(np.uint16)):
        bf16.matvec(weights, x, y)
        assert np.array_equal(_bits(y), _bits(want))


@PROPS
@given(seeds, st.integers(1, 41), st.integers(1, 700), st.integers(1, 20))
def test_kernels_dense_matmul_equals_matvec_per_token(seed, O, I, T):
    """Catches a prefill (block) path whose per-token arithmetic differs from decode, for
    BF16 bits and f32 weights: blocks of four tokens, a pair, a last token (a (token, row)
    finished from another's vectors, tokens or rows of a block swapped), rows past the last
    twelve-row task; from 16 tokens the widen-once path (lane vectors lost or mixed
    between column spans, a last partial block of rows); columns with a tail, cancelling
    activations."""
    rng = np.random.default_rng(seed)
    X = (_cancelling(rng, T * I).reshape(T, I) if I > 1
         else rng.standard_normal((T, I))).astype(np.float32)
    for W in (_finite_bf16(rng, (O, I)), rng.standard_normal((O, I)).astype(np.float32)):
        Y = np.empty((T, O), np.float32)
        bf16.matmul(W, X, Y)
        y = np.empty(O, np.float32)
        for t in range(T):
            bf16.matvec(W, X[t], y)
            assert np.array_equal(_bits(y), _bits(Y[t]))


@PROPS
@given(seeds, st.integers(1, 9), st.integers(1, 70))
def test_kernels_f32_matvec_matches_float64(seed, O, I):
    """Catches an f32-weight path that drifts from the float64 product (one rounding)."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((O, I)).astype(np.float32)
    x = rng.standard_normal(I).astype(np.float32)
    y = np.empty(O, np.float32)
    bf16.matvec(W, x, y)
    prod = W.astype(np.float64) * x.astype(np.float64)
    assert np.array_equal(_bits(y), _bits(_order16(prod).astype(np.float32)))
    assert np.all(np.abs(y - prod.sum(axis=1)) <= 1e-6 * np.abs(prod).sum(axis=1) + 1e-30)


# ----------------------------------------------------------------------------- MXFP4

def _random_mxfp4(rng, R, G, p255):
    packed = rng.integers(0, 256, size=(R, 16 * G), dtype=np.uint8)
    scales = rng.integers(110, 140, size=(R, G), dtype=np.uint8)
    scales[rng.random((R, G)) < p255] = 255
    return packed, scales


@PROPS
@given(seeds, st.integers(1, 9), st.integers(1, 5))
def test_kernels_mxfp4_matvec_random_bytes_and_nan_scales(seed, R, G):
    """Catches a nibble swap, a wrong exponent bias, a 255 group that contributes, and a
    drift from decode-then-float64; bit-exact against numerics.md section 3."""
    rng = np.random.default_rng(seed)
    packed, scales = _random_mxfp4(rng, R, G, 0.15)
    x = rng.standard_normal(32 * G).astype(np.float32)
    y = np.empty(R, np.float32)
    mxfp4.matvec(packed, scales, x, y)
    assert np.array_equal(_bits(y), _bits(_order_mxfp4(packed, scales, x).astype(np.float32)))
    with np.errstate(over="ignore"):                    # io's 2^128 for byte 255
        w = io_mxfp4.decode(packed, scales).astype(np.float64)
    ref = w @ x.astype(np.float64)
    mag = np.abs(w) @ np.abs(x.astype(np.float64))
    assert np.all(np.abs(y - ref) <= 1e-6 * mag + 1e-30)


@PROPS
@given(seeds, st.integers(1, 6), st.integers(1, 5))
def test_kernels_mxfp4_order_shows_under_cancellation(seed, R, G):
    """Catches an order other than numerics.md section 3 (lanes, group tree, group
    sequence) using cancelling activations under +-1 weights."""
    rng = np.random.default_rng(seed)
    packed = rng.choice(np.array([0x22, 0xAA, 0x2A, 0xA2], np.uint8), size=(R, 16 * G))
    scales = np.full((R, G), 127, np.uint8)
    x = _cancelling(rng, 32 * G).astype(np.float32)
    y = np.empty(R, np.float32)
    mxfp4.matvec(packed, scales, x, y)
    assert np.array_equal(_bits(y), _bits(_order_mxfp4(packed, scales, x).astype(np.float32)))


@PROPS
@given(seeds, st.integers(1, 9), st.integers(1, 4), st.integers(1, 5))
def test_kernels_mxfp4_matmul_equals_matvec_per_token(seed, R, G, T):
    """Catches a prefill MXFP4 path whose per-token arithmetic differs from decode."""
    rng = np.random.default_rng(seed)
    packed, scales = _random_mxfp4(rng, R, G, 0.1)
    X = rng.standard_normal((T, 32 * G)).astype(np.float32)
    Y = np.empty((T, R), np.float32)
    mxfp4.matmul(packed, scales, X, Y)
    y = np.empty(R, np.float32)
    for t in range(T):
        mxfp4.matvec(packed, scales, X[t], y)
        assert np.array_equal(_bits(y), _bits(Y[t]))



@PROPS
@given(seeds, st.integers(1, 20), st.integers(1, 9), st.integers(1, 19))
def test_kernels_mxfp4_tiles_equal_one_token_one_row_at_extremes(seed, R, G, T):
    """Catches a tile (8x1, 8x2, 4x4 rows x tokens, or two rows with eight tokens in the
    lanes) whose lanes leave the order of section 3: a reduction pairing the wrong lanes,
    a lane stored to the wrong (token, row), a 255 group that contributes, a scale built
    from the wrong exponent, row sums lost between chunks of decoded groups; row counts
    up to 20, groups up to 9 (several chunks) and tokens up to 19 put rows and tokens in
    every path and in the one-row fallback, with scale bytes 0..255 and activations from
    subnormals to near f32 max."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, size=(R, 16 * G), dtype=np.uint8)
    scales = rng.integers(0, 256, size=(R, G), dtype=np.uint8)
    with np.errstate(over="ignore"):
        X = (rng.standard_normal((T, 32 * G))
             * 10.0 ** rng.integers(-45, 39, (T, 32 * G))).astype(np.float32)
    X[rng.random(X.shape) < 0.05] = 0.0
    Y = np.empty((T, R), np.float32)
    with np.errstate(all="ignore"):
        mxfp4.matmul(packed, scales, X, Y)
        want = np.empty((R, T))
        _pairs_per_token(mxfp4._row_dot2, packed, scales, X.astype(np.float64), want)
        want32 = want.T.astype(np.float32)
    assert np.array_equal(_bits(Y), _bits(want32))


@numba.njit
def _pairs_per_token(row_fn, packed, scales, X, out):
    R = packed.shape[0]
    for t in range(X.shape[0]):
        for a in range(0, R, 2):
            b = min(a + 1, R - 1)
            out[a, t], out[b, t] = row_fn(packed[a], scales[a], packed[b], scales[b], X[t])

@numba.njit
def _pairs_f64(row_fn, packed, scales, x, out):
    for a in range(0, packed.shape[0] - 1, 2):
        out[a], out[a + 1] = row_fn(packed[a], scales[a], packed[a + 1], scales[a + 1], x)


@pytest.mark.skipif(not mxfp4.HAVE_PSHUFB, reason="no SSSE3: only the scalar MXFP4 path runs here")
@PROPS
@given(seeds, st.integers(1, 5), st.integers(1, 4))
def test_kernels_mxfp4_vector_decode_equals_scalar_path_in_float64(seed, R, G):
    """Catches a vector decode that differs from the scalar table path anywhere: the
    float64 row sums (before the f32 rounding) compared bit for bit over every scale byte
    0..255 and activations from f32 subnormals to near f32 max, both zeros, inf and NaN
    (the doubled-value trick must be exact at the extremes, too)."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, size=(2 * R, 16 * G), dtype=np.uint8)
    scales = rng.integers(0, 256, size=(2 * R, G), dtype=np.uint8)
    pool = np.array([0.0, -0.0, 1e-45, -3e-45, 1.2e-38, 3.0e38, -3.3e38, 1.0, -0.75,
                     np.inf, -np.inf, np.nan], np.float32)
    with np.errstate(over="ignore"):                    # a few overflow to inf: fine
        x = (rng.standard_normal(32 * G) * 10.0 ** rng.integers(-45, 39, 32 * G)).astype(np.float32)
    pick = rng.random(32 * G) < 0.2
    x[pick] = rng.choice(pool, pick.sum())
    x64 = x.astype(np.float64)
    want = np.empty(2 * R)
    got = np.empty(2 * R)
    with np.errstate(all="ignore"):
        _pairs_f64(mxfp4._row_dot2, packed, scales, x64, want)
        _pairs_f64(mxfp4._row_dot2_vec, packed, scales, x64, got)
    same_nan = np.isnan(want) & np.isnan(got)
    assert np.array_equal(want.view(np.uint64)[~same_nan], got.view(np.uint64)[~same_nan])
    assert np.array_equal(np.isnan(want), np.isnan(got))
    assert mxfp4._row_pair is mxfp4._row_dot2_vec        # matvec/matmul use the vector path


def _decoder(decode):
    """A numba function writing the four vectors ``decode`` makes of a 16-byte group."""
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def decode_group(typingctx, packed, out):
        sig = types.void(packed, out)

        def codegen(context, builder, signature, args):
            p = context.make_array(signature.args[0])(context, builder, args[0]).data
            o = context.make_array(signature.args[1])(context, builder, args[1]).data
            vec = ir.VectorType(ir.DoubleType(), 8).as_pointer()
            for c, v in enumerate(decode(builder, p)):
                builder.store(v, builder.bitcast(builder.gep(o, [ir.Constant(ir.IntType(64), 8 * c)]),
                                                 vec), align=8)
            return context.get_dummy_value()

        return sig, codegen

    @numba.njit
    def run(packed, out):
        for g in range(packed.shape[0]):
            decode_group(packed[g], out[g])

    return run


@pytest.mark.skipif(not _tile.HAVE_AVX512F, reason="the permute decode needs AVX-512F")
def test_kernels_mxfp4_permute_decode_equals_byte_shuffle_decode():
    """Catches a table decode (the path AVX-512 machines run) that differs from the
    byte-shuffle decode other x86-64 machines run, or from 2 * E2M1: every byte value at
    every one of the 16 positions of a group, bit for bit."""
    groups = np.stack([np.roll(np.arange(256, dtype=np.uint8), k)[:16 * 16].reshape(16, 16)
                       for k in range(16)]).reshape(-1, 16)
    groups = np.concatenate([groups, np.arange(256, dtype=np.uint8).reshape(16, 16).T.copy()])
    want = np.empty((groups.shape[0], 32))
    got = np.empty((groups.shape[0], 32))
    _decoder(_tile._decode_pshufb)(groups, want)
    _decoder(_tile._decode_permute)(groups, got)
    assert np.array_equal(want.view(np.uint64), got.view(np.uint64))
    codes = np.empty((groups.shape[0], 32), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = groups & 15, groups >> 4
    assert np.array_equal(want, 2 * io_mxfp4.E2M1[codes].astype(np.float64) + 0.0)

# ----------------------------------------------------------------------------- norms

@PROPS
@given(seeds, st.integers(1, 5), st.integers(1, 300))
def test_kernels_norms_are_the_documented_order(seed, rows, n):
    """Catches an f32 or pairwise sum of squares, eps outside the root, w * (x * inv)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, n)) * 10.0 ** rng.integers(-2, 3)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    ss = np.add.accumulate(x.astype(np.float64) ** 2, axis=1)[:, -1:]   # sequential
    inv_rms = (1.0 / np.sqrt(ss / n + 1e-5)).astype(np.float32)
    inv_l2 = (1.0 / np.sqrt(ss + 1e-6)).astype(np.float32)
    out = np.empty_like(x)
    norms.rmsnorm(x, w, 1e-5, out)
    assert np.array_equal(_bits(out), _bits((w * x) * inv_rms))
    norms.l2norm(x, 1e-6, out)
    assert np.array_equal(_bits(out), _bits(x * inv_l2))


# ----------------------------------------------------------------------------- activations

def _libm():
    name = ctypes.util.find_library("m")
    if name is None:
        pytest.skip("no C math library to compare against")
    lib = ctypes.CDLL(name)
    for f in ("expf", "tanhf"):
        getattr(lib, f).restype = ctypes.c_float
        getattr(lib, f).argtypes = [ctypes.c_float]
    return lib


def _expf(lib, x):
    """Elementwise C-library expf of a float32 array (the model.md §7.3 reference)."""
    return np.array([lib.expf(float(v)) for v in np.ravel(x)], np.float32).reshape(np.shape(x))


def _sigmoid_kernel(x):
    out = np.empty(x.size, np.float32)
    activations.sigmoid(np.ascontiguousarray(x, np.float32).reshape(-1), out)
    return out.reshape(x.shape)


def test_kernels_activations_use_libm_float32_semantics():
    """Catches numpy-vectorised or float64 transcendentals (model.md §7.3): sigmoid and SiTU
    equal the C library's expf/tanhf evaluation bit for bit on 3000 inputs. Control: the
    float64 SiTU differs somewhere on the same inputs."""
    lib = _libm()
    rng = np.random.default_rng(11)
    g = (rng.standard_normal(3000) * 10.0 ** rng.uniform(-1, 2.5, 3000)).astype(np.float32)
    u = (rng.standard_normal(3000) * 10.0 ** rng.uniform(-1, 3, 3000)).astype(np.float32)
    one, b1, b2 = np.float32(1), np.float32(4), np.float32(25)
    sig = np.array([one / (one + np.float32(lib.expf(-v))) for v in g], np.float32)
    a = np.array([b1 * np.float32(lib.tanhf(v / b1)) for v in g], np.float32) * sig
    b = np.array([b2 * np.float32(lib.tanhf(v / b2)) for v in u], np.float32)
    got = np.empty_like(g)
    activations.sigmoid(g, got)
    assert np.array_equal(_bits(got), _bits(sig))
    activations.situ(g, u, 4.0, 25.0, got)
    assert np.array_equal(_bits(got), _bits(a * b))
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    situ64 = (4 * np.tanh(g64 / 4) / (1 + np.exp(-g64))) * (25 * np.tanh(u64 / 25))
    assert not np.array_equal(_bits(got), _bits(situ64.astype(np.float32)))


# ----------------------------------------------------------------------------- KDA

def _conv_ref(u, w, hist):
    """float64 causal depthwise conv + SiLU with a history (oldest first)."""
    K = w.shape[1]
    full = np.concatenate([hist.T.astype(np.float64), u.astype(np.float64)], axis=0)
    y = np.stack([(full[t:t + K] * w.T.astype(np.float64)).sum(axis=0) for t in range(u.shape[0])])
    return y / (1 + np.exp(-y)), full[-(K - 1):].T


@PROPS
@given(seeds, st.integers(2, 5), st.integers(1, 7), st.integers(1, 6))
def test_kernels_short_conv_streams_like_one_call(seed, K, T, C):
    """Catches a history that is not the last K-1 inputs (any K), a T-token call that
    differs from T one-token calls, and taps applied in the wrong direction."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    h0 = rng.standard_normal((C, K - 1)).astype(np.float32)
    hist = h0.copy()
    out = np.empty_like(u)
    kda.short_conv(u, w, hist, out)
    want, want_hist = _conv_ref(u, w, h0)
    assert _close(out, want) and np.array_equal(hist, want_hist.astype(np.float32))
    hist1 = h0.copy()
    for t in range(T):
        one = np.empty((1, C), np.float32)
        kda.short_conv(u[t:t + 1], w, hist1, one)
        assert np.array_equal(_bits(one[0]), _bits(out[t]))
    assert np.array_equal(hist1, hist)


@PROPS
@given(seeds, st.integers(2, 5), st.integers(1, 6), st.integers(1, 6))
def test_kernels_short_conv_is_the_documented_f32_order(seed, K, T, C):
    """Catches an order other than numerics.md section 5 (current tap first, then oldest
    to newest) or a float64 accumulator: bit-exact against a numpy f32 emulation."""
    rng = np.random.default_rng(seed)
    u = (rng.standard_normal((T, C)) * 30).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    h0 = (rng.standard_normal((C, K - 1)) * 30).astype(np.float32)
    out = np.empty_like(u)
    kda.short_conv(u, w, h0.copy(), out)
    full = np.concatenate([h0.T, u], axis=0)                          # (K-1+T, C)
    for t in range(T):
        acc = w[:, K - 1] * u[t]
        for j in range(K - 1):
            acc = acc + w[:, j] * full[t + j]
        assert np.array_equal(_bits(out[t]), _bits(acc * _sigmoid_kernel(acc)))


def _recur_ref(q, k, v, alpha, beta, q_scale, S):
    """float64 delta rule in the spec order: decay, read, write, output."""
    S = S.astype(np.float64).copy()
    out = np.empty(v.shape)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            Sh = S[h] * alpha[t, h, :, None]
            u = k[t, h] @ Sh
            Sh = Sh + np.outer(k[t, h] * beta[t, h], v[t, h] - u)
            out[t, h] = (q[t, h] * q_scale) @ Sh
            S[h] = Sh
    return out, S


def _kda_inputs(rng, T, H, Dk, Dv, unit_k):
    """Random q, k (unit rows when ``unit_k``), v, alpha in (0.01, 1), beta in (0, 1) and
    a starting state for the KDA recurrence, all float32."""
    q = rng.standard_normal((T, H, Dk)).astype(np.float32)
    k = rng.standard_normal((T, H, Dk)).astype(np.float32)
    if unit_k:
        k /= np.linalg.norm(k, axis=-1, keepdims=True).astype(np.float32)
    v = rng.standard_normal((T, H, Dv)).astype(np.float32)
    alpha = rng.uniform(0.01, 1.0, (T, H, Dk)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (T, H)).astype(np.float32)
    S = rng.standard_normal((H, Dk, Dv)).astype(np.float32)
    return q, k, v, alpha, beta, S


@PROPS
@given(seeds, st.integers(1, 6), st.integers(1, 3), st.integers(1, 8), st.integers(1, 8))
def test_kernels_kda_recurrence_matches_float64_and_streams(seed, T, H, Dk, Dv):
    """Catches a wrong step order or transposed state (float64 oracle) and a T-token call
    that differs from T one-token calls (incremental decoding gate)."""
    q, k, v, alpha, beta, S0 = _kda_inputs(np.random.default_rng(seed), T, H, Dk, Dv, unit_k=True)
    S = S0.copy()
    out = np.empty_like(v)
    kda.kda_recurrence(q, k, v, alpha, beta, Dk ** -0.5, S, out)
    want, want_S = _recur_ref(q, k, v, alpha, beta, Dk ** -0.5, S0)
    assert _close(out, want) and _close(S, want_S)
    S1 = S0.copy()
    for t in range(T):
        one = np.empty((1, H, Dv), np.float32)
        kda.kda_recurrence(q[t:t + 1], k[t:t + 1], v[t:t + 1], alpha[t:t + 1], beta[t:t + 1],
                           Dk ** -0.5, S1, one)
        assert np.array_equal(_bits(one[0]), _bits(out[t]))
    assert np.array_equal(_bits(S1), _bits(S))


@PROPS
@given(seeds, st.integers(1, 4), st.integers(1, 2), st.integers(1, 9), st.integers(1, 9))
def test_kernels_kda_recurrence_is_the_documented_f32_order(seed, T, H, Dk, Dv):
    """Catches an order other than numerics.md section 5 inside the f32 delta rule
    ((k_i * beta) * d_j, q_i * scale, sequential sums from +0): bit-exact emulation."""
    q, k, v, alpha, beta, S = _kda_inputs(np.random.default_rng(seed), T, H, Dk, Dv, unit_k=False)
    E = S.copy()
    out = np.empty_like(v)
    kda.kda_recurrence(q, k, v, alpha, beta, 0.3, S, out)
    qs = np.float32(0.3)
    for t in range(T):
        for h in range(H):
            Sh = alpha[t, h][:, None] * E[h]
            u = np.zeros(Dv, np.float32)
            for i in range(Dk):
                u = u + k[t, h, i] * Sh[i]
            d = v[t, h] - u
            o = np.zeros(Dv, np.float32)
            for i in range(Dk):
                Sh[i] = Sh[i] + (k[t, h, i] * beta[t, h]) * d
                o = o + (q[t, h, i] * qs) * Sh[i]
            E[h] = Sh
            assert np.array_equal(_bits(out[t, h]), _bits(o))
    assert np.array_equal(_bits(S), _bits(E))


def test_kernels_kda_decay_saturates_to_alpha_one_without_error():
    """Catches an error or NaN when sigmoid underflows: g = -0 and alpha = 1 exactly.
    Control: a moderate argument gives alpha strictly inside (e^-5, 1)."""
    z = np.array([[-1e4, 0.0]], np.float32)
    g = np.empty_like(z)
    alpha = np.empty_like(z)
    kda.kda_decay(z, np.zeros(1, np.float32), np.zeros(2, np.float32), -5.0, g, alpha)
    assert g[0, 0] == 0.0 and np.signbit(g[0, 0]) and alpha[0, 0] == 1.0
    assert np.exp(-5.0) < alpha[0, 1] < 1.0


# ----------------------------------------------------------------------------- router

@PROPS
@given(seeds, st.integers(1, 4), st.integers(2, 12), st.data())
def test_kernels_router_ties_go_to_lowest_index(seed, T, N, data):
    """Catches ties to the highest index, a selection not in descending biased order,
    weights from biased scores, renormalisation not in f64 pick order."""
    k = data.draw(st.integers(1, N))
    rng = np.random.default_rng(seed)
    logits = rng.choice(np.array([-1.0, 0.0, 0.5, 2.0], np.float32), size=(T, N))
    bias = rng.choice(np.array([0.0, 0.125, -0.25], np.float32), size=N)
    idx = np.empty((T, k), np.int64)
    w = np.empty((T, k), np.float32)
    router.router_topk(logits, bias, k, True, 2.5, idx, w)
    s = np.empty(T * N, np.float32)
    activations.sigmoid(np.ascontiguousarray(logits).reshape(-1), s)
    s = s.reshape(T, N)
    for t in range(T):
        b = s[t] + bias
        want = sorted(range(N), key=lambda e: (-b[e], e))[:k]
        assert list(idx[t]) == want
        ws = s[t, want]
        inv = np.float32(1.0 / (np.add.accumulate(ws.astype(np.float64))[-1] + 1e-20))
        assert np.array_equal(_bits(w[t]), _bits((ws * inv) * np.float32(2.5)))


def test_kernels_router_all_equal_scores_pick_first_ids():
    """Catches tie-breaking by anything but the lowest index. Control: raising the last
    expert's bias moves it to the front."""
    logits = np.zeros((1, 6), np.float32)
    idx = np.empty((1, 3), np.int64)
    w = np.empty((1, 3), np.float32)
    router.router_topk(logits, np.zeros(6, np.float32), 3, True, 1.0, idx, w)
    assert list(idx[0]) == [0, 1, 2]
    bias = np.zeros(6, np.float32)
    bias[5] = 0.5
    router.router_topk(logits, bias, 3, True, 1.0, idx, w)
    assert list(idx[0]) == [5, 0, 1]
    assert np.all(w[0] == w[0, 0])                       # weights ignore the bias


@PROPS
@given(seeds, st.integers(1, 3), st.integers(1, 6), st.integers(1, 40))
def test_kernels_combine_routed_sums_in_selection_order(seed, T, k, L):
    """Catches a combine in any order but the selection order (numerics.md section 8),
    or in float64: values of mixed magnitude make the f32 order visible."""
    rng = np.random.default_rng(seed)
    e = (rng.standard_normal((T, k, L)) * 10.0 ** rng.integers(-4, 5, (T, k, 1))).astype(np.float32)
    w = rng.uniform(0, 1, (T, k)).astype(np.float32)
    out = np.empty((T, L), np.float32)
    moe.combine_routed(e, w, out)
    want = np.zeros((T, L), np.float32)
    for j in range(k):
        want = want + w[:, j:j + 1] * e[:, j]
    assert np.array_equal(_bits(out), _bits(want))


# ----------------------------------------------------------------------------- AttnRes

@PROPS
@given(seeds, st.integers(1, 3), st.integers(0, 5), st.integers(1, 2100))
def test_kernels_attnres_matches_float64(seed, T, nb, E):
    """Catches keys mixed instead of raw sources, a gain on the values, a dropped partial
    sum (the last source), chunking errors in the mix (E up to 2100 spans chunks)."""
    rng = np.random.default_rng(seed)
    nbuf = max(nb, 1)
    blocks = (rng.standard_normal((nbuf, T, E))
              * rng.uniform(0.1, 10, (nbuf, 1, 1))).astype(np.float32)
    prefix = rng.standard_normal((T, E)).astype(np.float32)
    f = rng.standard_normal(E).astype(np.float32) * np.float32(0.05)
    out = np.empty_like(prefix)
    attnres.attnres(blocks, nb, prefix, f, 1e-5, out)
    V = np.concatenate([blocks[:nb].astype(np.float64), prefix[None].astype(np.float64)], axis=0)
    keys = V / np.sqrt(np.mean(V * V, axis=-1, keepdims=True) + 1e-5)
    sc = keys @ f.astype(np.float64)
    p = np.exp(sc - sc.max(axis=0))
    p /= p.sum(axis=0)
    assert _close(out, np.einsum("st,ste->te", p, V))


@settings(max_examples=10, deadline=None)
@given(seeds, st.integers(1, 2), st.integers(0, 4), st.integers(1, 1100))
def test_kernels_attnres_is_the_documented_order(seed, T, nb, E):
    """Catches softmax or mix numerics other than numerics.md section 6 (f32 keys, f64
    score sums, f32 p = e / z from an f64 z, f32 mix in source order): bit-exact."""
    lib = _libm()
    rng = np.random.default_rng(seed)
    blocks = (rng.standard_normal((max(nb, 1), T, E)) * 3).astype(np.float32)
    prefix = rng.standard_normal((T, E)).astype(np.float32)
    f = (rng.standard_normal(E) * 0.3).astype(np.float32)
    out = np.empty_like(prefix)
    attnres.attnres(blocks, nb, prefix, f, 1e-5, out)
    for t in range(T):
        srcs = [blocks[s, t] for s in range(nb)] + [prefix[t]]
        sc = []
        for v in srcs:
            ss = np.add.accumulate(v.astype(np.float64) ** 2)[-1]
            key = v * np.float32(1.0 / np.sqrt(ss / E + 1e-5))
            terms = key.astype(np.float64) * f.astype(np.float64)
            sc.append(np.float32(np.add.accumulate(terms)[-1]))
        sc = np.array(sc, np.float32)
        e64 = _expf(lib, sc - sc.max()).astype(np.float64)
        p = (e64 / np.add.accumulate(e64)[-1]).astype(np.float32)
        want = np.zeros(E, np.float32)
        for s_, v in enumerate(srcs):
            want = want + p[s_] * v
        assert np.array_equal(_bits(out[t]), _bits(want))


# ----------------------------------------------------------------------------- MLA

def _mla_ref(q_nope, q_rope, pos, latent, k_rope, kv_b, scale, v):
    """float64 MLA in the expanded (non-absorbed) form of model.md §5.6 steps 3-5."""
    T, H, nope = q_nope.shape
    kvb = kv_b.astype(np.float64).reshape(H, nope + v, -1)
    out = np.empty((T, H, v))
    for t in range(T):
        L = latent[:pos[t] + 1].astype(np.float64)
        R = k_rope[:pos[t] + 1].astype(np.float64)
        for h in range(H):
            k_nope = L @ kvb[h, :nope].T
            vv = L @ kvb[h, nope:].T
            sc = (k_nope @ q_nope[t, h] + R @ q_rope[t, h]) * scale
            p = np.exp(sc - sc.max())
            out[t, h] = (p / p.sum()) @ vv
    return out


@PROPS
@given(seeds, st.integers(1, 3), st.integers(1, 4), st.integers(0, 5), st.integers(1, 4),
       st.sampled_from([(8, 4, 8, 16), (24, 8, 16, 32), (5, 3, 7, 21)]))
def test_kernels_mla_prefill_equals_successive_decodes(seed, H, T, cached, extra, dims):
    """Catches a prefill whose per-position arithmetic differs from decode, attention to
    positions after the query (later rows are NaN-poisoned), and (float64 oracle, BF16
    kv_b) a wrong absorption, scale or causal mask."""
    nope, rope, v, r = dims
    rng = np.random.default_rng(seed)
    Tc = cached + T + extra
    latent = rng.standard_normal((Tc, r)).astype(np.float32)
    k_rope = rng.standard_normal((Tc, rope)).astype(np.float32)
    kv_b = (rng.standard_normal((H * (nope + v), r)) * 0.3).astype(np.float32)
    kv_b_bits = (kv_b.view(np.uint32) >> 16).astype(np.uint16)     # BF16 by truncation
    q_nope = rng.standard_normal((T, H, nope)).astype(np.float32)
    q_rope = rng.standard_normal((T, H, rope)).astype(np.float32)
    pos = np.arange(cached, cached + T, dtype=np.int64)
    scale = (nope + rope) ** -0.5
    poisoned_l = latent.copy()
    poisoned_r = k_rope.copy()
    poisoned_l[cached + T:] = np.nan
    poisoned_r[cached + T:] = np.nan
    full = np.empty((T, H, v), np.float32)
    mla.mla_attention(q_nope, q_rope, pos, poisoned_l, poisoned_r, kv_b_bits, scale, full)
    assert np.all(np.isfinite(full))
    want = _mla_ref(q_nope, q_rope, pos, latent, k_rope, bf16_to_f32(kv_b_bits), scale, v)
    assert _close(full, want)
    for t in range(T):
        step_l = latent.copy()
        step_r = k_rope.copy()
        step_l[pos[t] + 1:] = np.nan
        step_r[pos[t] + 1:] = np.nan
        one = np.empty((1, H, v), np.float32)
        mla.mla_attention(q_nope[t:t + 1], q_rope[t:t + 1], pos[t:t + 1], step_l, step_r,
                          kv_b_bits, scale, one)
        assert np.array_equal(_bits(one[0]), _bits(full[t]))


@settings(max_examples=10, deadline=None)
@given(seeds, st.integers(1, 3), st.integers(1, 3), st.integers(0, 20),
       st.sampled_from([(8, 4, 8, 16), (24, 8, 16, 32), (5, 3, 7, 21)]))
def test_kernels_mla_is_the_documented_order(seed, H, T, cached, dims):
    """Catches MLA numerics other than numerics.md section 7 (q_bar f64 over d, two dot16
    parts added in f64 then one rounding then * f32 scale, p = f32(e / f64 z), a_bar f32
    in position order, W_UV by dot16), which tolerance checks cannot see: bit-exact."""
    lib = _libm()
    nope, rope, v, r = dims
    rng = np.random.default_rng(seed)
    Tc = cached + T
    latent = rng.standard_normal((Tc, r)).astype(np.float32)
    k_rope = rng.standard_normal((Tc, rope)).astype(np.float32)
    kv_b = (rng.standard_normal((H * (nope + v), r)) * 0.3).astype(np.float32)
    kv_b = (kv_b.view(np.uint32) >> 16).astype(np.uint16)
    W = bf16_to_f32(kv_b).reshape(H, nope + v, r)
    q_nope = rng.standard_normal((T, H, nope)).astype(np.float32)
    q_rope = rng.standard_normal((T, H, rope)).astype(np.float32)
    pos = np.arange(cached, Tc, dtype=np.int64)
    scale = (nope + rope) ** -0.5
    out = np.empty((T, H, v), np.float32)
    mla.mla_attention(q_nope, q_rope, pos, latent, k_rope, kv_b, scale, out)
    for t in range(T):
        n = pos[t] + 1
        for h in range(H):
            qb = np.zeros(r)
            for d in range(nope):
                qb = qb + W[h, d].astype(np.float64) * np.float64(q_nope[t, h, d])
            qbar = qb.astype(np.float32)
            dots = (_order16(latent[:n].astype(np.float64) * qbar.astype(np.float64))
                    + _order16(k_rope[:n].astype(np.float64) * q_rope[t, h].astype(np.float64)))
            sc = dots.astype(np.float32) * np.float32(scale)
            e = _expf(lib, sc - sc.max())
            e64 = e.astype(np.float64)
            p = (e64 / np.add.accumulate(e64)[-1]).astype(np.float32)
            abar = np.zeros(r, np.float32)
            for s_ in range(n):
                abar = abar + p[s_] * latent[s_]
            uv = W[h, nope:].astype(np.float64) * abar.astype(np.float64)
            want = _order16(uv).astype(np.float32)
            assert np.array_equal(_bits(out[t, h]), _bits(want))


# ----------------------------------------------------------------------------- threads

def test_kernels_results_do_not_depend_on_thread_count():
    """Catches a reduction split across threads: each kernel's output with 1 thread and
    with 2 threads is bit-identical. Every input is sized above team.PARALLEL_MIN_WORK
    (the work figure each kernel passes to team.narrow; 1 << 18 and more), so the 2-thread
    run is parallel."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has fewer than 2 threads here")
    rng = np.random.default_rng(5)
    W = _finite_bf16(rng, (403, 517))
    X = rng.standard_normal((3, 517)).astype(np.float32)
    packed, scales = _random_mxfp4(rng, 509, 6, 0.05)
    Xm = rng.standard_normal((3, 192)).astype(np.float32)
    H, Dk, Dv, T = 6, 32, 32, 8
    qkv = [rng.standard_normal((T, H, Dk)).astype(np.float32) for _ in range(3)]
    alpha = rng.uniform(0.1, 1, (T, H, Dk)).astype(np.float32)
    beta = rng.uniform(0, 1, (T, H)).astype(np.float32)
    latent = rng.standard_normal((40, 32)).astype(np.float32)
    k_rope = rng.standard_normal((40, 8)).astype(np.float32)
    kv_b = _finite_bf16(rng, (H * 40, 32)) & np.uint16(0xBFFF)  # keep magnitudes < 2
    qn = rng.standard_normal((4, H, 24)).astype(np.float32)
    qr = rng.standard_normal((4, H, 8)).astype(np.float32)
    pos = np.arange(30, 34, dtype=np.int64)
    blocks = rng.standard_normal((4, 2, 6000)).astype(np.float32)
    f = (rng.standard_normal(6000) * 0.05).astype(np.float32)
    x = rng.standard_normal((4, 10000)).astype(np.float32)
    w = rng.standard_normal(10000).astype(np.float32)
    u = rng.standard_normal((8, 3000)).astype(np.float32)
    taps = rng.standard_normal((3000, 4)).astype(np.float32)
    hist0 = rng.standard_normal((3000, 3)).astype(np.float32)
    z = rng.standard_normal((2, 3000)).astype(np.float32)
    a_log = rng.standard_normal(30).astype(np.float32)
    dt_bias = rng.standard_normal(3000).astype(np.float32)
    logits = rng.standard_normal((4, 3000)).astype(np.float32)
    bias = rng.standard_normal(3000).astype(np.float32)
    expert_out = rng.standard_normal((4, 8, 1500)).astype(np.float32)
    weights = rng.uniform(0, 1, (4, 8)).astype(np.float32)

    def run():
        outs = []
        Y = np.empty((3, 403), np.float32)
        bf16.matmul(W, X, Y)
        outs.append(Y)
        y = np.empty(403, np.float32)
        bf16.matvec(W, X[0], y)
        outs.append(y)
        Ym = np.empty((3, 509), np.float32)
        mxfp4.matmul(packed, scales, Xm, Ym)
        outs.append(Ym)
        S = np.zeros((H, Dk, Dv), np.float32)
        o = np.empty((T, H, Dv), np.float32)
        kda.kda_recurrence(qkv[0], qkv[1], qkv[2], alpha, beta, 0.25, S, o)
        outs += [o, S]
        a = np.empty((4, H, 16), np.float32)
        mla.mla_attention(qn, qr, pos, latent, k_rope, kv_b, 32 ** -0.5, a)
        outs.append(a)
        mix = np.empty((2, 6000), np.float32)
        attnres.attnres(blocks, 3, blocks[3], f, 1e-5, mix)
        outs.append(mix)
        for kern, args in ((norms.rmsnorm, (x, w, 1e-5)), (norms.l2norm, (x, 1e-6))):
            out = np.empty_like(x)
            kern(*args, out)
            outs.append(out)
        sig, st_ = np.empty(10000, np.float32), np.empty(10000, np.float32)
        activations.sigmoid(w, sig)
        activations.situ(x[0], x[1], 4.0, 25.0, st_)
        hist = hist0.copy()
        conv = np.empty_like(u)
        kda.short_conv(u, taps, hist, conv)
        g, al = np.empty_like(z), np.empty_like(z)
        kda.kda_decay(z, a_log, dt_bias, -5.0, g, al)
        idx, wts = np.empty((4, 8), np.int64), np.empty((4, 8), np.float32)
        router.router_topk(logits, bias, 8, True, 2.5, idx, wts)
        comb = np.empty((4, 1500), np.float32)
        moe.combine_routed(expert_out, weights, comb)
        return outs + [sig, st_, hist, conv, g, al, idx, wts, comb]

    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = run()
        numba.set_num_threads(2)
        two = run()
    finally:
        numba.set_num_threads(before)
    for a, b in zip(one, two):
        assert np.array_equal(_bits(a), _bits(b))


def test_team_narrows_small_calls_to_the_calling_thread_and_restores_it():
    """Catches a narrowing that never narrows (every small call wakes the team) or never
    restores (the next big call runs on one thread)."""
    from numba import njit

    from libk3.kernels import team

    @njit
    def inside(work):
        n = team.narrow(work)
        during = team._team_size()
        team.widen(n)
        return n, during, team._team_size()

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has fewer than 2 threads here")
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        assert inside(team.PARALLEL_MIN_WORK - 1) == (2, 1, 2)
        assert inside(team.PARALLEL_MIN_WORK) == (2, 2, 2)
        assert numba.get_num_threads() == 2
    finally:
        numba.set_num_threads(before)


def test_every_parallel_kernel_leaves_the_team_as_it_found_it():
    """Catches a kernel that narrows the team for a small call and never widens it back
    (every later kernel of the pass then ran on one thread)."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has fewer than 2 threads here")
    rng = np.random.default_rng(3)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    H, Dk, Dv, T = 2, 4, 4, 1
    packed, scales = _random_mxfp4(rng, 4, 2, 0.0)
    calls = [
        lambda: bf16.matvec(_finite_bf16(rng, (4, 8)), f32(8), np.empty(4, np.float32)),
        lambda: bf16.matmul(_finite_bf16(rng, (4, 8)), f32(2, 8), np.empty((2, 4), np.float32)),
        lambda: mxfp4.matvec(packed, scales, f32(64), np.empty(4, np.float32)),
        lambda: mxfp4.matmul(packed, scales, f32(2, 64), np.empty((2, 4), np.float32)),
        lambda: norms.rmsnorm(f32(2, 8), f32(8), 1e-5, np.empty((2, 8), np.float32)),
        lambda: norms.l2norm(f32(2, 8), 1e-6, np.empty((2, 8), np.float32)),
        lambda: activations.sigmoid(f32(8), np.empty(8, np.float32)),
        lambda: activations.situ(f32(8), f32(8), 4.0, 25.0, np.empty(8, np.float32)),
        lambda: kda.short_conv(f32(2, 8), f32(8, 4), f32(8, 3), np.empty((2, 8), np.float32)),
        lambda: kda.kda_decay(f32(1, 8), f32(2), f32(8), -5.0, np.empty((1, 8), np.float32),
                              np.empty((1, 8), np.float32)),
        lambda: kda.kda_recurrence(f32(T, H, Dk), f32(T, H, Dk), f32(T, H, Dv),
                                   np.full((T, H, Dk), 0.5, np.float32), f32(T, H),
                                   0.5, np.zeros((H, Dk, Dv), np.float32),
                                   np.empty((T, H, Dv), np.float32)),
        lambda: mla.mla_attention(f32(1, H, 4), f32(1, H, 2), np.array([3]), f32(4, 4),
                                  f32(4, 2), _finite_bf16(rng, (H * 8, 4)) & np.uint16(0xBFFF),
                                  0.5, np.empty((1, H, 4), np.float32)),
        lambda: router.router_topk(f32(1, 8), f32(8), 2, True, 1.0, np.empty((1, 2), np.int64),
                                   np.empty((1, 2), np.float32)),
        lambda: attnres.attnres(f32(2, 1, 8), 1, f32(1, 8), f32(8), 1e-5,
                                np.empty((1, 8), np.float32)),
        lambda: moe.combine_routed(f32(1, 2, 8), f32(1, 2), np.empty((1, 8), np.float32)),
    ]
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        for i, call in enumerate(calls):
            call()
            assert numba.get_num_threads() == 2, f"call {i} left the team narrowed"
    finally:
        numba.set_num_threads(before)
