"""Elementwise activations in float32 with libm semantics (model.md §5.0, §7.3).

Owns: ``sigmoid``/``silu`` as scalar device functions, ``sigmoid``, ``situ`` (K3's
SiTU-GLU product), ``silu_mul`` (the DSpark draft's SiLU-gated product) and the image
tower's two GELUs ``gelu_tanh`` and ``gelu_erf`` (formats/model/vision.md §5.5) as array
kernels, ``softmax_f32``.
Does not own: where the betas come from (config ``situ_beta``, ``situ_linear_beta``).

WHY scalar ``math.exp``/``math.tanh`` on float32 inside numba: they call the C library's
``expf`` and ``tanhf`` (as the public C engine does; tested against libm); numpy's
vectorised float32 ``np.exp``/``np.tanh`` differ from libm by a few ulp, and the MoE
conformance vectors then fail where the libm form passes (tests/test_kernels_conformance.py).
Never fastmath, never a float64 SiTU (it fails them too).

All kernels take 1-D float32 arrays; pass ``a.reshape(-1)`` of a contiguous [T, n] array.
Elements are independent, so ``prange`` cannot change a result.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import team

_ONE = np.float32(1.0)


@njit(cache=True, inline="always")
def sigmoid1(x):
    """f32 sigmoid(x) = 1 / (1 + expf(-x)), x float32. exp(-x) overflows to inf for
    x < -88.7 and the result is then +0.0: legal, not an error."""
    return _ONE / (_ONE + math.exp(-x))


@njit(cache=True, inline="always")
def silu1(x):
    """f32 SiLU(x) = x * sigmoid(x)."""
    return x * sigmoid1(x)


@njit(cache=True, inline="always")
def situ1(g, u, beta1, beta2):
    """f32 SiTU(g, u) = [(b1 * tanh(g / b1)) * sigmoid(g)] * [b2 * tanh(u / b2)].

    beta1, beta2: float32 (4 and 25 in K3). sigmoid takes the UNCAPPED g. |result| <=
    b1 * b2. Must not become: sigmoid of the capped gate, caps omitted (indistinguishable
    in the near-linear regime), gate and up swapped."""
    a = (beta1 * math.tanh(g / beta1)) * sigmoid1(g)
    b = beta2 * math.tanh(u / beta2)
    return a * b


@njit(cache=True, parallel=True)
def sigmoid(x, out):
    """out[i] = sigmoid1(x[i]); x, out: [n] float32 (out may be x)."""
    if out.shape[0] != x.shape[0]:
        raise ValueError("sigmoid: x and out must have the same length")
    nt = team.narrow(x.shape[0] * team.TRANSCENDENTAL)
    for i in prange(x.shape[0]):
        out[i] = sigmoid1(x[i])
    team.widen(nt)


@njit(cache=True, parallel=True)
def situ(gate, up, beta1, beta2, out):
    """out[i] = situ1(gate[i], up[i], f32(beta1), f32(beta2)).

    gate, up, out: [n] float32 (out may alias either). beta1, beta2: floats. model.md §5.0,
    5.7, 5.8 (dense MLP, routed experts, shared expert)."""
    n = gate.shape[0]
    if up.shape[0] != n or out.shape[0] != n:
        raise ValueError("situ: gate, up and out must have the same length")
    b1 = np.float32(beta1)
    b2 = np.float32(beta2)
    nt = team.narrow(n * 2 * team.TRANSCENDENTAL)
    for i in prange(n):
        out[i] = situ1(gate[i], up[i], b1, b2)
    team.widen(nt)


@njit(cache=True, inline="always")
def softmax_f32(p, n):
    """In place over p[0:n] (float32): e_s = f32 expf(p_s - max), z = f64 sum of e_s in
    increasing s, p_s = f32(e_s / z) (model.md §7.2, AttnRes and MLA alike). Must not become:
    a float32 sum, a vectorised exp, or a sum order that depends on threads."""
    m = p[0]
    for s in range(1, n):
        if p[s] > m:
            m = p[s]
    z = 0.0
    for s in range(n):
        e = math.exp(p[s] - m)
        p[s] = e
        z += np.float64(e)
    for s in range(n):
        p[s] = np.float32(np.float64(p[s]) / z)


@njit(cache=True, parallel=True)
def silu_mul(gate, up, out):
    """out[i] = f32(silu1(gate[i]) * up[i]): the SiLU-gated MLP product of the DSpark
    draft (formats/model/dspark.md §5.3 step 7), every operation f32 (formats/model/numerics.md
    sections 5 and 11: SiLU(g) = g * sigmoid(g), then times u).

    gate, up, out: [n] float32 (out may alias either). Must not become: SiLU of the up
    projection (gate and up swapped), a float64 SiLU, or K3's SiTU (the draft's MLP is
    plain SiLU, uncapped)."""
    n = gate.shape[0]
    if up.shape[0] != n or out.shape[0] != n:
        raise ValueError("silu_mul: gate, up and out must have the same length")
    nt = team.narrow(n * team.TRANSCENDENTAL)
    for i in prange(n):
        out[i] = silu1(gate[i]) * up[i]
    team.widen(nt)


_HALF = np.float32(0.5)
_TANH_K = np.float32(math.sqrt(2.0 / math.pi))
_TANH_C = np.float32(0.044715)
_RSQRT2 = np.float32(1.0 / math.sqrt(2.0))


@njit(cache=True, parallel=True)
def gelu_tanh(x, out):
    """out[i] = f32 0.5 u (1 + tanhf(k (u + c u³))), u = x[i], k = f32(sqrt(2 / pi)),
    c = f32(0.044715), each operation f32, left to right: u³ = (u u) u, inner = k (u + c u³),
    out = (0.5 u) (1 + tanhf(inner)). The tower's MLP (formats/model/vision.md §5.5).

    x, out: [n] float32 (out may be x). Must not become: the erf GELU (the projector's;
    they differ by up to 4.7e-4), a float64 evaluation, or numpy's vectorised tanh."""
    if out.shape[0] != x.shape[0]:
        raise ValueError("gelu_tanh: x and out must have the same length")
    nt = team.narrow(x.shape[0] * team.TRANSCENDENTAL)
    for i in prange(x.shape[0]):
        u = x[i]
        inner = _TANH_K * (u + _TANH_C * ((u * u) * u))
        out[i] = (_HALF * u) * (_ONE + math.tanh(inner))
    team.widen(nt)


@njit(cache=True, parallel=True)
def gelu_erf(x, out):
    """out[i] = f32 (0.5 u) (1 + erff(u · f32(1 / sqrt 2))), u = x[i], each operation f32:
    the exact GELU of the projector (formats/model/vision.md §6.2).

    x, out: [n] float32 (out may be x). Must not become: the tanh GELU (the tower's)."""
    if out.shape[0] != x.shape[0]:
        raise ValueError("gelu_erf: x and out must have the same length")
    nt = team.narrow(x.shape[0] * team.TRANSCENDENTAL)
    for i in prange(x.shape[0]):
        u = x[i]
        out[i] = (_HALF * u) * (_ONE + math.erf(u * _RSQRT2))
    team.widen(nt)
