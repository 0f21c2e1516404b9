"""The image tower, patch merger and projector on the numba kernels: one image's patches
in, the rows that enter the language model out (formats/model/vision.md §5-§7).

Owns: ``VisionTower`` (the 3 + 6 B + 3 image tensors bound and checked, held in memory,
and ``encode``), ``read_vision_tensors`` (those tensors from a validated checkpoint), and
the per-image geometry the kernels take: the position table resized to the grid and the
rotary cos / sin tables (vision.md §5.2, §5.3). Does not own: preprocessing
(``libk3.media``), the kernels' arithmetic (``libk3.kernels``: ``bf16.matmul``,
``norms.rmsnorm``, ``activations.gelu_*``, ``vit``), where the rows go in the prompt.

WHY held, not streamed: the whole tower is 0.9 GB at the published size and every block
runs once per image; streaming it at small budgets as the trunk is streamed is left for
later. Its matrices stay BF16 bits (as ``read_matrix`` gives them) and are widened inside
the matmul like the trunk's. The float64 oracle is ``libk3.model.vision_reference``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .. import names
from ..errors import CheckpointError
from ..io.dtypes import bf16_to_f32, matrix_operand, widen
from ..io.inventory import MATRIX
from ..io.inventory import vision_specs
from ..kernels import activations, bf16, norms, vit
from ..vision_config import VIT_NORM_EPS, VisionConfig


@dataclasses.dataclass(frozen=True)
class VisionRows:
    """One image through the tower: float32 arrays in raster / block order."""

    grid: tuple            # (gh, gw) patches
    tower: np.ndarray      # (L, D) final-normed rows (vision.md §5.6)
    merged: np.ndarray     # (N, m m D) (vision.md §6.1)
    rows: np.ndarray       # (N, text_hidden_size) for the language model (vision.md §6.2)


def read_vision_tensors(ckpt) -> dict:
    """Every image tensor of a checkpoint opened with validation (its ``vision_config``
    set): matrices as the dense kernels take them, vectors and the position table float32."""
    vcfg = ckpt.vision_config
    if vcfg is None:
        raise CheckpointError("the checkpoint has no vision_config: it is a text model",
                              path=ckpt.model_dir)
    out = {}
    for spec in vision_specs(vcfg):
        ent = ckpt.vision_entry(spec.name)
        raw = ckpt.read_span(ent.path, ent.offset, ent.nbytes)
        if spec.kind == MATRIX:
            out[spec.name] = matrix_operand(raw, ent.dtype, ent.shape)
        else:
            out[spec.name] = np.ascontiguousarray(widen(raw, ent.dtype, ent.shape), np.float32)
    return out


def resize_table(table: np.ndarray, gh: int, gw: int) -> np.ndarray:
    """[gh gw, D] float32: the position table [Ph, Pw, D] resized bilinearly in float64
    (half-pixel centres, edges clamped) and rounded once (vision.md §5.2)."""
    def axis(n_in, n_out):
        src = np.maximum((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0.0)
        i0 = np.floor(src).astype(np.int64)
        return i0, np.minimum(i0 + 1, n_in - 1), src - i0

    r0, r1, lr = axis(table.shape[0], gh)
    c0, c1, lc = axis(table.shape[1], gw)
    t = table.astype(np.float64)
    lc = lc[None, :, None]
    top = (1 - lc) * t[r0][:, c0] + lc * t[r0][:, c1]
    bottom = (1 - lc) * t[r1][:, c0] + lc * t[r1][:, c1]
    out = (1 - lr[:, None, None]) * top + lr[:, None, None] * bottom
    return np.ascontiguousarray(out.reshape(gh * gw, -1), np.float32)


def rope_tables(gh: int, gw: int, hd: int) -> tuple:
    """(cos, sin) [L, hd / 2] float32 of the float32 angles of vision.md §5.3: pair 2i of
    patch (y, x) turns by f32(x theta_i), pair 2i + 1 by f32(y theta_i); cos and sin of
    each angle in float64, rounded once."""
    i = np.arange(hd // 4)
    expo = (np.float32(4) * i.astype(np.float32)) / np.float32(hd)        # f32
    theta = np.float32(1) / (10000.0 ** expo.astype(np.float64)).astype(np.float32)
    ys, xs = np.divmod(np.arange(gh * gw), gw)
    ang = np.empty((gh * gw, hd // 2), np.float32)
    ang[:, 0::2] = xs.astype(np.float32)[:, None] * theta[None, :]
    ang[:, 1::2] = ys.astype(np.float32)[:, None] * theta[None, :]
    a = ang.astype(np.float64)
    return (np.ascontiguousarray(np.cos(a), np.float32),
            np.ascontiguousarray(np.sin(a), np.float32))


def merge(t: np.ndarray, grid: tuple, m: int) -> np.ndarray:
    """[N, m m D]: m × m blocks row-major, inside a block patches row by row (vision.md §6.1)."""
    gh, gw = grid
    D = t.shape[1]
    blocks = t.reshape(gh // m, m, gw // m, m, D).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(blocks.reshape((gh // m) * (gw // m), m * m * D))


def _bind(vcfg: VisionConfig, tensors: dict) -> dict:
    """The tensors of vision_specs(vcfg), shapes checked: matrices uint16 BF16 bits or
    float32 (the conv weight as [D, 3 p p]), vectors float32."""
    out = {}
    for spec in vision_specs(vcfg):
        arr = tensors.get(spec.name)
        if arr is None:
            raise CheckpointError("image tensor missing", path=vcfg.source, tensor=spec.name)
        if tuple(arr.shape) != spec.shape or arr.dtype not in (np.uint16, np.float32):
            raise CheckpointError("image tensor has the wrong shape or dtype",
                                  path=vcfg.source, tensor=spec.name,
                                  expected=f"{list(spec.shape)} BF16/F32",
                                  found=f"{list(arr.shape)} {arr.dtype}")
        if spec.kind != MATRIX and arr.dtype == np.uint16:
            arr = bf16_to_f32(arr)
        arr = np.ascontiguousarray(arr)
        out[spec.name] = arr.reshape(spec.shape[0], -1) if arr.ndim == 4 else arr
    return out


class VisionTower:
    """The tower, merger and projector of one checkpoint, every tensor held."""

    def __init__(self, vcfg: VisionConfig, tensors: dict):
        self.vcfg = vcfg
        self.w = _bind(vcfg, tensors)

    @classmethod
    def from_checkpoint(cls, ckpt) -> "VisionTower":
        return cls(ckpt.vision_config, read_vision_tensors(ckpt))

    def _block(self, b: int, x, cos, sin):
        """One encoder block on x [L, D] in place (vision.md §5.4)."""
        v = self.vcfg
        W = lambda sfx: self.w[names.vision_block(b, sfx)]           # noqa: E731
        L, D = x.shape
        H, hd = v.vt_num_attention_heads, v.vt_head_dim
        h = np.empty_like(x)
        norms.rmsnorm(x, W("norm0.weight"), VIT_NORM_EPS, h)
        qkv = np.empty((L, 3 * v.qkv_hidden_size), np.float32)
        bf16.matmul(W("wqkv.weight"), h, qkv)
        q, k, val = (np.empty((H, L, hd), np.float32) for _ in range(3))
        vit.split_heads(qkv, 0, cos, sin, True, q)
        vit.split_heads(qkv, 1, cos, sin, True, k)
        vit.split_heads(qkv, 2, cos, sin, False, val)
        a = np.empty((L, v.qkv_hidden_size), np.float32)
        vit.attention(q, k, val, 1.0 / math.sqrt(hd), a)
        o = np.empty_like(x)
        bf16.matmul(W("wo.weight"), a, o)
        x += o
        norms.rmsnorm(x, W("norm1.weight"), VIT_NORM_EPS, h)
        u = np.empty((L, v.vt_intermediate_size), np.float32)
        bf16.matmul(W("mlp.fc0.weight"), h, u)
        activations.gelu_tanh(u.reshape(-1), u.reshape(-1))
        bf16.matmul(W("mlp.fc1.weight"), u, o)
        x += o

    def tower(self, patches: np.ndarray, grid: tuple) -> np.ndarray:
        """The final-normed rows [L, D] float32 of patches [L, 3, p, p] (vision.md §5)."""
        v = self.vcfg
        gh, gw = grid
        L, D = gh * gw, v.vt_hidden_size
        if patches.shape != (L, 3, v.patch_size, v.patch_size):
            raise ValueError(f"tower: patches {patches.shape} do not fill grid {grid}")
        m = v.merge_kernel_size[0]
        if gh % m or gw % m:
            raise ValueError(f"tower: grid {grid} is not a multiple of the merge {m}")
        pixels = np.ascontiguousarray(patches, np.float32).reshape(L, v.patch_inputs)
        x = np.empty((L, D), np.float32)
        bf16.matmul(self.w[names.VISION_PATCH_EMBED], pixels, x)
        x += resize_table(self.w[names.VISION_POS_EMB], gh, gw)
        cos, sin = rope_tables(gh, gw, v.vt_head_dim)
        for b in range(v.vt_num_hidden_layers):
            self._block(b, x, cos, sin)
        norms.rmsnorm(x, self.w[names.VISION_FINAL_NORM], VIT_NORM_EPS, x)
        return x

    def project(self, merged: np.ndarray) -> np.ndarray:
        """The projector (vision.md §6.2): [N, M] -> [N, text_hidden_size] float32."""
        v = self.vcfg
        N, M = merged.shape
        z = np.empty((N, M), np.float32)
        bf16.matmul(self.w[names.PROJECTOR_PROJ0], merged, z)
        activations.gelu_erf(z.reshape(-1), z.reshape(-1))
        rows = np.empty((N, v.text_hidden_size), np.float32)
        bf16.matmul(self.w[names.PROJECTOR_PROJ2], z, rows)
        norms.rmsnorm(rows, self.w[names.PROJECTOR_POST_NORM], v.projector_ln_eps, rows)
        return rows

    def encode(self, patches: np.ndarray, grid: tuple) -> VisionRows:
        """One image's patches (``libk3.media.preprocess_image``) to its rows."""
        t = self.tower(patches, grid)
        merged = merge(t, grid, self.vcfg.merge_kernel_size[0])
        return VisionRows(tuple(grid), t, merged, self.project(merged))
