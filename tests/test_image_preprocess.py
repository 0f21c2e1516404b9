"""Image preprocessing (formats/model/vision.md §4): libk3.media against an independent numpy
reading of the release's rules written here, the worked sizes of vision.md §4.2, and hostile files.

The reference below shares only Pillow with the module (decoding, mode conversion and the
bicubic resize are Pillow's own, as in the release); the size rule, the chessboard, the
compositing, the padding, the normalization and the patch order are written again here,
each in the release's own form rather than the module's (whole-array float ops instead of
a byte table, loops instead of reshapes).
"""

from __future__ import annotations

import copy
import io
import math
import sys

import numpy as np
import pytest

Image = pytest.importorskip("PIL.Image")

from libk3.errors import FormatError, K3Error  # noqa: E402
from libk3.k3_dims import MEDIA_PROC  # noqa: E402
from libk3.media.preprocess import normalization_table, preprocess_image  # noqa: E402
from libk3.media.size_rule import pixel_limit, plan_size  # noqa: E402
from libk3.vision_config import media_from_dict  # noqa: E402


def media_config(**changes):
    cfg = copy.deepcopy(MEDIA_PROC)
    board = changes.pop("board", {})
    cfg.update(changes)
    cfg["transparent_bg_config"].update(board)
    return media_from_dict({"media_proc_cfg": cfg}, source="<test preprocessor_config.json>")


PUBLISHED = media_config()


def encode(im, fmt="PNG", **kw) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **kw)
    return out.getvalue()


# ---- the independent reference -------------------------------------------------------

def ref_size(w, h, cfg):
    p, m = cfg["patch_size"], cfg["merge_kernel_size"]
    A, S = cfg["in_patch_limit"], cfg["patch_limit_on_one_side"]
    s = min(1.0, math.sqrt(A / (max(1.0, w // p) * max(1.0, h // p))), (S * p) / w, (S * p) / h)
    nw, nh = min(max(1, int(w * s)), S * p), min(max(1, int(h * s)), S * p)
    return nw, nh, (m * p - nw % (m * p)) % (m * p), (m * p - nh % (m * p)) % (m * p)


def ref_fill(im, cfg):
    if im.mode == "RGB":
        return np.array(im)
    if "A" not in im.getbands() and "transparency" not in im.info:
        return np.array(im.convert("RGB"))
    rgba = np.array(im.convert("RGBA"))
    h, w = rgba.shape[:2]
    bgc = cfg["transparent_bg_config"]
    sq = bgc["chessboard_square_size"]
    first, second = bgc["chessboard_white_value"], bgc["chessboard_gray_value"]
    if not bgc["chessboard_square_on_top_left"]:
        first, second = second, first
    bg = np.full((h, w, 3), first, np.uint8)
    for i, y in enumerate(range(0, h, sq)):
        for j, x in enumerate(range(0, w, sq)):
            if (i + j) % 2:
                bg[y:y + sq, x:x + sq] = second
    alpha = rgba[:, :, 3:].astype(np.float32) / np.float32(255.0)
    out = alpha * rgba[:, :, :3].astype(np.float32) + \
        (np.float32(1.0) - alpha) * bg.astype(np.float32)
    return out.astype(np.uint8)


def ref_pixels(data, cfg=MEDIA_PROC):
    im = Image.open(io.BytesIO(data))
    nw, nh, pw, ph = ref_size(im.size[0], im.size[1], cfg)
    if cfg["transparent_bg_fill_stage"] == "before_resize":
        u8 = np.array(Image.fromarray(ref_fill(im, cfg)).resize((nw, nh), Image.BICUBIC))
    else:
        u8 = ref_fill(im.resize((nw, nh), Image.BICUBIC), cfg)
    u8 = np.pad(u8, ((0, ph), (0, pw), (0, 0)))
    x = (u8 / 255.0).astype(np.float32)
    x -= np.array(cfg["image_mean"])
    x *= 1 / np.array(cfg["image_std"])
    p = cfg["patch_size"]
    gh, gw = x.shape[0] // p, x.shape[1] // p
    patches = [x[r * p:(r + 1) * p, c * p:(c + 1) * p].transpose(2, 0, 1)
               for r in range(gh) for c in range(gw)]
    return np.stack(patches), (gh, gw)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def noise(rng, size, channels):
    return rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)


def images():
    """(label, file bytes): odd sizes, every mode the release converts, both resize paths."""
    rng = np.random.default_rng(7)
    rgba = noise(rng, (37, 23), 4)
    rgba[..., 3] = rng.choice([0, 1, 77, 128, 254, 255], rgba.shape[:2]).astype(np.uint8)
    pal = Image.fromarray(noise(rng, (19, 31), 1)[..., 0], "L").convert("P")
    pal_t = pal.copy()
    pal_t.info["transparency"] = 5
    gray_t = Image.fromarray(noise(rng, (15, 41), 1)[..., 0], "L")
    deep = Image.fromarray(rng.integers(0, 65536, (17, 29), dtype=np.uint16))
    wide = noise(rng, (7300, 30), 4)
    return [
        ("rgb-13x9", encode(Image.fromarray(noise(rng, (13, 9), 3)))),
        ("rgb-trns", encode(Image.fromarray(rgba[:, :, :3] // 64 * 64), transparency=(0, 64, 128))),
        ("rgba-37x23", encode(Image.fromarray(rgba, "RGBA"))),
        ("rgba-tall-11x700", encode(Image.fromarray(noise(rng, (11, 700), 4), "RGBA"))),
        ("la-29x29", encode(Image.fromarray(rgba[:, :, 2:], "LA"))),
        ("palette-19x31", encode(pal)),
        ("palette-trns", encode(pal_t, transparency=5)),
        ("gray-15x41", encode(gray_t)),
        ("gray-trns", encode(gray_t, transparency=200)),
        ("gray16-17x29", encode(deep)),
        ("bilevel", encode(Image.fromarray(noise(rng, (21, 11), 1)[..., 0]).convert("1"))),
        ("float-tiff", encode(Image.fromarray(
            rng.normal(100, 80, (9, 23)).astype(np.float32), "F"), "TIFF")),
        ("int32-tiff", encode(Image.fromarray(
            rng.integers(-300, 600, (13, 5)).astype(np.int32), "I"), "TIFF")),
        ("cmyk-jpeg", encode(Image.fromarray(noise(rng, (33, 27), 4), "CMYK"), "JPEG")),
        ("gray-jpeg", encode(Image.fromarray(noise(rng, (45, 7), 1)[..., 0]), "JPEG")),
        ("rgba-resize-7300x30", encode(Image.fromarray(wide, "RGBA"))),
        ("palette-resize-8366x20", encode(Image.fromarray(
            noise(rng, (8366, 20), 1)[..., 0]).convert("P"), transparency=3)),
        ("gray-resize-4000x3", encode(Image.fromarray(noise(rng, (4000, 3), 1)[..., 0]))),
    ]


@pytest.mark.parametrize("label,data", images(), ids=[x[0] for x in images()])
def test_preprocess_pixels_bit_for_bit_with_the_release_rules(label, data):
    """Catches compositing in float64 or with rounding, compositing before the resize, a
    resize other than Pillow's bicubic in the file's mode (premultiplied RGBA, nearest for
    palettes), one rounding in the normalization, padding on the wrong side or a patch
    order other than raster rows with channel-major patches."""
    want, grid = ref_pixels(data)
    got = preprocess_image(data, PUBLISHED, label)
    assert got.grid == grid
    assert same_bits(got.patches, want)


@pytest.mark.parametrize("changes", [
    dict(transparent_bg_fill_stage="before_resize"),
    dict(board={"chessboard_square_on_top_left": False, "chessboard_square_size": 3,
                "chessboard_gray_value": 7}),
    dict(image_mean=[0.48145466, 0.4578275, 0.40821073],
         image_std=[0.26862954, 0.26130258, 0.27577711]),
], ids=["before-resize", "board-flipped", "clip-mean-std"])
def test_preprocess_follows_the_config_not_the_published_values(changes):
    """Catches a module that hard-codes the published fill stage, chessboard or
    mean/std instead of reading them from preprocessor_config.json."""
    cfg = copy.deepcopy(MEDIA_PROC)
    cfg["transparent_bg_config"].update(changes.pop("board", {}))
    cfg.update(changes)
    rng = np.random.default_rng(3)
    rgba = noise(rng, (30, 7300), 4)          # resized to 29 x 7168: many composited strips
    data = encode(Image.fromarray(rgba, "RGBA"))
    media = media_from_dict({"media_proc_cfg": cfg})
    want, _ = ref_pixels(data, cfg)
    got = preprocess_image(data, media, "x.png").patches
    assert same_bits(got, want)
    assert not same_bits(got, preprocess_image(data, PUBLISHED, "x.png").patches)  # control


# ---- the size rule: the worked examples ------------------------------------------------

WORKED = [  # (W, H), (W', H'), (pad_w, pad_h), (gh, gw)
    ((1, 1), (1, 1), (27, 27), (2, 2)), ((13, 9), (13, 9), (15, 19), (2, 2)),
    ((28, 28), (28, 28), (0, 0), (2, 2)), ((29, 29), (29, 29), (27, 27), (4, 4)),
    ((56, 56), (56, 56), (0, 0), (4, 4)), ((310, 470), (310, 470), (26, 6), (34, 24)),
    ((512, 512), (512, 512), (20, 20), (38, 38)), ((896, 896), (896, 896), (0, 0), (64, 64)),
    ((1024, 1024), (1024, 1024), (12, 12), (74, 74)),
    ((1920, 1080), (1920, 1080), (12, 12), (78, 138)),
    ((4032, 3024), (4032, 3024), (0, 0), (216, 288)),
    ((3584, 3584), (3584, 3584), (0, 0), (256, 256)),
    ((3585, 3585), (3585, 3585), (27, 27), (258, 258)),
    ((4000, 4000), (3592, 3592), (20, 20), (258, 258)),
    ((7168, 7168), (3584, 3584), (0, 0), (256, 256)),
    ((7300, 30), (7168, 29), (0, 27), (4, 512)), ((7200, 20), (7168, 19), (0, 9), (2, 512)),
    ((8366, 20), (7167, 17), (1, 11), (2, 512)), ((100, 7300), (98, 7168), (14, 0), (512, 8)),
    ((200, 150), (200, 150), (24, 18), (12, 16)),
]


@pytest.mark.parametrize("size,resized,pad,grid", WORKED, ids=[f"{w}x{h}" for (w, h), *_ in WORKED])
def test_size_rule_gives_the_worked_examples(size, resized, pad, grid):
    """Catches resizing every image, padding the wrong amount, or a budget counted on
    the padded size (3585x3585 must keep its size and pad past the patch budget)."""
    plan = plan_size(*size, PUBLISHED)
    assert (plan.resized, plan.pad, plan.grid) == (resized, pad, grid)
    assert plan.needs_resize == (resized != size)


def test_size_rule_truncates_like_the_release():
    """Catches a "simplified" rule that rounds, or computes the side limit as S*p directly:
    int(W * (S p / W)) is one short for 876 widths from 8366 on."""
    short = [w for w in range(7169, 20000) if plan_size(w, 20, PUBLISHED).resized[0] == 7167]
    assert len(short) == 876 and short[0] == 8366
    assert plan_size(8365, 20, PUBLISHED).resized[0] == 7168          # control


@pytest.mark.parametrize("size", [(13, 9), (29, 29), (310, 470), (7300, 30), (8366, 20)])
def test_preprocess_worked_examples_end_to_end(size):
    """Catches a pipeline whose patch count or grid drifts from its own size rule (the
    pad dropped, the grid transposed)."""
    data = encode(Image.new("RGB", size, (10, 200, 30)))
    got = preprocess_image(data, PUBLISHED, "x.png")
    gh, gw = dict((s, g) for s, _, _, g in WORKED)[size]
    assert got.grid == (gh, gw) and got.patches.shape == (gh * gw, 3, 14, 14)
    assert got.plan.size == size
    # the last patch is padding (black, -1) wherever the image does not reach it
    pad_w, pad_h = dict((s, p) for s, _, p, _ in WORKED)[size]
    if pad_w and pad_h:
        assert (got.patches[-1, :, -1, -1] == -1.0).all()
        assert (got.patches[0, :, 0, 0] != -1.0).all()                # control


def test_normalization_rounds_after_each_step():
    """Catches (u/255 - mean)/std in float64 rounded once: 128 of the 256 byte values
    differ from the release's three roundings; u * f32(2/255) - 1 in float32: 111."""
    table = normalization_table(PUBLISHED)[0]
    u = np.arange(256)
    once = ((u / 255 - 0.5) / 0.5).astype(np.float32)
    single = u.astype(np.float32) * np.float32(2 / 255) - np.float32(1)
    assert np.count_nonzero(table != once) == 128
    assert np.count_nonzero(table != single) == 111
    assert table[0] == -1.0 and table[255] == 1.0                     # control


# ---- hostile files ---------------------------------------------------------------------

GOOD = encode(Image.new("RGBA", (30, 20), (1, 2, 3, 100)))


def refused(data, media=PUBLISHED, name="photo.png"):
    with pytest.raises(FormatError) as e:
        preprocess_image(data, media, name)
    msg = str(e.value)
    assert msg.startswith(name + ":") and "\n" not in msg, msg
    return msg


def test_preprocess_refuses_a_file_that_is_not_an_image():
    """Catches Pillow's UnidentifiedImageError escaping as a traceback."""
    assert "not an image" in refused(b"%PDF-1.4 not a picture" * 10)
    assert preprocess_image(GOOD, PUBLISHED, "photo.png").grid == (2, 4)   # control


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF"])
def test_preprocess_refuses_a_truncated_file(fmt):
    """Catches a truncated file decoded into a half-grey picture, or its OSError escaping."""
    rng = np.random.default_rng(1)
    data = encode(Image.fromarray(noise(rng, (64, 48), 3)).convert(
        "P" if fmt == "GIF" else "RGB"), fmt)
    assert "does not decode" in refused(data[:len(data) * 2 // 3])
    preprocess_image(data, PUBLISHED, "photo.png")                        # control


def png_header(width, height):
    """A PNG claiming width x height RGB pixels, with a few bytes of image data."""
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + \
            struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + \
        chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [7169, 30000], ids=["over-the-rule", "over-pillow"])
def test_preprocess_refuses_a_decompression_bomb_from_its_header(side, monkeypatch):
    """Catches a limit checked after decoding (or not at all), and Pillow's own bomb
    error escaping: a header claiming more than (S p)^2 pixels is refused before any
    pixel is decoded."""
    from PIL import ImageFile

    def no_decoding(self):
        raise AssertionError("decoded a bomb")
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    msg = refused(png_header(side, 7168))
    assert "larger than k3 decodes" in msg or "more pixels than k3 decodes" in msg
    assert str(pixel_limit(PUBLISHED)) in msg


def test_preprocess_pixel_limit_is_the_rule_longest_side_squared():
    """Catches a limit that refuses an image the rule accepts at its longest side, or
    admits one larger; a control config with a short side shows both edges."""
    assert pixel_limit(PUBLISHED) == 7168 * 7168
    small = media_config(patch_limit_on_one_side=4, in_patch_limit=16)   # limit 56 x 56
    assert preprocess_image(encode(Image.new("L", (56, 56))), small, "a.png").grid == (4, 4)
    refused(encode(Image.new("L", (56, 57))), small)


def test_preprocess_refuses_a_grid_wider_than_the_side_limit():
    """Catches the release's assertion (padded grid within patch_limit_on_one_side) lost,
    which would index past the tower's rotary table."""
    odd = media_config(patch_limit_on_one_side=3, in_patch_limit=9)
    assert "patch_limit_on_one_side" in refused(encode(Image.new("RGB", (42, 10))), odd)
    assert preprocess_image(encode(Image.new("RGB", (28, 10))), odd, "a.png").grid == (2, 2)


def test_preprocess_takes_the_first_frame_of_an_animation():
    """Catches a module that decodes the last (or every) frame of an animated GIF: the
    release's Image.open gives the first and k3 keeps it."""
    frames = [Image.new("P", (20, 10), c) for c in (10, 200)]
    for f, rgb in zip(frames, [(255, 0, 0), (0, 0, 255)]):
        f.putpalette(list(rgb) * 256)
    anim = io.BytesIO()
    frames[0].save(anim, "GIF", save_all=True, append_images=frames[1:], duration=50)
    got = preprocess_image(anim.getvalue(), PUBLISHED, "a.gif").patches
    first = preprocess_image(encode(frames[0], "GIF"), PUBLISHED, "a.gif").patches
    second = preprocess_image(encode(frames[1], "GIF"), PUBLISHED, "b.gif").patches
    assert same_bits(got, first)
    assert not same_bits(got, second)                                 # control


def test_preprocess_ignores_exif_orientation():
    """Catches an EXIF transpose the release does not apply: a JPEG tagged "rotate 90"
    is processed as stored (its 40x10 size keeps a 2x4 grid, not 4x2)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(Image.new("RGB", (40, 10), (9, 9, 9)), "JPEG", exif=exif.tobytes())
    assert Image.open(io.BytesIO(data)).getexif()[0x0112] == 6       # control: tagged
    assert preprocess_image(data, PUBLISHED, "a.jpg").grid == (2, 4)


def test_preprocess_refuses_formats_k3_does_not_open():
    """Catches every Pillow plugin reachable from a request (EPS runs Ghostscript):
    k3 opens PNG, JPEG, GIF, WebP, BMP and TIFF only."""
    im = Image.new("RGB", (16, 16), (1, 2, 3))
    assert "not an image k3 reads" in refused(encode(im, "PPM"))
    assert "not an image k3 reads" in refused(encode(im, "ICO"))
    for fmt in ("BMP", "TIFF", "WEBP"):                               # controls
        assert preprocess_image(encode(im, fmt), PUBLISHED, "a").grid == (2, 2)


def test_preprocess_without_pillow_says_how_to_install(monkeypatch):
    """Catches an ImportError traceback when the image extra is not installed."""
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(K3Error) as e:
        preprocess_image(GOOD, PUBLISHED, "photo.png")
    assert "pip install 'k3[image]'" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.undo()
    assert preprocess_image(GOOD, PUBLISHED, "photo.png").grid == (2, 4)   # control


def test_preprocess_damaged_files_are_one_line_errors_or_images(recwarn):
    """Catches any Pillow exception or warning escaping on damaged bytes (a flipped header
    byte, a cut stream): each of 240 damaged files is an image or one FormatError line."""
    rng = np.random.default_rng(11)
    base = Image.fromarray(noise(rng, (23, 17), 4), "RGBA")
    seeds = [encode(base, f) for f in ("PNG", "GIF", "WEBP", "TIFF")] + \
        [encode(base.convert("RGB"), f) for f in ("JPEG", "BMP")]
    decoded = 0
    for data in seeds:
        for _ in range(40):
            bad = bytearray(data)
            for i in rng.integers(0, min(len(bad), 64), 3):   # the headers live up front
                bad[i] = int(rng.integers(0, 256))
            bad = bytes(bad[:int(rng.integers(len(bad) // 2, len(bad) + 1))])
            try:
                got = preprocess_image(bad, PUBLISHED, "bad.img")
            except FormatError as e:
                assert "\n" not in str(e) and str(e).startswith("bad.img:")
            else:
                decoded += 1
                assert got.patches.dtype == np.float32 and got.patches.shape[1:] == (3, 14, 14)
    assert [str(w.message) for w in recwarn] == []
    for data in seeds:                                                # control
        assert preprocess_image(data, PUBLISHED, "good.img").grid == (2, 2)
