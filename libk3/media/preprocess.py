"""An image's pixels as the release's preprocessing makes them: resize, transparency,
padding, normalization and patch order (formats/model/vision.md §4).

Owns: ``preprocess_image`` (bytes in; float32 patches [L, 3, p, p], the grid and the
original size out) and its steps after decoding. Does not own: decoding and the limits on
hostile files (``libk3.media.decode``), the size rule (``libk3.media.size_rule``), the
tower that consumes the patches.

Why Pillow does the resizing and mode conversions: they are the release's own steps
(bicubic, with Pillow's premultiplied alpha and its nearest-neighbour for palette images),
so calling Pillow is the only way to equal them bit for bit. Everything after, compositing
and normalization, is numpy in the release's float32/float64 steps (vision.md §4.4, vision.md §4.6), because a
single rounding instead of two changes about half the byte values.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..vision_config import Chessboard, MediaProcConfig
from .decode import open_image, pillow, refuse
from .size_rule import SizePlan, plan_size

# Rows composited at a time: the float32 temporaries stay a few MB whatever the image.
_STRIP_ROWS = 256


@dataclasses.dataclass(frozen=True)
class ImagePixels:
    """What the tower sees of one image."""

    patches: np.ndarray   # float32 (L, 3, p, p): raster order over the grid, channel-major
    plan: SizePlan        # original size, resized size, padding, grid (gh, gw)

    @property
    def grid(self) -> tuple:
        return self.plan.grid


def chessboard(rows: range, width: int, board: Chessboard) -> np.ndarray:
    """Rows ``rows`` of the background of vision.md §4.4, uint8 (len(rows), width): white where the
    square index (y // size + x // size) is even (odd if ``on_top_left`` is false), gray
    elsewhere; the squares are anchored at the image's top-left pixel whatever ``rows``."""
    ys = np.arange(rows.start, rows.stop) // board.square_size
    xs = np.arange(width) // board.square_size
    odd = (ys[:, None] + xs[None, :]) % 2 == 1
    if not board.on_top_left:
        odd = ~odd
    return np.where(odd, np.uint8(board.gray_value), np.uint8(board.white_value))


def composite(rgba: np.ndarray, board: Chessboard) -> np.ndarray:
    """uint8 (h, w, 3): ``rgba`` (uint8 (h, w, 4)) over the chessboard, each operation in
    float32 and the result truncated toward zero, as the release does (vision.md §4.4)."""
    h, w = rgba.shape[:2]
    out = np.empty((h, w, 3), np.uint8)
    one, full = np.float32(1), np.float32(255)
    for y0 in range(0, h, _STRIP_ROWS):
        part = rgba[y0:y0 + _STRIP_ROWS]
        bg = chessboard(range(y0, y0 + len(part)), w, board)[:, :, None].astype(np.float32)
        a = part[..., 3:4].astype(np.float32) / full
        mixed = a * part[..., :3].astype(np.float32) + (one - a) * bg
        out[y0:y0 + _STRIP_ROWS] = mixed.astype(np.uint8)
    return out


def to_rgb(im, board: Chessboard, name: str) -> np.ndarray:
    """uint8 (h, w, 3) of a Pillow image, as the release's ``fill_transparent_bg_with``:
    RGB as is; no alpha band and no transparency key: Pillow's RGB conversion; otherwise
    Pillow's RGBA conversion composited over the chessboard (vision.md §4.4)."""
    try:
        if im.mode == "RGB":
            return np.asarray(im, dtype=np.uint8)
        if "A" not in im.getbands() and "transparency" not in im.info:
            return np.asarray(im.convert("RGB"), dtype=np.uint8)
        rgba = np.asarray(im.convert("RGBA"), dtype=np.uint8)
    except Exception as e:            # Pillow on a hostile mode: see libk3.media.decode
        raise refuse(name, f"{im.mode} image does not convert to RGB", e) from None
    return composite(rgba, board)


def normalization_table(media: MediaProcConfig) -> np.ndarray:
    """float32 (3, 256): the normalized value of each byte in each channel,
    f32(f32(f32(u / 255) - mean) * (1 / std)), each step in float64 then rounded (vision.md §4.6)."""
    scaled = (np.arange(256) / 255.0).astype(np.float32)
    table = np.empty((3, 256), np.float32)
    for c in range(3):
        centred = (scaled.astype(np.float64) - float(media.image_mean[c])).astype(np.float32)
        table[c] = (centred.astype(np.float64) * (1.0 / float(media.image_std[c]))) \
            .astype(np.float32)
    return table


def patchify(rgb: np.ndarray, plan: SizePlan, media: MediaProcConfig) -> np.ndarray:
    """float32 (L, 3, p, p) of the resized uint8 image ``rgb`` (H', W', 3): zero-padded at
    the bottom and right, normalized, cut into patches in raster order, channel-major
    inside each (vision.md §4.5 to vision.md §4.7)."""
    p = media.patch_size
    gh, gw = plan.grid
    padded = np.zeros((gh * p, gw * p, 3), np.uint8)
    padded[:rgb.shape[0], :rgb.shape[1]] = rgb
    # (gh, p, gw, p, 3) -> (gh, gw, 3, p, p)
    u8 = padded.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    table = normalization_table(media)
    out = np.empty(u8.shape, np.float32)
    for c in range(3):
        out[:, c] = table[c][u8[:, c]]
    return out


def resize(im, size: tuple, name: str):
    """Pillow's bicubic resize of ``im`` to ``size`` = (W', H') in the image's own mode
    (vision.md §4.3); the image itself when the size is kept (Pillow's resize would copy it)."""
    if im.size == tuple(size):
        return im
    Image = pillow()
    try:
        return im.resize(size, Image.Resampling.BICUBIC)
    except Exception as e:            # Pillow on a hostile mode: see libk3.media.decode
        raise refuse(name, f"{im.mode} image does not resize", e) from None


def preprocess_image(data: bytes, media: MediaProcConfig, name: str = "<image>") -> ImagePixels:
    """The release's pixels of the image file ``data`` (vision.md §4): first frame, no EXIF
    rotation, size rule, Pillow bicubic resize only when the rule changes the size,
    chessboard compositing at ``transparent_bg_fill_stage``, padding, normalization, patch
    order. FormatError naming ``name`` for anything that is not such an image."""
    Image = pillow()
    with open_image(data, media, name) as im:
        plan = plan_size(im.size[0], im.size[1], media, name)
        if media.transparent_bg_fill_stage == "before_resize":
            rgb = to_rgb(im, media.background, name)
            with Image.fromarray(rgb, "RGB") as flat:
                rgb = np.asarray(resize(flat, plan.resized, name), dtype=np.uint8)
        else:
            rgb = to_rgb(resize(im, plan.resized, name), media.background, name)
    return ImagePixels(patchify(rgb, plan, media), plan)
