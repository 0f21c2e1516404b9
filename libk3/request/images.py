"""The images of a request's messages (a server body, a batch line): where each image's
bytes come from, checked, and the markup that stands for it in its message
(formats/model/vision.md §8.1; docs/serve.md "Images").

Owns: reading OpenAI's ``image_url`` content parts (Anthropic's base64 image blocks
arrive converted to such parts by ``serve.anthropic``): a ``data:`` URL with base64 bytes
always; a local path or ``file:`` URL only inside the directory ``--image-dir`` names
(relative paths resolved against it, symlinks resolved before the check); an http(s)
URL never (k3 fetches nothing). Checking the base64, the declared media type against the
bytes, that the bytes decode as a bounded image (``media.decode``), and the limits of one
request. Turning a user message's parts into one text with each image's markup where
its part stood, so a conversation renders as the chat REPL's ``/image`` renders it.
Does not own: the pixels, the tower or the rows (``libk3.media``, ``libk3.run.images``),
a message's other checks, or how a surface reports a refusal (each maps
``ImageRefused``: HTTP 400, a skipped batch line).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import re
import urllib.parse

from ..errors import FormatError

MAX_IMAGES = 8                   # images in one request (or batch line), at most
MAX_IMAGE_BYTES = 20 * 2 ** 20   # their files' bytes together, at most
# The first bytes of each format ``media.decode`` opens, by the media type a client names.
SIGNATURES = (("image/png", (b"\x89PNG\r\n\x1a\n",)), ("image/jpeg", (b"\xff\xd8\xff",)),
              ("image/gif", (b"GIF87a", b"GIF89a")), ("image/bmp", (b"BM",)),
              ("image/tiff", (b"II*\x00", b"MM\x00*")))
DETAILS = (None, "auto")         # OpenAI's ``detail``: k3 has one size rule, no other level
_DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),(.*)", re.S)


class ImageRefused(ValueError):
    """An image part k3 will not read; the message names the field."""


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """One image of a request: its file's bytes, the field it came from, its size (W, H)
    and the rows it stands for in the prompt."""
    data: bytes
    name: str
    size: tuple
    rows: int


def sniffed_type(data: bytes) -> str | None:
    """The media type the bytes begin like (None: none k3 opens)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for kind, heads in SIGNATURES:
        if any(data.startswith(h) for h in heads):
            return kind
    return None


def is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def read_parts(messages, media, image_dir=None, names=None) -> tuple:
    """(messages, [ImageInput]): each user message holding image parts becomes one text,
    its text parts and each image's markup in order; messages without images are
    returned as given. ``media``: the checkpoint's ``MediaProcConfig`` (None: it has no
    vision tower, and an image is refused); ``names``: the field of each image part in
    order, when the request gave them under other names (Anthropic's blocks).
    ImageRefused naming the field of the first image that cannot be read."""
    from ..media.markup import markup
    out, images, total = [], [], 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(map(is_image_part, content)):
            out.append(message)
            continue
        text = []
        for j, part in enumerate(content):
            at = f'"messages"[{i}]["content"][{j}]'
            if not is_image_part(part):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise ImageRefused(f"{at} is not a text or image_url part")
                text.append(part["text"])
                continue
            where = names[len(images)] if names else at
            extra = sorted(set(part) - {"type", "image_url"})
            if extra:
                raise ImageRefused(f"{where}: unknown key {extra[0]!r}")
            if message.get("role") != "user":
                raise ImageRefused(f"{where}: an image goes in a user message")
            if media is None:
                raise ImageRefused(f"{where}: this model reads no images (its checkpoint has "
                                   "no vision tower, or the run did not load it)")
            if len(images) == MAX_IMAGES:
                raise ImageRefused(f"{where}: more than {MAX_IMAGES} images in one request")
            data = _bytes(part, where, image_dir, MAX_IMAGE_BYTES - total)
            total += len(data)
            images.append(_checked(data, media, where))
            text.append(markup(images[-1].size))
        out.append({**message, "content": "".join(text)})
    return out, images


def _bytes(part, where: str, image_dir, room: int) -> bytes:
    """The file bytes an image part names (at most ``room`` of them)."""
    given = part.get("image_url")
    url = given.get("url") if isinstance(given, dict) else given
    if isinstance(given, dict):
        extra = sorted(set(given) - {"url", "detail"})
        if extra:
            raise ImageRefused(f'{where}["image_url"]: unknown key {extra[0]!r}')
        if given.get("detail") not in DETAILS:
            raise ImageRefused(f'{where}["image_url"]["detail"]: k3 reads an image at one '
                               f'size (its size rule): give "auto" or leave it out, got '
                               f'{str(given.get("detail"))[:20]!r}')
    if not isinstance(url, str) or not url:
        raise ImageRefused(f'{where}["image_url"] must be a URL string or {{"url": URL}}')
    scheme = urllib.parse.urlsplit(url[:64]).scheme.lower() if ":" in url[:64] else ""
    if scheme == "data":
        data = _data_url(url, where)
    elif scheme in ("http", "https", "ftp"):
        raise ImageRefused(f"{where}: k3 fetches nothing from the network: send the image "
                           "as a data: URL (base64)")
    elif scheme in ("", "file") or len(scheme) == 1:      # a path (C: on Windows) or file:
        data = _local(url, where, image_dir, room)
    else:
        raise ImageRefused(f"{where}: a {scheme!r} URL is not read: send a data: URL (base64)")
    if len(data) > room:
        raise ImageRefused(f"{where}: the request's images are over {MAX_IMAGE_BYTES} bytes")
    return data


def _data_url(url: str, where: str) -> bytes:
    m = _DATA_URL.fullmatch(url)
    if m is None or "base64" not in m.group(2).lower().split(";"):
        raise ImageRefused(f"{where}: a data: URL must be data:image/TYPE;base64,DATA")
    declared = m.group(1).strip().lower()
    if not declared.startswith("image/"):
        raise ImageRefused(f"{where}: media type {declared[:40]!r} is not an image")
    try:
        data = base64.b64decode(m.group(3), validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused(f"{where}: the data is not valid base64") from None
    found = sniffed_type(data)
    if found != declared and not (declared == "image/jpg" and found == "image/jpeg"):
        raise ImageRefused(f"{where}: the media type says {declared[:40]} but the bytes are "
                           f"{found or 'not an image k3 reads'}")
    return data


def _local(url: str, where: str, image_dir, room: int) -> bytes:
    """A file under ``image_dir`` (the request's path resolved there, symlinks too)."""
    if image_dir is None:
        raise ImageRefused(f"{where}: a local path is read only from the directory "
                           "--image-dir names (none was given): send a data: URL (base64)")
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path) \
        if url.lower().startswith("file:") else url
    if "\0" in path:
        raise ImageRefused(f"{where}: the path holds a NUL character")
    root = os.path.realpath(image_dir)
    real = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, real]) != root:
        raise ImageRefused(f"{where}: the path is outside the directory --image-dir names")
    if not os.path.isfile(real):          # a FIFO or device could block or never end
        raise ImageRefused(f"{where}: the path is not a regular file in --image-dir")
    try:
        with open(real, "rb") as f:
            data = f.read(room + 1)
    except OSError as e:
        raise ImageRefused(f"{where}: cannot read the image ({e.strerror or e})") from None
    return data


def _checked(data: bytes, media, where: str) -> ImageInput:
    """The image decoded once (not an image, truncated, too many pixels: refused), its
    size and rows from the size rule."""
    from ..media.decode import open_image
    from ..media.size_rule import plan_size
    try:
        im = open_image(data, media, where)
        size = im.size
        im.close()
        plan = plan_size(*size, media, where)
    except FormatError as e:
        raise ImageRefused(e.one_line()) from None
    return ImageInput(data, where, tuple(size), plan.patches // media.merge_kernel_size ** 2)
