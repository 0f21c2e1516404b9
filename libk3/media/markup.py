"""How an image stands in a prompt's ids (formats/model/vision.md §8): the release's markup with
the file's own size, the four media tokens found in the tokenizer by name, the single
pad expanded to the image's rows, and the digest that names an image and its
preprocessing. Does not own: the pixels (``preprocess``), the rows (``libk3.model.vision``)
or where images come from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from ..errors import ConfigError, FormatError

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END = (
    "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")


def markup(size: tuple) -> str:
    """The text of one image of the file size (W, H) in a prompt (formats/model/vision.md §8.1)."""
    return f"{MEDIA_BEGIN}image {size[0]}x{size[1]}{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}"


def pad_id(tokenizer, placeholder: int, source: str = "tokenizer_config.json") -> int:
    """The pad's id from the tokenizer by name, checked against config.json's
    ``media_placeholder_token_id``; every media token must be a special of the tokenizer."""
    specials = tokenizer.special_ids
    missing = [t for t in (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END) if t not in specials]
    if missing:
        raise ConfigError(f"the tokenizer has no special token {', '.join(missing)}: images "
                          "cannot be written into a prompt", path=source)
    if specials[MEDIA_PAD] != placeholder:
        raise ConfigError(f"{MEDIA_PAD} is id {specials[MEDIA_PAD]} in the tokenizer but "
                          f"config.json's media_placeholder_token_id is {placeholder}",
                          path=source)
    return specials[MEDIA_PAD]


def image_digest(data: bytes, media) -> str:
    """sha256 of the file's bytes and the preprocessing config (``MediaProcConfig``; its
    ``source`` path left out): equal digests mean equal pixels, so equal rows."""
    cfg = {k: v for k, v in dataclasses.asdict(media).items() if k != "source"}
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode() + b"\n")
    h.update(data)
    return h.hexdigest()


def expand(ids, pad: int, counts: list, where: str = "the prompt") -> tuple:
    """(ids with the k-th pad repeated counts[k] times, the start of each image's rows in
    them). The prompt must hold exactly one pad per image (formats/model/vision.md §8.2)."""
    at = [i for i, t in enumerate(ids) if t == pad]
    if len(at) != len(counts):
        raise FormatError(f"{where} holds {len(at)} {MEDIA_PAD} tokens for {len(counts)} "
                          "images")
    out, starts, done = [], [], 0
    for i, n in zip(at, counts):
        out += ids[done:i]
        starts.append(len(out))
        out += [pad] * n
        done = i + 1
    return out + list(ids[done:]), starts


def rows_in(images, lo: int, hi: int) -> list:
    """The image rows (``forward.ImageRows``, start relative to a prompt) standing at
    prompt positions lo..hi-1, their start made relative to lo: a chunk may cut an image,
    and its rows go in with the positions they stand at (formats/model/vision.md §8.2)."""
    out = []
    for im in images:
        a, b = max(im.start, lo), min(im.start + im.rows.shape[0], hi)
        if a < b:
            out.append(im._replace(start=a - lo, rows=im.rows[a - im.start:b - im.start]))
    return out
