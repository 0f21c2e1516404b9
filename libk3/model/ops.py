"""Allocating wrappers over the out-parameter numba kernels, shaped for the forward pass.

Owns: output allocation and reshaping only (every number is computed in
``libk3.kernels``). Does not own: any arithmetic. Kept separate so ``forward.py`` reads as
the spec (``y = bf16_matmul(W, x)``) while the kernels stay allocation-free.
"""

from __future__ import annotations

import numpy as np

from ..kernels import activations, attnres as _attnres, bf16, kda, mla, moe, mxfp4, norms, router


def _c(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def bf16_matmul(W, X):
    X = _c(X)
    Y = np.empty((X.shape[0], W.shape[0]), np.float32)
    bf16.matmul(W, X, Y)
    return Y


def mxfp4_matmul(packed, scales, X):
    X = _c(X)
    Y = np.empty((X.shape[0], packed.shape[0]), np.float32)
    mxfp4.matmul(packed, scales, X, Y)
    return Y


def rmsnorm(X, w, eps):
    X = _c(X)
    out = np.empty_like(X)
    norms.rmsnorm(X, _c(w), eps, out)
    return out


def l2norm(X, eps):
    X = _c(X)
    out = np.empty_like(X)
    norms.l2norm(X, eps, out)
    return out


def sigmoid(X):
    X = _c(X)
    out = np.empty_like(X)
    activations.sigmoid(X.reshape(-1), out.reshape(-1))
    return out


def situ(G, U, beta1, beta2):
    G, U = _c(G), _c(U)
    out = np.empty_like(G)
    activations.situ(G.reshape(-1), U.reshape(-1), beta1, beta2, out.reshape(-1))
    return out


def fold_attn_res(norm_w, proj_w):
    """f = n * p in f32 (model.md §5.2, §7.1)."""
    return _c(norm_w).reshape(-1) * _c(proj_w).reshape(-1)


def attn_res(sources, f, eps):
    """AttnRes over sources (list of [T, E]; the last is the partial sum)."""
    prefix = _c(sources[-1])
    n = len(sources) - 1
    blocks = np.stack([_c(s) for s in sources[:-1]]) if n else np.zeros((1,) + prefix.shape, np.float32)
    out = np.empty_like(prefix)
    _attnres.attnres(blocks, n, prefix, f, eps, out)
    return out


def short_conv(u, w, hist):
    """SiLU(conv) over T tokens; ``hist`` ([C, K-1] slice of the state) updated in place."""
    u = _c(u)
    out = np.empty_like(u)
    kda.short_conv(u, _c(w).reshape(w.shape[0], -1), hist, out)
    return out


def kda_decay(z, A_log, dt_bias, lower_bound):
    z = _c(z)
    g = np.empty_like(z)
    alpha = np.empty_like(z)
    kda.kda_decay(z, _c(A_log), _c(dt_bias), lower_bound, g, alpha)
    return alpha


def kda_recurrence(q, k, v, alpha, beta, q_scale, S):
    out = np.empty_like(_c(v))
    kda.kda_recurrence(_c(q), _c(k), _c(v), _c(alpha), _c(beta), q_scale, S, out)
    return out


def mla_attention(q_nope, q_rope, positions, latent, k_rope, kv_b, scale, v_dim):
    T, H = q_nope.shape[0], q_nope.shape[1]
    out = np.empty((T, H, v_dim), np.float32)
    mla.mla_attention(_c(q_nope), _c(q_rope), np.asarray(positions, np.int64), latent, k_rope,
                      kv_b, scale, out)
    return out.reshape(T, H * v_dim)


def route(logits, bias, top_k, renormalize, scaling):
    logits = _c(logits)
    idx = np.empty((logits.shape[0], top_k), np.int64)
    w = np.empty((logits.shape[0], top_k), np.float32)
    router.router_topk(logits, _c(bias), top_k, renormalize, scaling, idx, w)
    return idx, w


def weighted_sum(expert_out, weights):
    out = np.empty((expert_out.shape[0], expert_out.shape[2]), np.float32)
    moe.combine_routed(_c(expert_out), _c(weights), out)
    return out
