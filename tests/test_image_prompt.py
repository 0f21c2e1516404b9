"""Images in the prompt (formats/model/vision.md §8-§9): k3-run --image end to end on
fixtures/tiny, the same ids at two budgets and two thread counts, images told apart by
their rows (and by the prefix cache), the --vision-dump file against VisionTower, the
refusals, and the chat's /image."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from libk3.budget import vision_bytes
from libk3.engine.generate import GenSettings, Prompt, generate
from libk3.engine.prefix_cache import PrefixCache
from libk3.engine.session import open_session
from libk3.errors import UsageError
from libk3.media.markup import markup
from libk3.media.preprocess import preprocess_image
from libk3.model.vision import VisionTower
from libk3.run.images import Images
from .scripts import k3
from .test_lockstep import _streamed

PROMPT = "what is this?"


def _png(path, seed: int, size=(40, 30)):
    from PIL import Image
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def text_only_model(tiny_dir, tmp_path):
    """The bundled model without its vision tower: its files linked, ``vision_config``
    left out of config.json."""
    text_only = tmp_path / "text-only"
    text_only.mkdir()
    for f in os.listdir(tiny_dir):
        if f != "config.json":
            os.symlink(tiny_dir / f, text_only / f)
    cfg = json.loads((tiny_dir / "config.json").read_text())
    del cfg["vision_config"]
    (text_only / "config.json").write_text(json.dumps(cfg))
    return text_only


@pytest.fixture(scope="module")
def pngs(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    return _png(d / "a.png", 1), _png(d / "b.png", 2), _png(d / "wide.png", 3, (70, 20))


@pytest.fixture(scope="module")
def resident(tiny_dir):
    s = open_session(tiny_dir)
    yield s
    s.weights.close()


def _prompt(sess, paths, text=PROMPT):
    images = Images(sess)
    loaded = [images.load(p) for p in paths]
    ids = images.raw_prompt(loaded, sess.tokenizer.encode(text))
    return images, loaded, ids, *images.expand(ids, loaded)


def _gen(sess, paths, gen=6, keep_logits=False, chunk=512):
    _, _, _, ids, rows = _prompt(sess, paths)
    return generate(sess.forward, sess.new_state(), Prompt(ids, tuple(rows)),
                    GenSettings(gen=gen, prefill_chunk=chunk), keep_logits=keep_logits)


def _cli(tiny_dir, *args):
    p = k3(tiny_dir, *args, "--gen", 6, "--json", "--quiet")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_image_prompt_cli_same_ids_at_two_budgets_and_thread_counts(tiny_dir, pngs, resident,
                                                                     tmp_path):
    """Catches --image not reaching the rows (the ids would be the text's), a budget or a
    thread count changing an image prompt's tokens, the report counting the unexpanded
    prompt, or a chunk boundary inside an image losing rows."""
    one = _cli(tiny_dir, "--image", pngs[0], "--image", pngs[2], "-p", PROMPT, "--threads", 1)
    two = _cli(tiny_dir, "--image", pngs[0], "--image", pngs[2], "-p", PROMPT, "--threads", 2,
               "--prefill-chunk", 5)
    assert one["generated_ids"] == two["generated_ids"]
    _, loaded, ids, expanded, rows = _prompt(resident, pngs[0::2])
    assert len(rows) == 2 and one["prompt_ids"] == expanded and len(expanded) == \
        len(ids) - 2 + sum(im.rows.shape[0] for im in loaded)
    assert _gen(resident, pngs[0::2]).generated_ids == one["generated_ids"]
    assert [(r["file"], r["size"], r["rows"], r["digest"]) for r in one["images"]] == \
        [(str(p), list(im.size), im.rows.shape[0], im.digest)
         for p, im in zip(pngs[0::2], loaded)]
    assert one["images"][1]["size"] == [70, 20] and loaded[0].digest != loaded[1].digest
    floor = _streamed(tiny_dir)
    try:
        assert _gen(floor, pngs[0::2], chunk=3).generated_ids == one["generated_ids"]
    finally:
        floor.weights.close()
    text = _cli(tiny_dir, "-p", PROMPT)
    assert len(text["prompt_ids"]) < len(one["prompt_ids"])


def test_markup_is_the_releases_with_the_file_size(resident, pngs):
    """Catches the markup without the size text, the size taken after resizing, or the pad
    not expanded to the image's rows."""
    images, loaded, ids, expanded, rows = _prompt(resident, pngs[2:])
    tok = resident.tokenizer
    assert ids[:len(tok.encode(markup((70, 20)), allow_special=True))] == \
        tok.encode("<|media_begin|>image 70x20<|media_content|><|media_pad|><|media_end|>",
                   allow_special=True)
    n = loaded[0].rows.shape[0]
    assert expanded.count(images.pad) == n and ids.count(images.pad) == 1
    assert expanded[rows[0].start:rows[0].start + n] == [images.pad] * n


def test_different_images_differ_and_the_same_image_gives_the_same_bytes(resident, pngs):
    """Catches rows not reaching the model (two images of one size would give the same
    logits) or an image's rows depending on anything but its bytes."""
    a = _gen(resident, pngs[:1], gen=1, keep_logits=True).logits
    b = _gen(resident, pngs[1:2], gen=1, keep_logits=True).logits
    again = _gen(resident, pngs[:1], gen=1, keep_logits=True).logits
    assert a.shape == b.shape and not np.array_equal(a[-1], b[-1])
    assert a.tobytes() == again.tobytes()


def test_prefix_cache_never_serves_one_images_state_for_another(resident, pngs, tmp_path):
    """Catches a snapshot keyed by ids alone: two images of one size have the same ids."""
    cache = PrefixCache(tmp_path / "pc", 1 << 30, resident.cfg, resident.weights_identity,
                        "no-pack", min_tokens=1)
    _, _, _, ids_a, rows_a = _prompt(resident, pngs[:1])
    _, _, _, ids_b, rows_b = _prompt(resident, pngs[1:2])
    assert ids_a == ids_b
    st = resident.new_state()
    generate(resident.forward, st, Prompt(ids_a, tuple(rows_a)), GenSettings(gen=0),
             feed_last=False)
    assert st.media and st.media[0][2] == rows_a[0].digest
    assert cache.store(st) is None                       # a state with image rows: not kept
    with pytest.raises(UsageError):
        st.save(tmp_path / "s.k3state", resident.weights_identity)
    text = resident.new_state()
    generate(resident.forward, text, ids_a[:rows_a[0].start], GenSettings(gen=0),
             feed_last=False)
    assert cache.store(text) is not None                 # text before the image: kept
    state, n = cache.lookup(ids_b, limit=rows_b[0].start)
    assert n == rows_b[0].start and not state.media


def test_vision_dump_matches_the_tower(tiny_dir, pngs, resident, tmp_path):
    """Catches a dump of other arrays than the tower's, out of order, or ids that are not
    the prompt's around the pad."""
    out = tmp_path / "dump.npz"
    _cli(tiny_dir, "--image", pngs[0], "--image", pngs[2], "-p", PROMPT, "--vision-dump", out)
    d = np.load(out)
    tower = VisionTower.from_checkpoint(resident.ckpt)
    images, _, ids, _, _ = _prompt(resident, pngs[0::2])
    assert d["prompt_ids"].tolist() == ids
    for i, path in enumerate(pngs[0::2]):
        px = preprocess_image(path.read_bytes(), resident.ckpt.vision_config.media)
        want = tower.encode(px.patches, px.grid)
        assert np.array_equal(d[f"image{i}.pixels"], px.patches)
        assert d[f"image{i}.grid"].tolist() == list(px.grid)
        assert d[f"image{i}.size"].tolist() == list(px.plan.size)
        for key in ("tower", "merged", "rows"):
            assert np.array_equal(d[f"image{i}.{key}"], getattr(want, key))
        p = int(d[f"image{i}.pad_index"])
        assert ids[p] == images.pad and images.pad in d[f"image{i}.ids_around"].tolist()
    assert not np.array_equal(d["image0.rows"][:1], d["image1.rows"][:1])


def test_refusals_are_one_line(tiny_dir, tmp_path):
    """Catches a traceback or a wrong exit code for a file that is not an image, a
    truncated one, or a text-only checkpoint given --image."""
    junk = tmp_path / "notes.png"
    junk.write_text("not an image\n")
    p = k3(tiny_dir, "--image", junk, "-p", "hi", "--gen", 1)
    assert p.returncode == 3 and str(junk) in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    cut = tmp_path / "cut.png"
    cut.write_bytes(_png(tmp_path / "whole.png", 4).read_bytes()[:200])
    p = k3(tiny_dir, "--image", cut, "-p", "hi", "--gen", 1)
    assert p.returncode == 3 and str(cut) in p.stderr and "Traceback" not in p.stderr
    text_only = text_only_model(tiny_dir, tmp_path)
    p = k3(text_only, "--image", _png(tmp_path / "ok.png", 5), "-p", "hi", "--gen", 1)
    assert p.returncode == 2 and "vision tower" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = k3(tiny_dir, "--vision-dump", tmp_path / "d.npz", "-p", "hi")
    assert p.returncode == 2 and "--vision-dump goes with --image" in p.stderr


def test_chat_image_command_attaches_to_the_next_message(tiny_dir, pngs, resident, tmp_path):
    """Catches /image not reaching the next message's rows (two images would reply alike),
    a bad file ending the chat, the turn's prompt not counting the image's rows, --image
    not opening the first message as /image does, or a state with image rows saved."""
    replies = []
    for png in pngs[:2]:
        p = k3(tiny_dir, "--chat", "--gen", 4,
               input=f"/image {png}\n/image {png.parent / 'none.png'}\nwhat is it?\n/stats\n")
        assert p.returncode == 0, p.stderr
        assert "opens the next message" in p.stderr and "none.png" in p.stderr
        replies.append(p.stdout)
        n_rows = Images(resident).load(png).rows.shape[0]
        prompt = [ln for ln in p.stderr.splitlines() if "its prompt" in ln][0]
        assert int(prompt.split("its prompt ")[1].split()[0]) > n_rows
    assert replies[0] != replies[1]
    st = tmp_path / "s.k3state"
    p = k3(tiny_dir, "--chat", "--gen", 4, "--image", pngs[0], "--save-state", st,
           input="what is it?\n")
    assert p.returncode == 2 and "--save-state" in p.stderr
    p = k3(tiny_dir, "--chat", "--gen", 4, "--image", pngs[0], input="what is it?\n/stats\n")
    assert p.returncode == 0 and p.stdout == replies[0], p.stderr
    p = k3(tiny_dir, "--chat", "--gen", 4, "--save-state", st,
           input=f"/image {pngs[0]}\nwhat is it?\n")
    assert p.returncode == 0 and "state not saved" in p.stderr and not st.exists()


def test_budget_counts_the_tower_as_held(resident):
    """Catches the budget's rule for the tower drifting from what VisionTower holds, or a
    text-only run paying for it."""
    tower = VisionTower.from_checkpoint(resident.ckpt)
    assert vision_bytes(resident.ckpt.vision_config) == sum(a.nbytes for a in tower.w.values())
    assert vision_bytes(resident.ckpt.vision_config, False) == vision_bytes(None) == 0


def test_prefix_cache_cli_keeps_no_image_state(tiny_dir, pngs, tmp_path):
    """Catches k3-run --prefix-cache resuming an image prompt from a snapshot of another
    image (same ids), or keeping a snapshot of a state with image rows."""
    pc = tmp_path / "pc"
    a = _cli(tiny_dir, "--image", pngs[0], "-p", PROMPT, "--prefix-cache", pc, "--save-prefix")
    assert not list(pc.glob("*.k3state"))
    b = _cli(tiny_dir, "--image", pngs[1], "-p", PROMPT, "--prefix-cache", pc)
    again = _cli(tiny_dir, "--image", pngs[0], "-p", PROMPT, "--prefix-cache", pc)
    assert again["generated_ids"] == a["generated_ids"] != b["generated_ids"]
    assert again["reused_tokens"] == 0


def test_chat_markup_is_structure_at_the_messages_start(tok, template):
    """Catches the markup encoded as typed text (no pad id), put after the text, a typed
    marker or mark taken as an image, or a fresh rendering losing earlier images."""
    from libk3.text.chat import IMAGE_MARK, Conversation
    pad = tok.special_ids["<|media_pad|>"]
    image = tok.encode(markup((40, 30)), allow_special=True)
    convo = Conversation(tok, template)
    ids, fresh = convo.add_user("hi", images=[markup((40, 30))])
    at = ids.index(pad)
    start = at - image.index(pad)
    assert not fresh and ids.count(pad) == 1 and ids[start:start + len(image)] == image
    text = tok.encode("hi")
    assert ids[start + len(image):start + len(image) + len(text)] == text
    typed, _ = Conversation(tok, template).add_user(f"<|media_pad|> {IMAGE_MARK}0{IMAGE_MARK}")
    assert pad not in typed
    plain = Conversation(tok, None)
    ids, _ = plain.add_user("hi", images=[markup((40, 30))])
    assert ids == image + text
