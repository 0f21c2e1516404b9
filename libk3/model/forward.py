"""The engine's K3 forward pass: model.md §5 composed from numba kernels.

Owns: the blocks of one decoder layer as functions of (config, layer weights, input,
state), written in the order of model.md §5 (``kda``, ``mla``, ``route``,
``latent_moe``, ``dense_mlp``), and ``Forward``, which runs them: the layer loop, the
AttnRes bookkeeping, several sequences in one pass (``Forward.run``: one ``Segment`` per
sequence, each with its own State), and fetching each layer's trunk and routed experts
from a weight provider (``libk3.model.provider``), with the next MoE layer's predicted
experts asked for early (``libk3.model.predict``). Does not own: where weights come from
(resident, streamed, cached: ``libk3.model.weights``, ``libk3.stream``), the math inside
each op (``libk3.kernels``), sampling or scheduling.

A pass over several sequences stacks their tokens into one block: every op that applies
weights (projections, norms, AttnRes, router, experts, lm_head) runs once over the block,
so a layer's trunk is fetched once per pass and each routed expert once for all the
tokens that chose it (the union over the sequences); only what reads a sequence's own
state (short conv, KDA recurrence, MLA cache and attention) runs per sequence: the
blocks take one ``KdaSeq`` / ``MlaSeq`` per sequence, its rows of the block and its state.

Same answer everywhere: every op computes each token's values with the same accumulation
order whether it runs for one token or a block, so prefill, chunked prefill, incremental
decode, full re-forward and a pass shared with other sequences give bit-identical
logits; and nothing here depends on the budget or the thread count.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from . import ops as K
from ..config import K3Config, L2NORM_EPS, MLA_LATENT_NORM_EPS
from ..errors import NonFiniteError
from ..machine import threads
from ..media.markup import rows_in
from .predict import predict_experts, ranked
from .provider import WeightProvider
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


class KdaSeq(NamedTuple):
    """One sequence's share of a KDA layer: its rows of the pass's block and its state for
    this layer (model.md §6), both updated in place, unless ``tape`` is given (a verify
    pass): then the state is left as it was and ``tape[L]`` gets what ``commit`` needs."""
    rows: slice
    conv: np.ndarray        # (3, P, K-1): q, k, v pre-activation history, oldest first
    S: np.ndarray           # (H, D, D) recurrent state
    tape: dict | None = None
    L: int = -1


class MlaSeq(NamedTuple):
    """One sequence's share of an MLA layer: its rows of the block, their absolute
    positions, and its caches for this layer (rows at those positions are written)."""
    rows: slice
    positions: np.ndarray   # (n,) int64
    latent: np.ndarray      # (capacity, kv_lora_rank) normalised latent
    rope: np.ndarray        # (capacity, qk_rope_head_dim) raw shared key slice


def _per_seq(seqs, X, fn):
    """fn(seq, its rows of X) for each sequence, stacked back in row order."""
    if len(seqs) == 1:
        return fn(seqs[0], X)
    return np.concatenate([fn(s, X[s.rows]) for s in seqs])


# ---- KDA (model.md §5.5) -------------------------------------------------------------
def kda(cfg: K3Config, lw, x: np.ndarray, seqs: list) -> np.ndarray:
    """KDA attention of the normalised input x (T, E) -> (T, E); each ``KdaSeq`` of
    ``seqs`` (in row order, covering all T rows) carries its conv history and S."""
    T = x.shape[0]
    H, D = cfg.num_heads, cfg.head_dim
    q_hat = K.bf16_matmul(lw["self_attn.q_proj.weight"], x)          # (T, P)
    k_hat = K.bf16_matmul(lw["self_attn.k_proj.weight"], x)
    v_hat = K.bf16_matmul(lw["self_attn.v_proj.weight"], x)
    beta = K.sigmoid(K.bf16_matmul(lw["self_attn.b_proj.weight"], x))  # (T, H)
    z = K.bf16_matmul(lw["self_attn.f_b_proj.weight"],
                      K.bf16_matmul(lw["self_attn.f_a_proj.weight"], x))  # (T, P)

    def conv(u, j, w):                      # each sequence through its own history
        return _per_seq(seqs, u, lambda s, u_s: K.short_conv(
            u_s, w, s.conv[j] if s.tape is None else s.conv[j].copy()))
    q = conv(q_hat, 0, lw["self_attn.q_conv1d.weight"])
    k = conv(k_hat, 1, lw["self_attn.k_conv1d.weight"])
    v = conv(v_hat, 2, lw["self_attn.v_conv1d.weight"])
    q = K.l2norm(q.reshape(T * H, D), L2NORM_EPS).reshape(T, H, D)
    k = K.l2norm(k.reshape(T * H, D), L2NORM_EPS).reshape(T, H, D)
    v = v.reshape(T, H, D)
    alpha = K.kda_decay(z, lw["self_attn.A_log"][:H], lw["self_attn.dt_bias"],
                        cfg.gate_lower_bound).reshape(T, H, D)
    o = _per_seq(seqs, q, lambda s, q_s: K.kda_recurrence(      # each S updated
        q_s, k[s.rows], v[s.rows], alpha[s.rows], beta[s.rows], D ** -0.5,
        s.S if s.tape is None else s.S.copy()))
    for s in seqs:
        if s.tape is not None:       # the recurrence's inputs, for commit to replay
            s.tape[s.L] = tuple(np.ascontiguousarray(a[s.rows]) for a in
                                (q_hat, k_hat, v_hat, q, k, v, alpha, beta))
    o = K.rmsnorm(o.reshape(T * H, D), lw["self_attn.o_norm.weight"], cfg.rms_norm_eps)
    gate = K.sigmoid(K.bf16_matmul(lw["self_attn.g_proj.weight"], x))
    return K.bf16_matmul(lw["self_attn.o_proj.weight"], o.reshape(T, H * D) * gate)


# ---- gated MLA, latent form (model.md §5.6) ------------------------------------------
def mla(cfg: K3Config, lw, x: np.ndarray, seqs: list,
        eps_latent: float = MLA_LATENT_NORM_EPS) -> np.ndarray:
    """Gated MLA of the normalised input x (T, E) -> (T, E); each ``MlaSeq`` of ``seqs``
    gets its rows' latent and key slice appended to its caches, then attends to them.
    ``eps_latent`` is the model's (model.md §5.0); other values are for comparing with
    vectors made with another one."""
    T = x.shape[0]
    H, nope, rope, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim,
                        cfg.qk_rope_head_dim, cfg.kv_lora_rank)
    cq = K.rmsnorm(K.bf16_matmul(lw["self_attn.q_a_proj.weight"], x),
                   lw["self_attn.q_a_layernorm.weight"], eps_latent)
    q = K.bf16_matmul(lw["self_attn.q_b_proj.weight"], cq).reshape(T, H, nope + rope)
    c = K.bf16_matmul(lw["self_attn.kv_a_proj_with_mqa.weight"], x)  # (T, r + rope)
    latent = K.rmsnorm(np.ascontiguousarray(c[:, :r]), lw["self_attn.kv_a_layernorm.weight"],
                       eps_latent)

    def attend(s, q_s):                     # one sequence: append to its cache, attend
        p0, n = int(s.positions[0]), s.positions.shape[0]
        s.latent[p0:p0 + n] = latent[s.rows]
        s.rope[p0:p0 + n] = c[s.rows, r:]
        return K.mla_attention(q_s[..., :nope], q_s[..., nope:], s.positions, s.latent,
                               s.rope, lw["self_attn.kv_b_proj.weight"],
                               (nope + rope) ** -0.5, cfg.v_head_dim)   # (n, H * v)
    out = _per_seq(seqs, q, attend)
    gate = K.sigmoid(K.bf16_matmul(lw["self_attn.g_proj.weight"], x))
    return K.bf16_matmul(lw["self_attn.o_proj.weight"], out * gate)


# ---- MLPs (model.md §5.7, §5.8) ------------------------------------------------------
def situ_mlp(cfg: K3Config, gate_proj, up_proj, down_proj, x: np.ndarray) -> np.ndarray:
    """down . SiTU(gate x, up x) with dense (BF16 or f32) matrices: the dense MLP, the
    fused shared experts."""
    h = K.situ(K.bf16_matmul(gate_proj, x), K.bf16_matmul(up_proj, x),
               cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    return K.bf16_matmul(down_proj, h)


def dense_mlp(cfg: K3Config, lw, x: np.ndarray) -> np.ndarray:
    """The dense MLP of the first ``first_k_dense_replace`` layers (model.md §5.7)."""
    return situ_mlp(cfg, lw["mlp.gate_proj.weight"], lw["mlp.up_proj.weight"],
                    lw["mlp.down_proj.weight"], x)


def mxfp4_expert(cfg: K3Config, tensors, z: np.ndarray) -> np.ndarray:
    """w2 . SiTU(w1 z, w3 z) for one routed expert from its six MXFP4 tensors
    (EXPERT_PARTS order); z (n, latent) -> (n, latent)."""
    w1p, w1s, w2p, w2s, w3p, w3s = tensors
    h = K.situ(K.mxfp4_matmul(w1p, w1s, z), K.mxfp4_matmul(w3p, w3s, z),
               cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    return K.mxfp4_matmul(w2p, w2s, h)


def route(cfg: K3Config, lw, x: np.ndarray, L: int):
    """Router (model.md §5.8 steps 1-3) of the full-width x (T, E) -> (ids, weights), both
    (T, k) in selection order. Refuses NaN/Inf scores, naming layer ``L``."""
    logits = K.bf16_matmul(lw["block_sparse_moe.gate.weight"], x)        # (T, N)
    bias = lw["block_sparse_moe.gate.e_score_correction_bias"]
    _require_finite(logits, L, "its routing scores")
    _require_finite(bias, L, "its routing scores")
    return K.route(logits, bias, cfg.num_experts_per_token, cfg.moe_renormalize,
                   cfg.routed_scaling_factor)


def latent_moe(cfg: K3Config, lw, x: np.ndarray, ids: np.ndarray, w: np.ndarray,
               expert_batches, expert_mlp=mxfp4_expert) -> np.ndarray:
    """Stable LatentMoE (model.md §5.8 steps 4-7) of x (T, E) routed to ``ids`` with
    weights ``w`` -> (T, E). ``expert_batches`` yields {expert id: tensors} covering every
    routed id; it is first advanced after the latent down-projection and the shared
    experts, so a fetch started before the call overlaps them. ``expert_mlp(cfg,
    tensors, z)`` applies one expert (MXFP4 in a checkpoint)."""
    T = x.shape[0]
    z = K.bf16_matmul(lw["block_sparse_moe.routed_expert_down_proj.weight"], x)  # (T, lat)
    y_shared = None
    if cfg.num_shared_experts > 0:
        y_shared = situ_mlp(cfg, lw["block_sparse_moe.shared_experts.gate_proj.weight"],
                            lw["block_sparse_moe.shared_experts.up_proj.weight"],
                            lw["block_sparse_moe.shared_experts.down_proj.weight"], x)
    # Each distinct expert is applied once to all the tokens that chose it; outputs are
    # kept per (token, slot) and summed in selection order, so the result is
    # bit-identical to token-by-token evaluation.
    outs = np.zeros((T, ids.shape[1], z.shape[1]), np.float32)
    for tensors in expert_batches:
        for e, t in tensors.items():
            tok, slot = np.nonzero(ids == e)
            outs[tok, slot] = expert_mlp(cfg, t, np.ascontiguousarray(z[tok]))
    u = K.weighted_sum(outs, w)                                         # (T, lat)
    if cfg.latent_moe_use_norm:
        u = K.rmsnorm(u, lw["block_sparse_moe.routed_expert_norm.weight"], cfg.rms_norm_eps)
    y = K.bf16_matmul(lw["block_sparse_moe.routed_expert_up_proj.weight"], u)
    return y if y_shared is None else y + y_shared


class ImageRows(NamedTuple):
    """An image's projected rows standing at ``start`` (an index into the ids they come
    with) in place of the pad ids there (formats/model/vision.md §8); ``digest`` names the
    image and its preprocessing, so a State can say which image it holds."""
    start: int
    rows: np.ndarray        # (N, hidden_size) float32
    digest: str


class Segment:
    """One sequence's share of a pass: its new token ids, its State, whether every fed
    position's logits are wanted (else the last one's), the phase (trace records) and an
    opaque ``tag`` handed to ``on_route`` (k3-run: which prompt of a batch).

    ``verify``: the ids are a guess to be checked (speculative decoding). The pass computes
    their logits as if they were fed, but leaves the State at its position; ``commit``
    then makes it hold the accepted first n of them, from what the pass recorded in
    ``tape``, reading no weights. After a pass, ``taps`` holds the hidden states the
    Forward's ``taps`` asked for, one row per fed id (None when none were asked for).
    ``images``: a prompt's ``ImageRows`` and ``at`` where ``ids`` start in it: the rows
    these ids cover replace their embeddings."""

    __slots__ = ("ids", "state", "all_logits", "phase", "tag", "verify", "tape", "taps",
                 "r0", "r1", "positions", "rows", "images")

    def __init__(self, ids, state: State, all_logits: bool = True, phase: str = "prefill",
                 tag=None, verify: bool = False, images=(), at: int = 0):
        self.ids = np.asarray(ids, dtype=np.int64)
        self.state, self.all_logits, self.phase, self.tag = state, all_logits, phase, tag
        self.verify = verify
        self.tape = {} if verify else None
        self.taps = None
        self.rows = None            # a verify's logits rows, for ``commit``
        self.images = rows_in(images, at, at + self.ids.shape[0]) if images else []


class Taps(NamedTuple):
    """Which hidden states a pass captures for a draft model (formats/model/dspark.md §4):
    after each of ``layers`` (0-based, ascending), in ``form`` "prefix" (the AttnRes
    partial sum of the layer's block, model.md §5.3) or "attn_res" (the next layer's
    attention-input mixture; after the last layer, the output mixture)."""
    layers: tuple
    form: str = "prefix"


def commit(segment: Segment, n: int) -> None:
    """Make a verify segment's State hold its first ``n`` ids, as feeding only those
    would have (formats/model/dspark.md §6): the KDA recurrence and conv history are replayed
    from the pass's tape (the same kernel over the same inputs, so bit-identical), MLA
    caches keep the rows already written (rows past the position are never read), and
    the state's last logits are the pass's row of its n-th id."""
    if not segment.verify:
        raise ValueError("commit takes a verify segment")
    state, ids = segment.state, segment.ids
    if not 0 <= n <= ids.shape[0]:
        raise ValueError(f"commit of {n} ids from a verify of {ids.shape[0]}")
    q_scale = state.cfg.head_dim ** -0.5
    for L, (q_hat, k_hat, v_hat, q, k, v, alpha, beta) in segment.tape.items():
        hist = state.kda_conv[L]                              # (3, P, K-1), oldest first
        for j, u in enumerate((q_hat, k_hat, v_hat)):        # the last K-1 inputs fed
            hist[j] = np.concatenate([hist[j], u[:n].T], axis=1)[:, n:]
        if n:
            K.kda_recurrence(q[:n], k[:n], v[:n], alpha[:n], beta[:n], q_scale,
                             state.kda_S[L])
    state.pos += n
    state.ids.extend(int(i) for i in ids[:n])
    if n:
        state.logits = segment.rows[n - 1].copy()
    segment.tape = {}
    segment.verify = False


class Forward:
    """``Forward(cfg, weights)(ids, state)`` -> float32 logits for the fed positions.

    ``weights`` is a ``WeightProvider`` (libk3.model.provider).
    ``on_route(L, positions, ids, phase, tag)`` if given is called with each MoE layer's
    routing, once per sequence of the pass, and with its predicted routing (phase
    "predicted", before the layer runs) when the provider reads experts ahead.
    ``expert_union[L]`` sums, over passes, the distinct experts layer L fetched
    (``passes`` counts the passes): the union the sequences of a pass share.
    """

    def __init__(self, cfg: K3Config, weights: WeightProvider, on_route=None,
                 taps: Taps | None = None):
        self.cfg = cfg
        self.weights = weights
        self.on_route = on_route
        self.taps = None
        self.capture(taps)
        self.layer_seconds = [0.0] * cfg.num_hidden_layers    # wall time per layer (bench)
        self.first_layer_time = None          # time.time() the first layer started (report)
        self._head = None                     # (lm_head, norm, out_fold), asked for lazily
        self.expert_union = [0] * cfg.num_hidden_layers   # distinct experts fetched (bench)
        self.passes = 0

    def capture(self, taps: Taps | None) -> None:
        """From the next pass on, capture ``taps`` (None: none)."""
        if taps is not None and (list(taps.layers) != sorted(set(taps.layers)) or not all(
                0 <= L < self.cfg.num_hidden_layers for L in taps.layers)):
            raise ValueError(f"tap layers {taps.layers} are not ascending layers of the model")
        self.taps = taps

    def head(self):
        """(lm_head, final norm, folded output AttnRes vector). Asked for only after the
        first pass's layers, so a provider may still be reading them (weights.py)."""
        if self._head is None:
            m = self.weights.model()
            self._head = (m["lm_head"], m["norm"],
                          K.fold_attn_res(m["output_attn_res_norm"], m["output_attn_res_proj"]))
        return self._head

    def __call__(self, ids, state: State, all_logits: bool = True, phase: str = "prefill",
                 taps: list | None = None):
        """Float32 logits [T or 1, V] for ``ids`` fed to one sequence's ``state``; the
        pass's captured hidden states are appended to ``taps`` when it is given."""
        seg = Segment(ids, state, all_logits, phase)
        logits = self.run([seg])[0]
        if taps is not None:
            taps.append(seg.taps)
        return logits

    def run(self, segments: list) -> list:
        """One pass over several sequences (each Segment's State is its own, never shared
        by two segments); returns each segment's logits, as ``__call__`` would alone."""
        threads.fit()              # the kernels' share of the CPUs, for what else runs now
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
        for seg in live:            # image rows in place of their pads' embeddings
            for im in seg.images:
                prefix[seg.r0 + im.start:seg.r0 + im.start + im.rows.shape[0]] = im.rows
        blocks: list = []
        if self.first_layer_time is None:
            self.first_layer_time = time.time()
        tap_at = () if self.taps is None else self.taps.layers
        mixed = self.taps is not None and self.taps.form == "attn_res"
        captured = []
        for L in range(cfg.num_hidden_layers):
            t0 = time.perf_counter()
            lw = self.weights.layer(L)
            try:
                x_a, prefix = self._layer(L, lw, prefix, blocks, live)
            finally:
                self.weights.release(L)
            if mixed and L - 1 in tap_at:
                captured.append(x_a)
            _require_finite(prefix, L, "its output")
            if L in tap_at and not mixed:
                captured.append(prefix)
            self.layer_seconds[L] += time.perf_counter() - t0
        self.passes += 1
        lm_head, norm, out_fold = self.head()
        h = K.attn_res(blocks + [prefix], out_fold, cfg.rms_norm_eps)
        if mixed and cfg.num_hidden_layers - 1 in tap_at:
            captured.append(h)
        if captured:
            taps = np.concatenate(captured, axis=1)         # (T, n_taps * E), ascending
            for seg in live:
                seg.taps = taps[seg.r0:seg.r1]
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
            if seg.verify:
                seg.rows = out[id(seg)]
            else:
                seg.state.media += [(seg.state.pos + im.start, im.rows.shape[0], im.digest)
                                    for im in seg.images]
                seg.state.pos += seg.r1 - seg.r0
                seg.state.ids.extend(int(i) for i in seg.ids)
                seg.state.logits = out[id(seg)][-1].copy()
        return [out.get(id(seg), np.zeros((0, cfg.vocab_size), np.float32))
                for seg in segments]

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
            a = mla(cfg, lw, h, [MlaSeq(slice(s.r0, s.r1), s.positions, s.state.mla_latent[L],
                                        s.state.mla_rope[L]) for s in segs])
        else:
            a = kda(cfg, lw, h, [KdaSeq(slice(s.r0, s.r1), s.state.kda_conv[L],
                                        s.state.kda_S[L], s.tape, L) for s in segs])
        prefix = a if empty else p + a
        x_m = K.attn_res(blocks + [prefix], K.fold_attn_res(lw["mlp_res_norm.weight"],
                         lw["mlp_res_proj.weight"]), eps)
        h = K.rmsnorm(x_m, lw["post_attention_layernorm.weight"], eps)
        if cfg.is_dense(L):
            self._predict(L + 1, blocks, prefix, segs)
            m = dense_mlp(cfg, lw, h)
        else:
            m = self._moe(L, lw, h, segs, (blocks, prefix))
        return x_a, prefix + m

    def _moe(self, L, lw, x, segs, ahead):
        """Route, report the routing, start fetching the routed experts, start reading
        the next layer's predicted ones behind them (``ahead``: the AttnRes blocks and
        running sum after this layer's attention) unless this layer's experts need more
        than one batch, run the block."""
        ids, w = route(self.cfg, lw, x, L)                                  # (T, k)
        if self.on_route is not None:
            for s in segs:
                self.on_route(L, s.positions, ids[s.r0:s.r1], s.phase, s.tag)
        flat = ids.reshape(-1)
        distinct = flat[np.sort(np.unique(flat, return_index=True)[1])]   # first-use order
        self.expert_union[L] += distinct.size
        batches = self._expert_batches(L, distinct)        # this layer's reads go first
        if distinct.size <= self.weights.max_batch:      # else its later batches would
            self._predict(L + 1, *ahead, segs)           # meet the next layer's guess
        return latent_moe(self.cfg, lw, x, ids, w, batches)

    def _predict(self, L, blocks, prefix, segs):
        """Start reading MoE layer L's predicted experts (libk3.model.predict) when the
        provider holds L's trunk and reads ahead; ``on_route`` gets them with the phase
        "predicted" before L's real routing."""
        if L >= self.cfg.num_hidden_layers or self.cfg.is_dense(L):
            return
        lw = self.weights.experts_ahead(L)
        ids = None if lw is None else predict_experts(self.cfg, lw, blocks, prefix)
        if ids is None:
            return
        if self.on_route is not None:
            for s in segs:
                self.on_route(L, s.positions, ids[s.r0:s.r1], "predicted", s.tag)
        self.weights.experts_prefetch(L, ranked(ids))

    def _expert_batches(self, L, distinct):
        """Start reading the first batch of ``distinct`` now (it overlaps the pure compute
        ``latent_moe`` does first); the iterator finishes it, then reads the rest one
        batch at a time. A batch never exceeds the provider's ``max_batch`` (the cache)."""
        step = self.weights.max_batch
        first = self.weights.experts_start(L, distinct[:step])

        def batches():
            pending = first
            for b in range(0, distinct.size, step):
                if b > 0:
                    pending = self.weights.experts_start(L, distinct[b:b + step])
                yield self.weights.experts_finish(pending)
        return batches()
