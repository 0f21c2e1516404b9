"""The DSpark draft's forward pass: formats/model/dspark.md §5 composed from numba kernels.

Owns: ``DraftCache``, one sequence's draft context (per draft layer the [latent | k_pe]
row of every committed position, dspark.md §6.3), and ``DraftForward``, which fills it
from the target's taps (dspark.md §5.1), runs one block pass
(dspark.md §5.2, §5.3, §5.5), and turns the block into proposals: base logits through the
target's lm_head, the Markov unroll (dspark.md §5.6) and the confidence
(dspark.md §5.7). Does not own: any arithmetic (``libk3.kernels`` through
``libk3.draft.ops``; the orders and roundings are formats/model/numerics.md sections 10 and 11),
reading the checkpoint (``libk3.draft.checkpoint``), capturing the taps
(``libk3.model.forward``), or choosing, verifying and committing proposals (the
speculative loop, dspark.md §6).

Python orchestrates one op per layer over every row at once; the only loop over rows is
the Markov unroll, which is sequential by definition (each step's bias needs the token
the previous step picked), one matrix-vector product per proposal.

The block attends without a mask: its rows are written into the cache arrays after the
committed context (scratch: ``length`` does not move) and every row is handed the last
block row's position as its attention limit, so each row sees the context and all block
rows, row 0 the last one too (dspark.md §5.3 step 4), while each row's rotation still
uses its own position. The target's causal ``mla_attention`` therefore serves unchanged.

Same answer everywhere: every kernel computes a row the same way whatever else is in the
call, so ingesting positions one at a time, in chunks or all at once gives the same cache
bits, and nothing depends on the thread count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from ..io.dtypes import bf16_to_f32
from . import ops as K
from .config import DraftConfig

# Not used from ``weights``: the draft computes with the target's embedding (dspark.md §3.1).
_EMBED = "embed_tokens.weight"
_CONF_W, _CONF_B = "confidence_head.proj.weight", "confidence_head.proj.bias"
_W1, _W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"


class DraftCache:
    """One sequence's draft context: rows 0..length-1 of every draft layer, each the
    RMS-normed latent and the rotated shared key of one committed position (dspark.md §5.1).
    Rows at ``length`` and past it are scratch (a block pass writes its own rows there)."""

    def __init__(self, cfg: DraftConfig, capacity: int = 64, identity: str | None = None):
        self.length = 0
        self.identity = identity     # the draft's (``draft_identity``): saved with the rows
        layers = cfg.num_hidden_layers
        self.latent = np.zeros((layers, capacity, cfg.kv_lora_rank), np.float32)
        self.k_pe = np.zeros((layers, capacity, cfg.qk_rope_head_dim), np.float32)

    @classmethod
    def of_rows(cls, identity: str, latent: np.ndarray, k_pe: np.ndarray) -> "DraftCache":
        """A cache holding committed rows read back from a state file: latent [layers, n,
        kv_lora] and k_pe [layers, n, rope] (taken, not copied)."""
        new = cls.__new__(cls)
        new.length, new.identity = latent.shape[1], identity
        new.latent, new.k_pe = latent, k_pe
        return new

    def reserve(self, n_new: int) -> None:
        """Room for ``n_new`` rows past ``length`` (capacity doubles)."""
        need = self.length + n_new
        if self.latent.shape[1] >= need:
            return
        cap = max(need, 2 * self.latent.shape[1])
        for name in ("latent", "k_pe"):
            old = getattr(self, name)
            new = np.zeros((old.shape[0], cap, old.shape[2]), np.float32)
            new[:, :self.length] = old[:, :self.length]
            setattr(self, name, new)

    def rows(self) -> np.ndarray:
        """(layers, length, kv_lora + rope) float32: the committed rows, [latent | k_pe]."""
        return np.concatenate([self.latent[:, :self.length], self.k_pe[:, :self.length]],
                              axis=2)

    def copy(self) -> "DraftCache":
        """An independent cache holding the same committed rows (no scratch)."""
        new = DraftCache.__new__(DraftCache)
        new.length, new.identity = self.length, self.identity
        new.latent = self.latent[:, :self.length].copy()
        new.k_pe = self.k_pe[:, :self.length].copy()
        return new

    def nbytes(self) -> int:
        return self.latent.nbytes + self.k_pe.nbytes


class Proposal(NamedTuple):
    """n proposals of one block (dspark.md §5.6, §5.7): tokens (n,) int64; logits (n, V)
    float32, Markov-corrected (the distribution a proposal was drawn from); base (n, V)
    float32, lm_head only; confidence (n,) float64, c_k of dspark.md §5.7."""
    tokens: np.ndarray
    logits: np.ndarray
    base: np.ndarray
    confidence: np.ndarray


class DraftForward:
    """The draft's forward pass over weights held by the caller.

    weights: bare tensor names (dspark.md §3.1) -> arrays; matrices as uint16 BF16 bits
    (``libk3.io.dtypes.matrix_operand``) or float32, norm weights float32 (BF16 bits are
    widened), the confidence head float32 or BF16 bits, its weight [1, n] or [n].
    ``embed_tokens.weight`` is not read. embed(ids) -> (len(ids), E) float32: the target's
    embedding rows. lm_head: the target's [V, E] (uint16 BF16 bits or float32)."""

    def __init__(self, cfg: DraftConfig, weights: Mapping[str, np.ndarray],
                 embed: Callable[[np.ndarray], np.ndarray], lm_head: np.ndarray):
        self.cfg = cfg
        self.embed = embed
        self.w = _checked_weights(cfg, weights)
        self.lm_head = _matrix("lm_head", lm_head, (cfg.vocab_size, cfg.hidden_size))
        self.inv_freq = np.asarray(cfg.rope_inv_freq(), np.float64)      # (rope / 2,)
        self.amplitude = cfg.rope_amplitude()
        self.scale = cfg.softmax_scale()

    def new_cache(self, identity: str | None = None) -> DraftCache:
        return DraftCache(self.cfg, identity=identity)

    # ---- context (dspark.md §5.1) ------------------------------------------------------
    def ingest(self, cache: DraftCache, taps: np.ndarray) -> None:
        """Append the rows of positions length .. length+n-1 from their taps
        (n, n_taps * target_hidden), each tap the target state of dspark.md §4, in
        ascending layer order."""
        cfg, w = self.cfg, self.w
        taps = np.ascontiguousarray(taps, np.float32)
        width = cfg.n_taps * cfg.target_hidden_size
        if taps.ndim != 2 or taps.shape[1] != width:
            raise ValueError(f"taps must be (n, {width}) (n_taps x target_hidden), "
                             f"found {taps.shape}")
        n = taps.shape[0]
        if n == 0:
            return
        eps, th = cfg.rms_norm_eps, cfg.target_hidden_size
        if cfg.fc_norm:                     # dspark.md §2.2: each tap normed on its own
            taps = np.concatenate([K.rmsnorm(taps[:, i * th:(i + 1) * th],
                                             w[f"fc_norm.{i}.weight"], eps)
                                   for i in range(cfg.n_taps)], axis=1)
        u = K.rmsnorm(K.bf16_matmul(w["context_proj.weight"], taps),
                      w["context_norm.weight"], eps)                           # (n, E)
        p = cache.length
        positions = np.arange(p, p + n, dtype=np.int64)
        cache.reserve(n)
        for layer in range(cfg.num_hidden_layers):
            cache.latent[layer, p:p + n], cache.k_pe[layer, p:p + n] = \
                self._key_rows(layer, u, positions)
        cache.length = p + n

    def _key_rows(self, layer: int, x: np.ndarray, positions: np.ndarray):
        """(latent (n, kv_lora) normed, k_pe (n, rope) rotated) of rows x:
        dspark.md §5.1 step 3 (x = u) and dspark.md §5.3 step 3 (x = the normed block rows)."""
        a = f"layers.{layer}.self_attn."
        r = self.cfg.kv_lora_rank
        c = K.bf16_matmul(self.w[a + "kv_a_proj_with_mqa.weight"], x)       # (n, r + rope)
        latent = K.rmsnorm(c[:, :r], self.w[a + "kv_a_layernorm.weight"],
                           self.cfg.rms_norm_eps)
        return latent, K.rope(c[:, r:], positions, self.inv_freq, self.amplitude)

    # ---- one block pass (dspark.md §5.2, §5.3, §5.5) -----------------------------------
    def block(self, cache: DraftCache, anchor: int) -> np.ndarray:
        """Final-normed hidden rows (block_size, E) float32 of [anchor, mask, ...] at
        positions length .. length+block_size-1; row k predicts position length+k+1.
        Writes scratch rows into the cache arrays; ``cache.length`` is unchanged."""
        cfg = self.cfg
        B, p = cfg.block_size, cache.length
        ids = np.array([self._token(anchor, "anchor")] + [cfg.mask_token_id] * (B - 1),
                       np.int64)
        h = np.ascontiguousarray(self.embed(ids), np.float32)                  # (B, E)
        if h.shape != (B, cfg.hidden_size):
            raise ValueError(f"embed returned {h.shape} for {B} ids, "
                             f"expected ({B}, {cfg.hidden_size})")
        positions = np.arange(p, p + B, dtype=np.int64)
        sees = np.full(B, p + B - 1, np.int64)      # every row: context + all block rows
        cache.reserve(B)
        for layer in range(cfg.num_hidden_layers):
            h = self._layer(layer, h, cache, positions, sees)
        return K.rmsnorm(h, self.w["final_norm.weight"], cfg.rms_norm_eps)

    def _layer(self, layer, h, cache, positions, sees):
        """h + attention, then + MLP (dspark.md §5.3); no output gate, no post-norm."""
        w, eps = self.w, self.cfg.rms_norm_eps
        x = K.rmsnorm(h, w[f"layers.{layer}.input_layernorm.weight"], eps)
        h = h + self._attention(layer, x, cache, positions, sees)
        m = f"layers.{layer}.mlp."
        y = K.rmsnorm(h, w[f"layers.{layer}.post_attention_layernorm.weight"], eps)
        g = K.silu_mul(K.bf16_matmul(w[m + "gate_proj.weight"], y),
                       K.bf16_matmul(w[m + "up_proj.weight"], y))
        return h + K.bf16_matmul(w[m + "down_proj.weight"], g)

    def _attention(self, layer, x, cache, positions, sees):
        """o_proj . MLA of the normed block rows x (B, E) over the context and the block
        itself (dspark.md §5.3 steps 2-6), in the absorbed form over the latent cache."""
        cfg, w = self.cfg, self.w
        a = f"layers.{layer}.self_attn."
        B = x.shape[0]
        H, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        cq = K.rmsnorm(K.bf16_matmul(w[a + "q_a_proj.weight"], x),
                       w[a + "q_a_layernorm.weight"], cfg.rms_norm_eps)
        q = K.bf16_matmul(w[a + "q_b_proj.weight"], cq).reshape(B, H, nope + rope)
        q_pe = K.rope(q[..., nope:], positions, self.inv_freq, self.amplitude)
        p = int(positions[0])
        cache.latent[layer, p:p + B], cache.k_pe[layer, p:p + B] = \
            self._key_rows(layer, x, positions)
        mix = K.mla_attention(q[..., :nope], q_pe, sees, cache.latent[layer],
                              cache.k_pe[layer], w[a + "kv_b_proj.weight"], self.scale,
                              cfg.v_head_dim)                                   # (B, H * v)
        return K.bf16_matmul(w[a + "o_proj.weight"], mix)

    # ---- head (dspark.md §5.5-§5.7) ----------------------------------------------------
    def base_logits(self, hidden: np.ndarray) -> np.ndarray:
        """(k, V) float32: the target's lm_head applied to k final-normed rows."""
        return K.bf16_matmul(self.lm_head, np.atleast_2d(hidden))

    def markov_bias(self, prev: int) -> np.ndarray:
        """(V,) float32: W2 . W1[prev], the bias the previous token puts on every logit."""
        return K.bf16_matmul(self.w[_W2], self._w1_row(prev)[None, :])[0]

    def confidence(self, hidden_row: np.ndarray, prev: int) -> float:
        """sigmoid(w . [hidden_row ; W1[prev]] + b), the chance this row's proposal
        survives given the earlier ones did (dspark.md §5.7); 1.0 without the head."""
        cfg = self.cfg
        if not cfg.enable_confidence_head:
            return 1.0
        feat = np.asarray(hidden_row, np.float32).reshape(-1)
        if cfg.confidence_head_with_markov:
            feat = np.concatenate([feat, self._w1_row(prev)])
        return K.logistic_unit(self.w[_CONF_W], feat, self.w[_CONF_B][0])

    def propose(self, cache: DraftCache, anchor: int, n: int, pick=None) -> Proposal:
        """One block pass, then n proposals by the Markov unroll, left to right
        (dspark.md §5.6): logits_k = base_k + markov_bias(prev_k), d = pick(k, logits_k)
        (default: the first maximum), prev_(k+1) = d, prev_0 = the anchor."""
        cfg = self.cfg
        if not 0 <= n <= cfg.block_size:
            raise ValueError(f"propose: n = {n} is outside 0..{cfg.block_size}")
        V = cfg.vocab_size
        hidden = self.block(cache, anchor)[:n]
        base = self.base_logits(hidden)                                        # (n, V)
        logits = np.empty((n, V), np.float32)
        confidence = np.ones(n, np.float64)
        tokens = np.empty(n, np.int64)
        prev = self._token(anchor, "anchor")
        for k in range(n):
            logits[k] = base[k] + self.markov_bias(prev)
            confidence[k] = self.confidence(hidden[k], prev)
            d = int(np.argmax(logits[k])) if pick is None else int(pick(k, logits[k]))
            prev = tokens[k] = self._token(d, "pick")
        return Proposal(tokens, logits, base, confidence)

    def _w1_row(self, prev: int) -> np.ndarray:
        """W1[prev] widened to float32 (exact), R floats."""
        row = self.w[_W1][self._token(prev, "previous token")]
        return bf16_to_f32(row) if row.dtype == np.uint16 else row

    def _token(self, t, what: str) -> int:
        t = int(t)
        if not 0 <= t < self.cfg.vocab_size:      # a negative id would wrap silently
            raise ValueError(f"{what} {t} is outside the vocabulary 0..{self.cfg.vocab_size - 1}")
        return t


def _matrix(name: str, a, shape: tuple) -> np.ndarray:
    """A matrix as the kernels take it: uint16 BF16 bits or float32, C-contiguous."""
    a = np.asarray(a)
    if a.dtype not in (np.uint16, np.float32):
        raise ValueError(f"{name}: dtype {a.dtype}, expected BF16 bits (uint16) or float32")
    if a.shape != tuple(shape):
        raise ValueError(f"{name}: shape {a.shape}, expected {tuple(shape)}")
    return np.ascontiguousarray(a)


def _vector(name: str, a, n: int) -> np.ndarray:
    """A vector (or a [1, n] row) as float32 (n,), BF16 bits widened exactly."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        a = bf16_to_f32(a)
    if a.dtype != np.float32 or a.size != n or a.ndim > 2 or (a.ndim == 2 and a.shape[0] != 1):
        raise ValueError(f"{name}: {a.dtype} {a.shape}, expected float32 or BF16 bits of {n}")
    return np.ascontiguousarray(a.reshape(n))


class _Streamed(dict):
    """The checked weights, with the matrices a streamed source reads at each use
    (``source.entry(name)`` is not None) fetched from it on access, never kept."""

    def __init__(self, held: dict, source):
        super().__init__(held)
        self.source = source

    def __missing__(self, name: str) -> np.ndarray:
        return np.ascontiguousarray(self.source[name])


def _checked_weights(cfg: DraftConfig, weights: Mapping[str, np.ndarray]) -> dict:
    """Every tensor of dspark.md §3.1 but the embedding copy, checked and in the form the
    kernels take (a matrix the source streams checked from its entry, not read); one
    ValueError names every problem."""
    out, problems = {}, []
    entry = getattr(weights, "entry", lambda name: None)
    for name, shape in cfg.tensor_shapes().items():
        if name == _EMBED:
            continue
        if name not in weights:
            problems.append(f"{name}: missing")
            continue
        ent = entry(name)
        if ent is not None:
            if tuple(ent.shape) != tuple(shape) or ent.dtype not in ("BF16", "F32"):
                problems.append(f"{name}: {ent.dtype} {tuple(ent.shape)}, expected "
                                f"BF16 or F32 {tuple(shape)}")
            continue
        try:
            if len(shape) == 2 and name != _CONF_W:
                out[name] = _matrix(name, weights[name], shape)
            else:
                out[name] = _vector(name, weights[name], int(np.prod(shape)))
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError("draft weights: " + "; ".join(problems))
    return _Streamed(out, weights) if hasattr(weights, "entry") else out
