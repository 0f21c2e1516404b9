"""A plain numpy float64 evaluation of the image tower, merger and projector, to be read
against formats/model/vision.md §5-§6 line by line.

Owns: the oracle for ``libk3.model.vision`` and its kernels: patches in, the tower's
final-normed rows, the merged rows and the projected rows out, every operation in float64
(except the rotary angles, which the release defines as float32 numbers, vision.md §5.3).
It never calls ``libk3.kernels`` nor shares code with the engine path: the position-table
resize, the angles and the merge order are written out again here, loop by loop, so a
misreading in one of the two shows as a difference. Slow and meant for small grids.

Weights come from ``get(name) -> float64 ndarray`` in the checkpoint's shapes (the
tensors widened exactly), so the same code serves a checkpoint, a dict of BF16 arrays, or
a test's own values.
"""

from __future__ import annotations

import math

import numpy as np

from .. import names
from ..vision_config import VIT_NORM_EPS, VisionConfig

ROPE_BASE = 10000.0


def rmsnorm(x, w, eps):
    """Over the last axis; eps INSIDE the root; mean, not sum."""
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def gelu_tanh(u):
    """The tower's GELU, tanh form (vision.md §5.5)."""
    return 0.5 * u * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u ** 3)))


_erf = np.frompyfunc(math.erf, 1, 1)


def gelu_erf(u):
    """The projector's GELU, exact (erf) form (vision.md §6.2)."""
    return 0.5 * u * (1.0 + _erf(u / math.sqrt(2.0)).astype(np.float64))


def resize_table(table, gh, gw):
    """The position table [Ph, Pw, D] resized bilinearly to [gh, gw, D] (vision.md §5.2),
    one output cell at a time."""
    n_r, n_c, _ = table.shape

    def source(dst, n_in, n_out):
        src = max((dst + 0.5) * (n_in / n_out) - 0.5, 0.0)
        i0 = int(math.floor(src))
        return i0, min(i0 + 1, n_in - 1), src - i0

    out = np.empty((gh, gw, table.shape[2]))
    for y in range(gh):
        r0, r1, lr = source(y, n_r, gh)
        for x in range(gw):
            c0, c1, lc = source(x, n_c, gw)
            top = (1 - lc) * table[r0, c0] + lc * table[r0, c1]
            bottom = (1 - lc) * table[r1, c0] + lc * table[r1, c1]
            out[y, x] = (1 - lr) * top + lr * bottom
    return out


def rope_angles(gh, gw, hd):
    """[L, hd / 2] angles of the release's 2D rotary code (vision.md §5.3): pair 2i of
    patch (y, x) turns by f32(x · theta_i), pair 2i + 1 by f32(y · theta_i), with
    theta_i = f32(1 / f32(10000 ** f32(4i / hd)))."""
    f32 = np.float32
    ang = np.empty((gh * gw, hd // 2))
    for i in range(hd // 4):
        power = f32(ROPE_BASE ** float(f32(f32(4 * i) / f32(hd))))
        theta = f32(f32(1.0) / power)
        for y in range(gh):
            for x in range(gw):
                ang[y * gw + x, 2 * i] = float(f32(f32(x) * theta))
                ang[y * gw + x, 2 * i + 1] = float(f32(f32(y) * theta))
    return ang


def rotate(x, ang):
    """x [L, H, hd] with neighbour pairs (2k, 2k + 1) turned by ang[l, k]."""
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def block(vcfg: VisionConfig, b, x, ang, get):
    """One pre-norm encoder block (vision.md §5.4). x: [L, D] float64."""
    L = x.shape[0]
    H, hd, Q = vcfg.vt_num_attention_heads, vcfg.vt_head_dim, vcfg.qkv_hidden_size
    W = lambda sfx: get(names.vision_block(b, sfx))          # noqa: E731
    h = rmsnorm(x, W("norm0.weight"), VIT_NORM_EPS)
    qkv = h @ W("wqkv.weight").T                                     # (L, 3 Q)
    q = rotate(qkv[:, :Q].reshape(L, H, hd), ang)
    k = rotate(qkv[:, Q:2 * Q].reshape(L, H, hd), ang)
    v = qkv[:, 2 * Q:].reshape(L, H, hd)
    scores = np.einsum("lhd,shd->hls", q, k) / math.sqrt(hd)         # (H, L, L), no mask
    p = np.exp(scores - scores.max(axis=2, keepdims=True))
    p /= p.sum(axis=2, keepdims=True)
    a = np.einsum("hls,shd->lhd", p, v).reshape(L, Q)
    x = x + a @ W("wo.weight").T
    h = rmsnorm(x, W("norm1.weight"), VIT_NORM_EPS)
    return x + gelu_tanh(h @ W("mlp.fc0.weight").T) @ W("mlp.fc1.weight").T


def tower(vcfg: VisionConfig, get, patches, grid):
    """The tower's final-normed rows [L, D] (vision.md §5) of patches [L, 3, p, p]."""
    gh, gw = grid
    L = gh * gw
    D = vcfg.vt_hidden_size
    pixels = np.asarray(patches, np.float64).reshape(L, vcfg.patch_inputs)
    x = pixels @ get(names.VISION_PATCH_EMBED).reshape(D, -1).T
    x = x + resize_table(get(names.VISION_POS_EMB), gh, gw).reshape(L, D)
    ang = rope_angles(gh, gw, vcfg.vt_head_dim)
    for b in range(vcfg.vt_num_hidden_layers):
        x = block(vcfg, b, x, ang, get)
    return rmsnorm(x, get(names.VISION_FINAL_NORM), VIT_NORM_EPS)


def merge(t, grid, m):
    """[N, m m D]: each m × m block of patches, blocks row-major, inside a block the
    patches row by row (vision.md §6.1)."""
    gh, gw = grid
    D = t.shape[1]
    rows = []
    for bi in range(gh // m):
        for bj in range(gw // m):
            rows.append(np.concatenate([t[(m * bi + dy) * gw + m * bj + dx]
                                        for dy in range(m) for dx in range(m)]))
    return np.array(rows).reshape(-1, m * m * D)


def project(vcfg: VisionConfig, get, merged):
    """The projector (vision.md §6.2): [N, M] -> [N, T] rows for the language model."""
    z = gelu_erf(merged @ get(names.PROJECTOR_PROJ0).T)
    return rmsnorm(z @ get(names.PROJECTOR_PROJ2).T, get(names.PROJECTOR_POST_NORM),
                   vcfg.projector_ln_eps)


def encode(vcfg: VisionConfig, get, patches, grid):
    """(tower rows [L, D], merged [N, M], projected rows [N, T]), all float64."""
    t = tower(vcfg, get, patches, grid)
    merged = merge(t, grid, vcfg.merge_kernel_size[0])
    return t, merged, project(vcfg, get, merged)
