"""The release's size rule: which size an image is processed at and how it is padded
(formats/model/vision.md §4.2).

Owns: the resized size, the padding, the patch grid of an image of a given size, and the
largest image k3 decodes (vision.md §4.1). Does not own: decoding, resizing or pixels
(``libk3.media.preprocess``).

Why written in exactly the release's float form: ``int(W * s)`` truncates, and the area
budget counts ``W // p`` rather than the padded size, so an algebraically equal rewrite
gives another size for some images (a width of 8366 resized to 7167, not 7168).
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import FormatError
from ..vision_config import MediaProcConfig

# Decoded pixels are never more than this, whatever the config: 256 MiB as 4-byte pixels,
# the widest a decoded Pillow pixel is (formats/model/vision.md §4.1).
PIXEL_CEILING = 1 << 26


@dataclasses.dataclass(frozen=True)
class SizePlan:
    """How one image of ``size`` = (W, H) is brought to the tower's patch grid."""

    size: tuple          # (W, H) of the file, as the prompt text reports it
    resized: tuple       # (W', H'): equal to ``size`` when the rule keeps it
    pad: tuple           # (pad_w, pad_h): zero columns on the right, zero rows at the bottom
    grid: tuple          # (gh, gw): patch rows and columns

    @property
    def patches(self) -> int:         # L
        return self.grid[0] * self.grid[1]

    @property
    def needs_resize(self) -> bool:
        return self.resized != self.size


def plan_size(width: int, height: int, media: MediaProcConfig, name: str = "<image>") -> SizePlan:
    """The size plan of a ``width`` x ``height`` image (vision.md §4.2); FormatError naming ``name``
    when the padded grid is wider or taller than the config allows."""
    p, m = media.patch_size, media.merge_kernel_size
    limit_area, limit_side = media.in_patch_limit, media.patch_limit_on_one_side
    # The release's expression, operation for operation, in IEEE double.
    s_area = math.sqrt(limit_area / (max(1.0, width // p) * max(1.0, height // p)))
    s_w = (limit_side * p) / width
    s_h = (limit_side * p) / height
    s = min(1.0, s_area, s_w, s_h)
    new_w = min(max(1, int(width * s)), limit_side * p)
    new_h = min(max(1, int(height * s)), limit_side * p)
    block = m * p
    pad_w = (block - new_w % block) % block
    pad_h = (block - new_h % block) % block
    grid = ((new_h + pad_h) // p, (new_w + pad_w) // p)
    if max(grid) > limit_side:
        raise FormatError(f"a {width}x{height} image pads to a {grid[0]}x{grid[1]} patch grid, "
                          f"more than patch_limit_on_one_side={limit_side} along a side",
                          path=name)
    return SizePlan((width, height), (new_w, new_h), (pad_w, pad_h), grid)


def pixel_limit(media: MediaProcConfig) -> int:
    """The most pixels k3 decodes for one image: the square of the longest side the rule
    keeps, (S p)^2, capped by ``PIXEL_CEILING`` (vision.md §4.1)."""
    side = media.patch_limit_on_one_side * media.patch_size
    return min(side * side, PIXEL_CEILING)
