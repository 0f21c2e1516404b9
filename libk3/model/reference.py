"""A plain numpy float64 forward of K3, to be read against formats/model/model.md line by line.

Owns: the oracle for the numba kernels and the engine model (model.md §5,
in computation order). It never calls ``libk3.kernels``: it dequantises experts to float,
multiplies with numpy in float64 and loops over time. It is slow and needs every weight
in memory; it is meant for test models only.

Weights come from ``get(name) -> ndarray`` (floats widened, U8 raw), so the same code
serves a Checkpoint, a dict, or conformance vectors. Experts come from
``get_expert(L, e, w) -> [out, in] float64``, by default decoded from the MXFP4 tensors.
"""

from __future__ import annotations

import numpy as np

from .. import names
from ..config import L2NORM_EPS, MLA_LATENT_NORM_EPS, ROUTER_RENORM_EPS, K3Config
from ..io import mxfp4


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def situ(g, u, beta1, beta2):
    """SiTU (model.md §5.0): [b1 tanh(g/b1) sigma(g)] * [b2 tanh(u/b2)]; sigma on UNCAPPED g."""
    return (beta1 * np.tanh(g / beta1) * sigmoid(g)) * (beta2 * np.tanh(u / beta2))


def rmsnorm(x, w, eps):
    """Over the last axis; eps INSIDE the root; mean, not sum."""
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def l2norm(x):
    """Over the last axis; sum, not mean; eps 1e-6 (model.md §5.0)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def attn_res(sources, norm_w, proj_w, eps):
    """AttnRes aggregator (model.md §5.2). sources: list of [T, E]; returns [T, E].
    Keys are RMS-normalised WITHOUT gain; the output mixes the RAW sources."""
    f = norm_w * proj_w.reshape(-1)
    V = np.stack(sources, axis=1)                                   # (T, S, E)
    keys = V / np.sqrt(np.mean(V * V, axis=-1, keepdims=True) + eps)
    scores = keys @ f                                               # (T, S)
    scores = scores - scores.max(axis=1, keepdims=True)
    alpha = np.exp(scores)
    alpha /= alpha.sum(axis=1, keepdims=True)
    return np.einsum("ts,tse->te", alpha, V)


def short_conv(u, w):
    """Causal depthwise conv + SiLU. u: (T, C) pre-activation inputs; w: (C, 1, K) taps
    oldest -> newest (tap K-1 multiplies the current input); zeros before the start."""
    T, C = u.shape
    K = w.shape[-1]
    padded = np.concatenate([np.zeros((K - 1, C)), u], axis=0)
    y = np.zeros((T, C))
    for t in range(T):
        y[t] = np.sum(w[:, 0, :].T * padded[t:t + K], axis=0)
    return silu(y)


def kda_attention(cfg: K3Config, x, W):
    """KDA layer (model.md §5.5). x: (T, E) normalised input; W(suffix) -> float64 weight.
    Returns (y (T, E), final state S (H, D, D))."""
    T = x.shape[0]
    H, D = cfg.num_heads, cfg.head_dim
    q_hat, k_hat, v_hat = (x @ W(f"self_attn.{p}_proj.weight").T for p in "qkv")
    beta_hat = x @ W("self_attn.b_proj.weight").T                    # (T, H)
    z = (x @ W("self_attn.f_a_proj.weight").T) @ W("self_attn.f_b_proj.weight").T
    q = l2norm(short_conv(q_hat, W("self_attn.q_conv1d.weight")).reshape(T, H, D))
    k = l2norm(short_conv(k_hat, W("self_attn.k_conv1d.weight")).reshape(T, H, D))
    v = short_conv(v_hat, W("self_attn.v_conv1d.weight")).reshape(T, H, D)
    beta = sigmoid(beta_hat)                                         # (T, H)
    a_log = W("self_attn.A_log")[:H]                                 # per HEAD
    g = cfg.gate_lower_bound * sigmoid(
        np.exp(a_log)[None, :, None] * (z + W("self_attn.dt_bias")).reshape(T, H, D))
    alpha = np.exp(g)                                                # (T, H, D)
    q_tilde = q * D ** -0.5
    S = np.zeros((H, D, D))
    o = np.zeros((T, H, D))
    for t in range(T):
        S = alpha[t][:, :, None] * S                                 # (a) decay rows
        u = np.einsum("hi,hij->hj", k[t], S)                         # (b) read
        S = S + k[t][:, :, None] * (beta[t][:, None, None] * (v[t] - u)[:, None, :])  # (c)
        o[t] = np.einsum("hi,hij->hj", q_tilde[t], S)                # (d) from updated S
    o = rmsnorm(o, W("self_attn.o_norm.weight"), cfg.rms_norm_eps).reshape(T, H * D)
    gate = sigmoid(x @ W("self_attn.g_proj.weight").T)
    return (o * gate) @ W("self_attn.o_proj.weight").T, S


def mla_attention(cfg: K3Config, x, W, eps_latent=MLA_LATENT_NORM_EPS):
    """Gated MLA, NoPE (model.md §5.6), expanded form. x: (T, E). Returns (y, latent, k_rope)."""
    T = x.shape[0]
    H, nope, rope, vd = (cfg.num_attention_heads, cfg.qk_nope_head_dim,
                         cfg.qk_rope_head_dim, cfg.v_head_dim)
    r = cfg.kv_lora_rank
    cq = rmsnorm(x @ W("self_attn.q_a_proj.weight").T, W("self_attn.q_a_layernorm.weight"),
                 eps_latent)
    q = (cq @ W("self_attn.q_b_proj.weight").T).reshape(T, H, nope + rope)
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    c = x @ W("self_attn.kv_a_proj_with_mqa.weight").T
    latent = rmsnorm(c[:, :r], W("self_attn.kv_a_layernorm.weight"), eps_latent)
    k_rope = c[:, r:]                                                # not normed, not rotated
    kv = (latent @ W("self_attn.kv_b_proj.weight").T).reshape(T, H, nope + vd)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    scores = (np.einsum("thd,shd->hts", q_nope, k_nope)
              + np.einsum("thd,sd->hts", q_rope, k_rope)) * (nope + rope) ** -0.5
    scores = np.where(np.tril(np.ones((T, T), bool))[None], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=2, keepdims=True))
    p /= p.sum(axis=2, keepdims=True)
    out = np.einsum("hts,shd->thd", p, v).reshape(T, H * vd)
    gate = sigmoid(x @ W("self_attn.g_proj.weight").T)
    return (out * gate) @ W("self_attn.o_proj.weight").T, latent, k_rope


def route(cfg: K3Config, x, gate_w, bias):
    """Sigmoid router (model.md §5.8 steps 1-3) for one token x (E,). Returns (ids, weights)
    with ids in descending biased score, ties to the lowest index."""
    s = sigmoid(gate_w @ x)
    biased = s + bias
    order = sorted(range(len(s)), key=lambda i: (-biased[i], i))
    ids = np.array(order[:cfg.num_experts_per_token])
    w = s[ids]
    if cfg.moe_renormalize:
        w = w / (w.sum() + ROUTER_RENORM_EPS)
    return ids, w * cfg.routed_scaling_factor


def latent_moe(cfg: K3Config, x, W, expert):
    """Stable LatentMoE (model.md §5.8). x: (T, E); expert(e, w) -> [out, in] float64.
    Returns (y (T, E), ids (T, k))."""
    b1, b2 = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    gate_w = W("block_sparse_moe.gate.weight")
    bias = W("block_sparse_moe.gate.e_score_correction_bias")
    down = W("block_sparse_moe.routed_expert_down_proj.weight")
    up = W("block_sparse_moe.routed_expert_up_proj.weight")
    y = np.zeros_like(x)
    all_ids = []
    for t in range(x.shape[0]):
        ids, weights = route(cfg, x[t], gate_w, bias)
        all_ids.append(ids)
        z = down @ x[t]
        u = np.zeros(z.shape)
        for e, w in zip(ids, weights):
            h = situ(expert(int(e), "w1") @ z, expert(int(e), "w3") @ z, b1, b2)
            u += w * (expert(int(e), "w2") @ h)
        if cfg.latent_moe_use_norm:
            u = rmsnorm(u, W("block_sparse_moe.routed_expert_norm.weight"), cfg.rms_norm_eps)
        y[t] = up @ u
    if cfg.num_shared_experts > 0:
        sg = x @ W("block_sparse_moe.shared_experts.gate_proj.weight").T
        su = x @ W("block_sparse_moe.shared_experts.up_proj.weight").T
        y += situ(sg, su, b1, b2) @ W("block_sparse_moe.shared_experts.down_proj.weight").T
    return y, np.array(all_ids)


def dense_mlp(cfg: K3Config, x, W):
    """Dense MLP of layer 0 (model.md §5.7)."""
    h = situ(x @ W("mlp.gate_proj.weight").T, x @ W("mlp.up_proj.weight").T,
             cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    return h @ W("mlp.down_proj.weight").T


def decoder_layer(cfg: K3Config, L, prefix, blocks, W, expert):
    """One decoder layer with AttnRes bookkeeping (model.md §5.3). prefix: (T, E) partial sum
    handed over; blocks: list of (T, E) snapshots (mutated: a boundary appends).
    Returns the partial sum this layer hands on."""
    eps = cfg.rms_norm_eps
    p = prefix
    x_a = attn_res(blocks + [p], W("self_attention_res_norm.weight"),
                   W("self_attention_res_proj.weight"), eps) if blocks else p
    empty = False
    if cfg.is_boundary(L):
        blocks.append(p)
        empty = True
    h = rmsnorm(x_a, W("input_layernorm.weight"), eps)
    a = mla_attention(cfg, h, W)[0] if cfg.is_mla(L) else kda_attention(cfg, h, W)[0]
    prefix = a if empty else p + a
    x_m = attn_res(blocks + [prefix], W("mlp_res_norm.weight"), W("mlp_res_proj.weight"), eps)
    h = rmsnorm(x_m, W("post_attention_layernorm.weight"), eps)
    m = dense_mlp(cfg, h, W) if cfg.is_dense(L) else latent_moe(cfg, h, W, expert)[0]
    return prefix + m


def decode_expert(get, L, e, w):
    """[out, in] float64 of routed expert e's matrix w ('w1'|'w2'|'w3'), from MXFP4."""
    return mxfp4.decode(get(names.expert(L, e, w, "weight_packed")),
                        get(names.expert(L, e, w, "weight_scale"))).astype(np.float64)


def forward(cfg: K3Config, get, ids, get_expert=None, on_layer=None):
    """Logits (T, vocab) float64 for token ids from a zero state: row t predicts t+1.
    ``on_layer(L, prefix, blocks)``, if given, sees the AttnRes state after each layer."""
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    if get_expert is None:
        get_expert = lambda L, e, w: decode_expert(get, L, e, w)  # noqa: E731
    ids = np.asarray(ids, dtype=np.int64)
    prefix = f64(get(names.EMBED))[ids]
    blocks: list = []
    for L in range(cfg.num_hidden_layers):
        W = lambda sfx, L=L: f64(get(names.layer(L, sfx)))  # noqa: E731
        expert = lambda e, w, L=L: get_expert(L, e, w)  # noqa: E731
        prefix = decoder_layer(cfg, L, prefix, blocks, W, expert)
        if on_layer is not None:
            on_layer(L, prefix, list(blocks))
    h = attn_res(blocks + [prefix], f64(get(names.OUTPUT_ATTN_RES_NORM)),
                 f64(get(names.OUTPUT_ATTN_RES_PROJ)), cfg.rms_norm_eps)
    return rmsnorm(h, f64(get(names.NORM)), cfg.rms_norm_eps) @ f64(get(names.LM_HEAD)).T
