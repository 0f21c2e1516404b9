"""Decoding an image file's bytes with Pillow, refusing what is not a bounded image
(formats/model/vision.md §4.1).

Owns: the lazy Pillow import and its install hint, the formats k3 opens, the pixel limit
checked from the header before any pixel is decoded, and turning every Pillow failure on
hostile bytes into one FormatError naming the image. Does not own: the size rule's numbers
(``libk3.media.size_rule``) or what is done with the pixels (``libk3.media.preprocess``).

Why a catch-all around Pillow: its plugins parse untrusted bytes and raise whatever their
parser hits (OSError, ValueError, SyntaxError, struct and zlib errors, MemoryError); any of
them means "this is not an image k3 can read", and a caller must get one line, not a trace.
Why a list of formats: the release opens anything Pillow identifies, but some plugins run
external programs (EPS) or are rarely exercised parsers; k3 opens the formats clients send
and common files hold.
"""

from __future__ import annotations

import io
import warnings

from ..errors import FormatError, K3Error
from ..vision_config import MediaProcConfig
from .size_rule import pixel_limit

INSTALL_HINT = "pip install 'k3[image]'"
# Pillow's names of the formats k3 opens (JPEG includes the multi-picture JPEG of cameras).
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")


def pillow():
    """Pillow's ``Image`` module, or a K3Error saying how to install it."""
    try:
        from PIL import Image
    except ImportError:
        raise K3Error(f"image input needs Pillow, which is not installed: {INSTALL_HINT}") \
            from None
    return Image


def refuse(name: str, what: str, err: BaseException | None = None) -> FormatError:
    """The FormatError for image ``name``: ``what`` went wrong, with Pillow's reason."""
    if err is not None:
        reason = (str(err).splitlines() or [""])[0][:200]
        what += f" ({type(err).__name__}{': ' + reason if reason else ''})"
    return FormatError(what, path=name)


def open_image(data: bytes, media: MediaProcConfig, name: str = "<image>"):
    """The first frame of the image in ``data``, decoded (a loaded Pillow image in the
    file's own mode). FormatError naming ``name`` when it is not an image of a format k3
    opens, claims more pixels than ``pixel_limit(media)`` (checked from the header, before
    decoding), or does not decode (truncated or corrupt)."""
    Image = pillow()
    limit = pixel_limit(media)
    with warnings.catch_warnings():
        # Pillow warns of damaged metadata and of large images; k3 answers with the pixels
        # or one error, and its own pixel limit is below the size Pillow warns at.
        warnings.simplefilter("ignore")
        return _open_checked(Image, data, limit, name)


def _open_checked(Image, data: bytes, limit: int, name: str):
    """``open_image`` without its warning filter (``Image``: Pillow's module)."""
    try:
        Image.init()                  # registers every plugin, so OPEN lists what is built
        im = Image.open(io.BytesIO(data), formats=[f for f in FORMATS if f in Image.OPEN])
    except Image.DecompressionBombError as e:
        raise refuse(name, f"image has more pixels than k3 decodes (at most {limit})",
                     e) from None
    except Image.UnidentifiedImageError:
        raise refuse(name, "not an image k3 reads (formats: " + ", ".join(FORMATS) + ")") \
            from None
    except Exception as e:            # hostile bytes: see the module docstring
        raise refuse(name, "not a readable image", e) from None
    try:
        _check_and_load(im, limit, name)
    except FormatError:
        im.close()
        raise
    return im


def _check_and_load(im, limit: int, name: str) -> None:
    """Refuse ``im`` from its header size, then decode its first frame."""
    width, height = im.size
    if width < 1 or height < 1:
        raise refuse(name, f"{im.format} image is {width}x{height} pixels: nothing to see")
    if width * height > limit:
        raise FormatError(f"{im.format} image of {width}x{height} pixels is larger than "
                          "k3 decodes (a decompression bomb, or a picture to shrink first)",
                          path=name, expected=f"<= {limit} pixels",
                          found=f"{width * height} pixels")
    try:
        im.load()                     # the first frame only: k3 never seeks (vision.md §4.1)
    except Exception as e:            # hostile bytes: see the module docstring
        raise refuse(name, f"{im.format} image does not decode (truncated or corrupt)",
                     e) from None
