"""The KDA-specific kernels: short convolution, decay, delta-rule recurrence (model.md §5.5).

Owns: ``short_conv`` (causal depthwise conv + fused SiLU with a decode history),
``kda_decay`` (g and alpha from the low-rank decay input), ``kda_recurrence`` (the
per-head state update and read-out over T tokens). Does not own: projections
(``bf16.py``), the L2 norms of q and k (``norms.py``), beta = sigmoid(b_proj x)
(``activations.py``), the head-wise o_norm and the output gate; nor the composition
(``libk3.model``).

Everything here is float32 in a fixed loop order (model.md §7.2 last row). Prefill and decode
run the same recurrent loop, so feeding tokens one at a time reproduces a T-token call
bit for bit (model.md §5.5, last paragraph; the official chunked WY form would not).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import team

from .activations import sigmoid1, silu1


@njit(cache=True, parallel=True)
def short_conv(u, w, hist, out):
    """Causal depthwise convolution with fused SiLU over T tokens, carrying a history.

    u: [T, C] float32, the projection outputs (PRE-activation). w: [C, K] float32, taps
    oldest -> newest (tap K-1 multiplies the current input; the checkpoint's [C, 1, K]
    reshaped). hist: [C, K-1] float32, in/out: the K-1 inputs before u[0], oldest first
    (zeros at sequence start); on return, the last K-1 inputs (of hist followed by u).
    out: [T, C] float32, written.

    out[t, c] = SiLU(acc) with acc = w[c, K-1] * u[t, c], then acc += w[c, j] * u_(t-K+1+j)
    for j = 0..K-2 in that order, all f32 (model.md §7.2: "w3 * cur first, then + w0 h0 +
    w1 h1 + w2 h2"). Must not become: reversed taps, SiLU on the inputs, a history of
    outputs instead of inputs, or a history that is written but not read."""
    T, C = u.shape
    K = w.shape[1]
    if w.shape[0] != C or hist.shape[0] != C or hist.shape[1] != K - 1 \
            or out.shape[0] != T or out.shape[1] != C:
        raise ValueError("short_conv: u, out [T, C]; w [C, K]; hist [C, K-1]")
    nt = team.narrow(T * C * K * 4)
    for c in prange(C):
        for t in range(T):
            acc = w[c, K - 1] * u[t, c]
            for j in range(K - 1):
                tau = t - (K - 1) + j
                if tau >= 0:
                    acc += w[c, j] * u[tau, c]
                else:
                    acc += w[c, j] * hist[c, tau + K - 1]
            out[t, c] = silu1(acc)
        # new history: inputs at tau = T-K+1 .. T-1; ascending i reads old hist[i + T]
        # (i + T > i) before it could be overwritten.
        for i in range(K - 1):
            tau = T - (K - 1) + i
            if tau >= 0:
                hist[c, i] = u[tau, c]
            else:
                hist[c, i] = hist[c, i + T]
    team.widen(nt)


@njit(cache=True, parallel=True)
def kda_decay(z, A_log, dt_bias, lower_bound, g_out, alpha_out):
    """g = lower_bound * sigmoid(f32(exp(A_log[h])) * (z + dt_bias)); alpha = exp(g).

    z: [T, H*D] float32 (f_b(f_a(x)), before dt_bias). A_log: [H] float32, indexed PER
    HEAD (h = channel // D). dt_bias: [H*D] float32. lower_bound: float (-5).
    g_out, alpha_out: [T, H*D] float32, written. All f32 with libm exp (model.md §5.5 step 5).
    sigmoid underflowing to 0 gives g = -0 and alpha = 1 exactly: legal.
    Must not become: A_log per channel, a missing dt_bias, the softplus form."""
    T, P = z.shape
    H = A_log.shape[0]
    if P % H != 0 or dt_bias.shape[0] != P or g_out.shape[0] != T or g_out.shape[1] != P \
            or alpha_out.shape[0] != T or alpha_out.shape[1] != P:
        raise ValueError("kda_decay: z, g_out, alpha_out [T, H*D]; A_log [H]; dt_bias [H*D]")
    D = P // H
    lb = np.float32(lower_bound)
    nt = team.narrow(T * P * 2 * team.TRANSCENDENTAL)
    for tc in prange(T * P):                    # elements are independent (decode: T = 1)
        t = tc // P
        c = tc % P
        a = math.exp(A_log[c // D])
        g = lb * sigmoid1(a * (z[t, c] + dt_bias[c]))
        g_out[t, c] = g
        alpha_out[t, c] = math.exp(g)
    team.widen(nt)


@njit(cache=True, parallel=True)
def kda_recurrence(q, k, v, alpha, beta, q_scale, S, out):
    """Delta-rule recurrence over T tokens, per head, in the order of model.md §5.5 step 7.

    q, k: [T, H, Dk] float32 (q NOT pre-scaled; k used as given). v: [T, H, Dv] float32.
    alpha: [T, H, Dk] float32 (per key channel). beta: [T, H] float32 (per head).
    q_scale: float (Dk^-0.5). S: [H, Dk, Dv] float32, in/out (rows = key channel i,
    columns = value channel j). out: [T, H, Dv] float32, written.

    Per token and head, all f32, loops in increasing index:
      (a) S[i, j] = alpha_i * S[i, j]
      (b) u_j = sum_i k_i * S[i, j]                       (sequential in i, from +0)
      (c) d_j = v_j - u_j;  S[i, j] = S[i, j] + (k_i * beta) * d_j
      (d) o_j = sum_i (q_i * q_scale) * S[i, j]           (from the UPDATED S)
    (a)+(b) and (c)+(d) are fused row by row; each element sees the same operations in
    the same order as four separate passes. Heads run in parallel, never one sum.
    Must not become: any other order of (a)-(d), the output read before the write, a
    transposed S, beta per channel, alpha along the value axis."""
    T, H, Dk = q.shape
    Dv = v.shape[2]
    if k.shape[0] != T or k.shape[1] != H or k.shape[2] != Dk \
            or v.shape[0] != T or v.shape[1] != H \
            or alpha.shape[0] != T or alpha.shape[1] != H or alpha.shape[2] != Dk \
            or beta.shape[0] != T or beta.shape[1] != H \
            or S.shape[0] != H or S.shape[1] != Dk or S.shape[2] != Dv \
            or out.shape[0] != T or out.shape[1] != H or out.shape[2] != Dv:
        raise ValueError("kda_recurrence: q, k, alpha [T, H, Dk]; v, out [T, H, Dv]; "
                         "beta [T, H]; S [H, Dk, Dv]")
    qs = np.float32(q_scale)
    zero = np.float32(0.0)
    nt = team.narrow(T * H * Dk * Dv * 8)
    for h in prange(H):
        d = np.empty(Dv, dtype=np.float32)
        Sh = S[h]
        for t in range(T):
            o = out[t, h]
            for j in range(Dv):
                d[j] = zero
            for i in range(Dk):                         # (a) decay, (b) read
                a_i = alpha[t, h, i]
                k_i = k[t, h, i]
                for j in range(Dv):
                    s = a_i * Sh[i, j]
                    Sh[i, j] = s
                    d[j] += k_i * s
            for j in range(Dv):                         # d = v - u
                d[j] = v[t, h, j] - d[j]
                o[j] = zero
            b = beta[t, h]
            for i in range(Dk):                         # (c) write, (d) output
                kb = k[t, h, i] * b
                qt = q[t, h, i] * qs
                for j in range(Dv):
                    s = Sh[i, j] + kb * d[j]
                    Sh[i, j] = s
                    o[j] += qt * s
    team.widen(nt)
