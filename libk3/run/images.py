"""A run's images (``k3-run --image``, the chat's ``/image``, a batch line's or a server
request's image parts): from a file's bytes to the rows
that stand in the prompt and the ids around them (formats/model/vision.md §8), and the
``--vision-dump`` file (formats/model/vision.md §9).

Owns: reading an image file (a one-line error naming it), the checkpoint's tower read
once, when the first image needs it, each image encoded once per digest (the same file
twice in a run is encoded once), raw prompt mode's ids (every image's markup in order,
then the text; no BOS), expanding a prompt's pads into ``ImageRows``, and writing the
dump. Does not own: preprocessing (``libk3.media``), the tower (``libk3.model.vision``),
how rows enter a pass (``libk3.model.forward``) or the chat template (``libk3.text``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from ..errors import FormatError, UsageError
from ..io.atomic import replacing
from ..media.markup import expand, image_digest, markup, pad_id

DUMP_CONTEXT = 8            # token ids kept each side of a pad in the dump


@dataclasses.dataclass
class Image:
    """One image of a prompt: its file name, the file's size (W, H), digest, pixels
    (``ImagePixels``), rows (``VisionRows``) and the seconds preprocessing and the tower
    took (0 when an earlier image of the run had the same digest)."""
    name: str
    size: tuple
    digest: str
    pixels: object
    encoded: object
    seconds: float = 0.0

    @property
    def rows(self) -> np.ndarray:
        return self.encoded.rows


def read_image_file(path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise FormatError(f"cannot read the image ({e.strerror or e})", path=path) from None


class Images:
    """The images of one run on one session (``engine.session.Session``)."""

    def __init__(self, session, option: str = "--image"):
        vcfg = session.ckpt.vision_config
        if vcfg is None:
            raise UsageError(f"{option}: the checkpoint has no vision tower (its config.json "
                             "has no vision_config): it reads text only")
        if session.tokenizer is None:
            raise UsageError(f"{option} needs the model's tokenizer (tiktoken.model)")
        self.session, self.vcfg = session, vcfg
        self.pad = pad_id(session.tokenizer, vcfg.media_placeholder_token_id)
        self._tower = None
        self._done: dict = {}           # digest -> Image: each image is encoded once

    def tower(self):
        if self._tower is None:
            from ..model.vision import VisionTower
            self._tower = VisionTower.from_checkpoint(self.session.ckpt)
        return self._tower

    def load(self, path) -> Image:
        """The image at ``path`` through preprocessing and the tower (FormatError naming
        the file: not an image, too big, truncated)."""
        return self.load_data(read_image_file(path), str(path))

    def load_data(self, data: bytes, name: str) -> Image:
        """The image file's bytes ``data`` (``name``: the file or field they came from)
        through preprocessing and the tower, or the earlier image of the same digest."""
        from ..media.preprocess import preprocess_image
        digest = image_digest(data, self.vcfg.media)
        if digest in self._done:
            return dataclasses.replace(self._done[digest], name=name, seconds=0.0)
        self.tower()                    # read before the clock starts: its reads are the run's
        t0 = time.perf_counter()
        pixels = preprocess_image(data, self.vcfg.media, name)
        encoded = self.tower().encode(pixels.patches, pixels.grid)
        self._done[digest] = Image(name, tuple(pixels.plan.size), digest, pixels,
                                   encoded, time.perf_counter() - t0)
        return self._done[digest]

    def markup_ids(self, image: Image) -> list:
        return self.session.tokenizer.encode(markup(image.size), allow_special=True)

    def raw_prompt(self, images: list, text_ids: list) -> list:
        """Raw prompt mode's ids: every image's markup in order, then the text (one pad
        per image, not expanded)."""
        return [i for im in images for i in self.markup_ids(im)] + list(text_ids)

    def expand(self, ids: list, images: list, where: str = "the prompt") -> tuple:
        """(expanded ids, ``ImageRows`` of each image at its pad)."""
        from ..model.forward import ImageRows
        out, starts = expand(list(ids), self.pad, [im.rows.shape[0] for im in images], where)
        return out, [ImageRows(s, im.rows, im.digest) for s, im in zip(starts, images)]


def report_entry(image: Image) -> dict:
    """An image as the run report gives it (docs/run.md "Images")."""
    return {"file": image.name, "size": list(image.size), "grid": list(image.pixels.grid),
            "rows": int(image.rows.shape[0]), "digest": image.digest,
            "seconds": round(image.seconds, 6)}


def write_dump(path, images: list, prompt_ids: list, pad: int) -> None:
    """``--vision-dump``: per image what the tower saw and gave, and the ids around its
    pad (formats/model/vision.md §9), written atomically."""
    at = [i for i, t in enumerate(prompt_ids) if t == pad]
    arrays = {"prompt_ids": np.asarray(prompt_ids, np.int64)}
    for i, (im, p) in enumerate(zip(images, at)):
        arrays.update({
            f"image{i}.pixels": im.pixels.patches.astype(np.float32),
            f"image{i}.grid": np.asarray(im.pixels.grid, np.int64),
            f"image{i}.size": np.asarray(im.size, np.int64),
            f"image{i}.tower": im.encoded.tower,
            f"image{i}.merged": im.encoded.merged,
            f"image{i}.rows": im.rows,
            f"image{i}.ids_around": np.asarray(
                prompt_ids[max(p - DUMP_CONTEXT, 0):p + DUMP_CONTEXT + 1], np.int64),
            f"image{i}.pad_index": np.asarray(p, np.int64),
        })
    name = str(path) if str(path).endswith(".npz") else str(path) + ".npz"
    with replacing(name) as f:
        np.savez(f, **arrays)
