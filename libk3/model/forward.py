"""The engine's K3 forward pass: model.md §5 composed from numba kernels.

Owns: the order of operations of one forward pass over new tokens against a weight
provider: T tokens of one sequence (prefill T > 1, decode T = 1), or several sequences in
lockstep (``Forward.run``: one ``Segment`` per sequence, each with its own State). Does
not own: where weights come from (resident, streamed, cached: ``libk3.model.weights`` and
``libk3.stream``), the math inside each op (``libk3.kernels``), sampling or scheduling.

A pass over several sequences stacks their tokens into one block: every op that applies
weights (projections, norms, AttnRes, router, experts, lm_head) runs once over the block,
so a layer's trunk is fetched once per pass and each routed expert once for all the
tokens that chose it (the union over the sequences); only what reads a sequence's own
state (short conv, KDA recurrence, MLA cache and attention) runs per sequence.

Same answer everywhere: every op computes each token's values with the same accumulation
order whether it runs for one token or a block, so prefill, chunked prefill, incremental
decode, full re-forward and a pass shared with other sequences give bit-identical
logits; and nothing here depends on the budget or the thread count.
"""

from __future__ import annotations

import time

import numpy as np

from . import ops as K
from ..config import K3Config, L2NORM_EPS, MLA_LATENT_NORM_EPS
from ..errors import NonFiniteError
from .state import State


def _require_finite(x: np.ndarray, L, where: str) -> None:
    """Stop on NaN/Inf instead of sampling from it, or routing on it (a NaN score is never
    selected, or leaves a pick empty: id -1): one read-only reduction per layer output
    and per router, so no value changes (bench/README.md "Pack integrity" has its cost)."""
    if not np.isfinite(x).all():
        raise _nonfinite(L, where)


def _nonfinite(L, where: str) -> NonFiniteError:
    return NonFiniteError(
        f"layer {L} produced NaN or Inf (in {where}; every earlier layer's output was finite)"
        if L is not None else
        f"{where} hold NaN or Inf (every layer's output was finite: the final norm or lm_head)",
        hint="the weights or the loaded state are damaged: k3-pack verify PACK --against "
             "MODEL names NaN/Inf tensors")


class Segment:
    """One sequence's share of a pass: its new token ids, its State, whether every fed
    position's logits are wanted (else the last one's), the phase (trace records) and an
    opaque ``tag`` handed to ``on_route`` (k3-run: which prompt of a batch)."""

    __slots__ = ("ids", "state", "all_logits", "phase", "tag", "r0", "r1", "positions")

    def __init__(self, ids, state: State, all_logits: bool = True, phase: str = "prefill",
                 tag=None):
        self.ids = np.asarray(ids, dtype=np.int64)
        self.state, self.all_logits, self.phase, self.tag = state, all_logits, phase, tag


class Forward:
    """``Forward(cfg, weights)(ids, state)`` -> float32 logits for the fed positions.

    ``weights`` provides ``model()`` (dict of model-level arrays), ``embed(ids)`` (rows of
    the embedding widened to f32), ``layer(L)`` (mapping
    suffix -> array: BF16 matrices as uint16 bits, vectors as float32), ``release(L)``,
    and ``experts(L, ids)`` (expert id -> tuple of six uint8 arrays in EXPERT_PARTS order).
    ``on_route(L, positions, ids, phase, tag)`` if given is called with each MoE layer's
    routing, once per sequence of the pass.
    ``expert_union[L]`` sums, over passes, the distinct experts layer L fetched
    (``passes`` counts the passes): the union the sequences of a pass share.
    """

    def __init__(self, cfg: K3Config, weights, on_route=None):
        self.cfg = cfg
        self.weights = weights
        self.on_route = on_route
        self.layer_seconds = [0.0] * cfg.num_hidden_layers    # wall time per layer (bench)
        self.first_layer_time = None          # time.time() the first layer started (report)
        self._head = None                     # (lm_head, norm, out_fold), asked for lazily
        self.expert_union = [0] * cfg.num_hidden_layers   # distinct experts fetched (bench)
        self.passes = 0

    def head(self):
        """(lm_head, final norm, folded output AttnRes vector). Asked for only after the
        first pass's layers, so a provider may still be reading them (weights.py)."""
        if self._head is None:
            m = self.weights.model()
            self._head = (m["lm_head"], m["norm"],
                          K.fold_attn_res(m["output_attn_res_norm"], m["output_attn_res_proj"]))
        return self._head

    def __call__(self, ids, state: State, all_logits: bool = True, phase: str = "prefill"):
        """Float32 logits [T or 1, V] for ``ids`` fed to one sequence's ``state``."""
        return self.run([Segment(ids, state, all_logits, phase)])[0]

    def run(self, segments: list) -> list:
        """One pass over several sequences (each Segment's State is its own, never shared
        by two segments); returns each segment's logits, as ``__call__`` would alone."""
        cfg = self.cfg
        live, r = [], 0
        for seg in segments:
            T = seg.ids.shape[0]
            if T and (seg.ids.min() < 0 or seg.ids.max() >= cfg.vocab_size):
                raise ValueError(f"token id outside 0..{cfg.vocab_size - 1}")
            seg.r0, seg.r1 = r, r + T
            r += T
            if T:
                live.append(seg)
        if len({id(seg.state) for seg in segments}) != len(segments):
            raise ValueError("two segments of one pass share a State")
        if not live:
            return [np.zeros((0, cfg.vocab_size), np.float32) for _ in segments]
        for seg in live:
            seg.state.reserve(seg.r1 - seg.r0)
            seg.positions = np.arange(seg.state.pos, seg.state.pos + seg.r1 - seg.r0,
                                      dtype=np.int64)
        ids = live[0].ids if len(live) == 1 else np.concatenate([s.ids for s in live])
        prefix = self.weights.embed(ids)                             # (T, E) f32
        blocks: list = []
        if self.first_layer_time is None:
            self.first_layer_time = time.time()
        for L in range(cfg.num_hidden_layers):
            t0 = time.perf_counter()
            lw = self.weights.layer(L)
            try:
                prefix = self._layer(L, lw, prefix, blocks, live)
            finally:
                self.weights.release(L)
            _require_finite(prefix, L, "its output")
            self.layer_seconds[L] += time.perf_counter() - t0
        self.passes += 1
        lm_head, norm, out_fold = self.head()
        h = K.attn_res(blocks + [prefix], out_fold, cfg.rms_norm_eps)
        # rows whose logits are wanted: all of a segment's, or its last
        rows = [np.arange(s.r0, s.r1) if s.all_logits else np.array([s.r1 - 1]) for s in live]
        if len(live) == 1 and live[0].all_logits:
            picked = h
        else:
            picked = h[np.concatenate(rows)]
        x = K.rmsnorm(picked, norm, cfg.rms_norm_eps)
        logits = K.bf16_matmul(lm_head, x)                           # (rows, V)
        _require_finite(logits, None, "the logits")
        out, at = {}, 0
        for seg, rr in zip(live, rows):
            out[id(seg)] = logits[at:at + rr.size]
            at += rr.size
            seg.state.pos += seg.r1 - seg.r0
            seg.state.ids.extend(int(i) for i in seg.ids)
        return [out.get(id(seg), np.zeros((0, cfg.vocab_size), np.float32))
                for seg in segments]

    @staticmethod
    def _per_seq(segs, X, fn):
        """fn(segment, its rows of X) for each sequence, stacked back in row order."""
        if len(segs) == 1:
            return fn(segs[0], X)
        return np.concatenate([fn(s, X[s.r0:s.r1]) for s in segs])

    # ---- one decoder layer (model.md §5.3) -------------------------------------------
    def _layer(self, L, lw, prefix, blocks, segs):
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        p = prefix
        if blocks:
            x_a = K.attn_res(blocks + [p], K.fold_attn_res(lw["self_attention_res_norm.weight"],
                             lw["self_attention_res_proj.weight"]), eps)
        else:
            x_a = p
        empty = False
        if cfg.is_boundary(L):
            blocks.append(p)
            empty = True
        h = K.rmsnorm(x_a, lw["input_layernorm.weight"], eps)
        if cfg.is_mla(L):
            a = self._mla(L, lw, h, segs)
        else:
            a = self._kda(L, lw, h, segs)
        prefix = a if empty else p + a
        x_m = K.attn_res(blocks + [prefix], K.fold_attn_res(lw["mlp_res_norm.weight"],
                         lw["mlp_res_proj.weight"]), eps)
        h = K.rmsnorm(x_m, lw["post_attention_layernorm.weight"], eps)
        if cfg.is_dense(L):
            m = self._dense(lw, h)
        else:
            m = self._moe(L, lw, h, segs)
        return prefix + m

    # ---- KDA (model.md §5.5) ---------------------------------------------------------
    def _kda(self, L, lw, x, segs):
        cfg = self.cfg
        T = x.shape[0]
        H, D = cfg.num_heads, cfg.head_dim
        q_hat = K.bf16_matmul(lw["self_attn.q_proj.weight"], x)          # (T, P)
        k_hat = K.bf16_matmul(lw["self_attn.k_proj.weight"], x)
        v_hat = K.bf16_matmul(lw["self_attn.v_proj.weight"], x)
        beta = K.sigmoid(K.bf16_matmul(lw["self_attn.b_proj.weight"], x))  # (T, H)
        z = K.bf16_matmul(lw["self_attn.f_b_proj.weight"],
                          K.bf16_matmul(lw["self_attn.f_a_proj.weight"], x))  # (T, P)

        def conv(u, j, w):                  # each sequence through its own history
            return self._per_seq(segs, u, lambda s, u_s: K.short_conv(u_s, w,
                                                                       s.state.kda_conv[L][j]))
        q = conv(q_hat, 0, lw["self_attn.q_conv1d.weight"])
        k = conv(k_hat, 1, lw["self_attn.k_conv1d.weight"])
        v = conv(v_hat, 2, lw["self_attn.v_conv1d.weight"])
        q = K.l2norm(q.reshape(T * H, D), L2NORM_EPS).reshape(T, H, D)
        k = K.l2norm(k.reshape(T * H, D), L2NORM_EPS).reshape(T, H, D)
        v = v.reshape(T, H, D)
        alpha = K.kda_decay(z, lw["self_attn.A_log"][:H], lw["self_attn.dt_bias"],
                            cfg.gate_lower_bound).reshape(T, H, D)
        o = self._per_seq(segs, q, lambda s, q_s: K.kda_recurrence(   # each S updated
            q_s, k[s.r0:s.r1], v[s.r0:s.r1], alpha[s.r0:s.r1], beta[s.r0:s.r1], D ** -0.5,
            s.state.kda_S[L]))
        o = K.rmsnorm(o.reshape(T * H, D), lw["self_attn.o_norm.weight"], cfg.rms_norm_eps)
        gate = K.sigmoid(K.bf16_matmul(lw["self_attn.g_proj.weight"], x))
        return K.bf16_matmul(lw["self_attn.o_proj.weight"], o.reshape(T, H * D) * gate)

    # ---- gated MLA, latent form (model.md §5.6) --------------------------------------
    def _mla(self, L, lw, x, segs):
        cfg = self.cfg
        T = x.shape[0]
        H, nope, rope, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim,
                            cfg.qk_rope_head_dim, cfg.kv_lora_rank)
        cq = K.rmsnorm(K.bf16_matmul(lw["self_attn.q_a_proj.weight"], x),
                       lw["self_attn.q_a_layernorm.weight"], MLA_LATENT_NORM_EPS)
        q = K.bf16_matmul(lw["self_attn.q_b_proj.weight"], cq).reshape(T, H, nope + rope)
        c = K.bf16_matmul(lw["self_attn.kv_a_proj_with_mqa.weight"], x)  # (T, r + rope)
        latent = K.rmsnorm(np.ascontiguousarray(c[:, :r]), lw["self_attn.kv_a_layernorm.weight"],
                           MLA_LATENT_NORM_EPS)

        def attend(s, q_s):                 # one sequence: append to its cache, attend
            p0, n = int(s.positions[0]), s.r1 - s.r0
            s.state.mla_latent[L][p0:p0 + n] = latent[s.r0:s.r1]
            s.state.mla_rope[L][p0:p0 + n] = c[s.r0:s.r1, r:]
            return K.mla_attention(q_s[..., :nope], q_s[..., nope:], s.positions,
                                   s.state.mla_latent[L], s.state.mla_rope[L],
                                   lw["self_attn.kv_b_proj.weight"], (nope + rope) ** -0.5,
                                   cfg.v_head_dim)                      # (n, H * v)
        out = self._per_seq(segs, q, attend)
        gate = K.sigmoid(K.bf16_matmul(lw["self_attn.g_proj.weight"], x))
        return K.bf16_matmul(lw["self_attn.o_proj.weight"], out * gate)

    # ---- MLPs (model.md §5.7, §5.8) --------------------------------------------------
    def _situ(self, g, u):
        return K.situ(g, u, self.cfg.activation_situ_beta, self.cfg.activation_situ_linear_beta)

    def _dense(self, lw, x):
        h = self._situ(K.bf16_matmul(lw["mlp.gate_proj.weight"], x),
                       K.bf16_matmul(lw["mlp.up_proj.weight"], x))
        return K.bf16_matmul(lw["mlp.down_proj.weight"], h)

    def _moe(self, L, lw, x, segs):
        cfg = self.cfg
        T = x.shape[0]
        logits = K.bf16_matmul(lw["block_sparse_moe.gate.weight"], x)        # (T, N)
        bias = lw["block_sparse_moe.gate.e_score_correction_bias"]
        _require_finite(logits, L, "its routing scores")
        _require_finite(bias, L, "its routing scores")
        ids, w = K.route(logits, bias, cfg.num_experts_per_token, cfg.moe_renormalize,
                         cfg.routed_scaling_factor)                          # (T, k)
        if self.on_route is not None:
            for s in segs:
                self.on_route(L, s.positions, ids[s.r0:s.r1], s.phase, s.tag)
        # Expert reads start now and overlap the latent down-projection and the shared
        # expert (pure compute); the routed loop then waits for them.
        flat = ids.reshape(-1)
        distinct = flat[np.sort(np.unique(flat, return_index=True)[1])]   # first-use order
        self.expert_union[L] += distinct.size
        step = self.weights.max_batch                # a batch never exceeds the cache
        pending = self.weights.experts_start(L, distinct[:step])
        z = K.bf16_matmul(lw["block_sparse_moe.routed_expert_down_proj.weight"], x)  # (T, lat)
        y_shared = None
        if cfg.num_shared_experts > 0:
            hs = self._situ(K.bf16_matmul(lw["block_sparse_moe.shared_experts.gate_proj.weight"], x),
                            K.bf16_matmul(lw["block_sparse_moe.shared_experts.up_proj.weight"], x))
            y_shared = K.bf16_matmul(lw["block_sparse_moe.shared_experts.down_proj.weight"], hs)
        # Each distinct expert is fetched once for the whole block of tokens (every
        # sequence of the pass) and applied to the tokens that chose it; outputs are kept
        # per (token, slot) and summed in selection order, so the result is bit-identical
        # to token-by-token evaluation.
        outs = np.zeros((T, ids.shape[1], z.shape[1]), np.float32)
        for b in range(0, distinct.size, step):
            group = distinct[b:b + step]
            if b > 0:
                pending = self.weights.experts_start(L, group)
            tensors = self.weights.experts_finish(pending)
            for e in group:
                tok, slot = np.nonzero(ids == e)
                w1p, w1s, w2p, w2s, w3p, w3s = tensors[int(e)]
                zs = np.ascontiguousarray(z[tok])
                hmid = self._situ(K.mxfp4_matmul(w1p, w1s, zs), K.mxfp4_matmul(w3p, w3s, zs))
                outs[tok, slot] = K.mxfp4_matmul(w2p, w2s, hmid)
        u = K.weighted_sum(outs, w)                                         # (T, lat)
        if cfg.latent_moe_use_norm:
            u = K.rmsnorm(u, lw["block_sparse_moe.routed_expert_norm.weight"], cfg.rms_norm_eps)
        y = K.bf16_matmul(lw["block_sparse_moe.routed_expert_up_proj.weight"], u)
        return y if y_shared is None else y + y_shared
