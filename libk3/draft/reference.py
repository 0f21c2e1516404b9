"""A plain numpy float64 forward of the DSpark draft, to be read against formats/model/dspark.md.

Owns: the oracle for ``libk3.draft.forward`` (formats/model/dspark.md §5.1-§5.7, in computation
order): context ingestion, one block pass, the head with its Markov unroll and confidence.
It never calls ``libk3.kernels``: every product is numpy in float64, attention is the
expanded form (k_nope and v materialised per key, the softmax over an explicit key set),
and RoPE is written out as pair rotations. It is slow and meant for test drafts only.

Weights come from ``get(name) -> ndarray`` with bare draft tensor names (floats, BF16
already widened), as ``libk3.model.reference`` takes them; the target's lm_head and
embedding rows are passed in as arrays.
"""

from __future__ import annotations

import numpy as np

from ..model.reference import rmsnorm, sigmoid, silu
from .config import DraftConfig


def _f64(a):
    return np.asarray(a, dtype=np.float64)


def rope(cfg: DraftConfig, x, positions):
    """Interleaved rotation (formats/model/dspark.md §5.4): pair (x[2i], x[2i+1]) of row t turns by
    positions[t] * inv_freq[i], cos and sin times the YaRN amplitude. x: (T, ..., rope)."""
    x = _f64(x)
    inv_freq = np.asarray(cfg.rope_inv_freq(), dtype=np.float64)        # (half,)
    angle = _f64(positions)[:, None] * inv_freq[None, :]                 # (T, half)
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (inv_freq.shape[0],)
    c = (np.cos(angle) * cfg.rope_amplitude()).reshape(shape)
    s = (np.sin(angle) * cfg.rope_amplitude()).reshape(shape)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def kv_rows(cfg: DraftConfig, get, layer: int, x, positions):
    """The [latent | k_pe] key form of rows x (T, E) of draft layer ``layer``
    (dspark.md §5.1 and §5.3, step 3 of each): (latent (T, kv_lora) RMS-normed,
    k_pe (T, rope) rotated at ``positions``)."""
    W = lambda sfx: _f64(get(f"layers.{layer}.self_attn.{sfx}"))  # noqa: E731
    r = cfg.kv_lora_rank
    c = _f64(x) @ W("kv_a_proj_with_mqa.weight").T                   # (T, r + rope)
    latent = rmsnorm(c[:, :r], W("kv_a_layernorm.weight"), cfg.rms_norm_eps)
    return latent, rope(cfg, c[:, r:], positions)


def ingest(cfg: DraftConfig, get, taps, positions):
    """Context cache rows for committed positions (formats/model/dspark.md §5.1).

    taps: (n, n_taps * target_hidden), the tapped target states of each position in
    ascending layer order. positions: (n,) absolute. Returns (layers, n, cache_width)
    float64, each row [latent | rotated k_pe]. No input_layernorm is applied to u."""
    taps = _f64(taps)
    n, th = taps.shape[0], cfg.target_hidden_size
    if cfg.fc_norm:                    # dspark.md §2.2: each tap normed on its own
        taps = np.concatenate([rmsnorm(taps[:, i * th:(i + 1) * th],
                                       _f64(get(f"fc_norm.{i}.weight")), cfg.rms_norm_eps)
                               for i in range(cfg.n_taps)], axis=1)
    u = rmsnorm(taps @ _f64(get("context_proj.weight")).T, _f64(get("context_norm.weight")),
                cfg.rms_norm_eps)                                      # (n, E)
    out = np.empty((cfg.num_hidden_layers, n, cfg.cache_width))
    for layer in range(cfg.num_hidden_layers):
        latent, k_pe = kv_rows(cfg, get, layer, u, positions)
        out[layer] = np.concatenate([latent, k_pe], axis=1)
    return out


def attention(cfg: DraftConfig, get, layer: int, x, positions, context):
    """Draft MLA of the normed block rows x (T, E) (dspark.md §5.3 steps 2-6): every row
    attends to every context row and to every block row (non-causal inside the block); no
    output gate. context: (p, cache_width) rows of this layer. Returns W_o . out, (T, E)."""
    W = lambda sfx: _f64(get(f"layers.{layer}.self_attn.{sfx}"))  # noqa: E731
    T = x.shape[0]
    H, nope, rd, vd = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                       cfg.v_head_dim)
    r = cfg.kv_lora_rank
    cq = rmsnorm(x @ W("q_a_proj.weight").T, W("q_a_layernorm.weight"), cfg.rms_norm_eps)
    q = (cq @ W("q_b_proj.weight").T).reshape(T, H, nope + rd)
    q_nope, q_pe = q[..., :nope], rope(cfg, q[..., nope:], positions)
    latent, k_pe = kv_rows(cfg, get, layer, x, positions)
    keys_latent = np.concatenate([_f64(context)[:, :r], latent])     # (S, r)
    keys_pe = np.concatenate([_f64(context)[:, r:], k_pe])           # (S, rope)
    kv = (keys_latent @ W("kv_b_proj.weight").T).reshape(-1, H, nope + vd)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    scores = (np.einsum("thd,shd->hts", q_nope, k_nope)
              + np.einsum("thd,sd->hts", q_pe, keys_pe)) * cfg.softmax_scale()
    p = np.exp(scores - scores.max(axis=2, keepdims=True))
    p /= p.sum(axis=2, keepdims=True)
    out = np.einsum("hts,shd->thd", p, v).reshape(T, H * vd)
    return out @ W("o_proj.weight").T


def block(cfg: DraftConfig, get, embed_rows, p: int, cache):
    """The final-normed hidden states (block_size, E) of one block pass
    (dspark.md §5.2, §5.3, §5.5).

    embed_rows: (block_size, E), the target's embedding rows of [anchor, mask, ...].
    p: the anchor's position; block row k sits at p + k. cache: (layers, p, cache_width)
    context rows for positions 0..p-1 (from ``ingest``)."""
    h = _f64(embed_rows)
    positions = p + np.arange(h.shape[0])
    eps = cfg.rms_norm_eps
    for layer in range(cfg.num_hidden_layers):
        W = lambda sfx: _f64(get(f"layers.{layer}.{sfx}"))  # noqa: E731
        x = rmsnorm(h, W("input_layernorm.weight"), eps)
        h = h + attention(cfg, get, layer, x, positions, _f64(cache)[layer, :p])
        y = rmsnorm(h, W("post_attention_layernorm.weight"), eps)
        g, u = y @ W("mlp.gate_proj.weight").T, y @ W("mlp.up_proj.weight").T
        h = h + (silu(g) * u) @ W("mlp.down_proj.weight").T
    return rmsnorm(h, _f64(get("final_norm.weight")), eps)


def head(cfg: DraftConfig, get, lm_head, hidden, anchor: int, n: int | None = None, pick=None):
    """Proposals from the final-normed block rows (dspark.md §5.5-§5.7).

    hidden: (block_size, E) from ``block``; lm_head: the target's [V, E]. The Markov unroll
    runs left to right from prev_0 = anchor: logits_k = base_k + W2 . W1[prev_k], the token
    d = pick(k, logits_k) (default: the first argmax), prev_(k+1) = d. The confidence
    c_k = sigmoid(w . [hidden_k ; W1[prev_k]] + b) (ones when the draft has no head).
    Returns (tokens (n,), base (n, V), logits (n, V), confidence (n,))."""
    hidden = _f64(hidden)
    n = hidden.shape[0] if n is None else n
    base = hidden[:n] @ _f64(lm_head).T                               # (n, V)
    W1 = _f64(get("markov_head.markov_w1.weight"))
    W2 = _f64(get("markov_head.markov_w2.weight"))
    logits = np.empty_like(base)
    confidence = np.ones(n)
    tokens = []
    prev = int(anchor)
    for k in range(n):
        logits[k] = base[k] + W2 @ W1[prev]
        if cfg.enable_confidence_head:
            feat = np.concatenate([hidden[k], W1[prev]]) if cfg.confidence_head_with_markov \
                else hidden[k]
            z = _f64(get("confidence_head.proj.weight")).reshape(-1) @ feat \
                + _f64(get("confidence_head.proj.bias")).reshape(-1)[0]
            confidence[k] = sigmoid(z)
        prev = int(np.argmax(logits[k])) if pick is None else int(pick(k, logits[k]))
        tokens.append(prev)
    return np.array(tokens, dtype=np.int64), base, logits, confidence


def propose(cfg: DraftConfig, get, embed, lm_head, cache, anchor: int, n: int, pick=None):
    """``block`` then ``head`` for the block [anchor, mask x (block_size - 1)] right after
    the context in ``cache`` (layers, p, cache_width); embed(ids) -> (len(ids), E)."""
    p = _f64(cache).shape[1]
    ids = [int(anchor)] + [cfg.mask_token_id] * (cfg.block_size - 1)
    hidden = block(cfg, get, embed(ids), p, cache)
    return head(cfg, get, lm_head, hidden, anchor, n, pick)
