"""Images from the server and from batch lines (docs/serve.md "Images", formats/batch.md):
OpenAI image_url parts and Anthropic base64 blocks on a live ``k3-run --serve`` of
fixtures/tiny give the ids of the chat's ``/image`` path for the same conversation; every
refusal is a 400 naming the field; --image-dir lets paths inside it in and nothing
outside; a batch line with an image part gives the server's ids, and a bad image skips
its line only."""

from __future__ import annotations

import base64
import json
import os

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("PIL")

from libk3.engine.generate import GenSettings  # noqa: E402
from libk3.request import images as request_images  # noqa: E402
from libk3.request.images import ImageRefused, read_parts  # noqa: E402
from libk3.run.chat_session import Chat  # noqa: E402
from libk3.run.images import Images  # noqa: E402
from libk3.run.runner import RunOptions, open_run  # noqa: E402
from .scripts import k3  # noqa: E402
from .test_image_preprocess import png_header  # noqa: E402
from .test_image_prompt import _png, text_only_model  # noqa: E402
from .test_serve import _client, _post, _start, _stop  # noqa: E402

TEXT = "what is this?"
GEN = 4


def _data_url(path, kind="image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def _openai(*parts, role="user") -> bytes:
    return json.dumps({"model": "tiny", "max_tokens": GEN, "messages": [
        {"role": role, "content": list(parts)}]}).encode()


def _image_part(url, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


TEXT_PART = {"type": "text", "text": TEXT}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Three PNGs of one size in an image directory (one in a subdirectory), one outside
    it, and a symlink in it that points outside."""
    root = tmp_path_factory.mktemp("images")
    allowed = root / "allowed"
    (allowed / "sub").mkdir(parents=True)
    f = {"a": _png(allowed / "a.png", 1), "b": _png(allowed / "sub" / "b.png", 2),
         "outside": _png(root / "outside.png", 3), "dir": allowed}
    os.symlink(f["outside"], allowed / "escape.png")
    return f


@pytest.fixture(scope="module")
def servers(tiny_dir, files, tmp_path_factory):
    """A live server with --image-dir and one without."""
    d = tmp_path_factory.mktemp("serve-images")
    with_dir = _start(tiny_dir, d / "with.log", "--gen", GEN, "--image-dir", files["dir"])
    without = _start(tiny_dir, d / "without.log", "--gen", GEN)
    yield {"dir": with_dir, "none": without}
    _stop(with_dir)
    _stop(without)


@pytest.fixture(scope="module")
def chat_ids(tiny_dir, files):
    """image name -> (prompt ids, generated ids) of the chat's /image path: the image
    attached, then TEXT as the message, greedy, GEN tokens."""
    out = {}
    with open_run(RunOptions(model=str(tiny_dir), progress=False, vision=True)) as run:
        for name in ("a", "b"):
            chat = Chat(run, GenSettings(gen=GEN))
            chat.attach(files[name])
            res = chat.turn(TEXT)
            out[name] = (list(res.prompt_ids), list(res.generated_ids))
    return out


def _k3(status_body) -> tuple:
    status, body = status_body
    assert status == 200, body
    return body["k3"]["prompt_ids"], body["k3"]["generated_ids"]


def test_openai_image_url_gives_the_chat_image_commands_ids(servers, files, chat_ids):
    """Catches an image part dropped or rendered as text (the ids would be the text's),
    markup placed elsewhere than /image puts it, rows of another image, the string form
    of image_url read differently from the object form, or a streamed answer that
    differs from the whole one."""
    srv = servers["none"]
    for name in ("a", "b"):
        got = _k3(_post(srv, "/v1/chat/completions",
                        _openai(_image_part(_data_url(files[name])), TEXT_PART)))
        assert got == chat_ids[name]
    # the control: two images of one size, same ids in the prompt, told apart by rows
    assert chat_ids["a"][0] == chat_ids["b"][0] and chat_ids["a"][1] != chat_ids["b"][1]
    as_string = {"type": "image_url", "image_url": _data_url(files["a"])}
    assert _k3(_post(srv, "/v1/chat/completions", _openai(as_string, TEXT_PART))) == \
        chat_ids["a"]
    auto = _image_part(_data_url(files["a"]), detail="auto")
    assert _k3(_post(srv, "/v1/chat/completions", _openai(auto, TEXT_PART))) == chat_ids["a"]
    # streamed through the official client: the same reply as the whole answer
    messages = json.loads(_openai(_image_part(_data_url(files["a"])), TEXT_PART))["messages"]
    whole = _client(srv).chat.completions.create(model="tiny", messages=messages,
                                                 max_tokens=GEN)
    chunks = _client(srv).chat.completions.create(model="tiny", messages=messages,
                                                  max_tokens=GEN, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (whole.choices[0].message.content or "")


def _alone(tiny_dir, prompt_ids, path) -> tuple:
    """(generated ids, their logprobs) of ``prompt_ids`` (the image at ``path`` at its
    pads) from a new state in this process: greedy, GEN tokens, the chat's stops."""
    from libk3.engine.generate import Prompt, generate
    from libk3.model.forward import ImageRows
    with open_run(RunOptions(model=str(tiny_dir), progress=False, vision=True)) as run:
        images = Images(run.session)
        image = images.load(path)
        rows = ImageRows(prompt_ids.index(images.pad), image.rows, image.digest)
        res = generate(run.session.forward, run.session.new_state(),
                       Prompt(list(prompt_ids), (rows,)),
                       run.chat_settings(GenSettings(gen=GEN)), logprobs=1)
        return res.generated_ids, [e.logprob for e in res.logprobs]


def test_ollama_chat_reads_image_parts_and_refuses_its_images_field(servers, files,
                                                                   chat_ids):
    """Catches an image part on /api/chat fed as its pads without the image's rows (the
    reply would be another), and Ollama's own ``images`` field ignored."""
    messages = json.loads(_openai(_image_part(_data_url(files["a"])), TEXT_PART))["messages"]
    status, got = _post(servers["none"], "/api/chat", json.dumps(
        {"model": "tiny", "stream": False, "messages": messages,
         "options": {"num_predict": GEN}}).encode())
    assert status == 200, got
    assert got["prompt_eval_count"] == len(chat_ids["a"][0]) and got["eval_count"] == GEN
    status, alone = _post(servers["none"], "/v1/chat/completions", _openai(
        _image_part(_data_url(files["a"])), TEXT_PART))
    assert got["message"]["content"] == alone["choices"][0]["message"]["content"]
    status, got = _post(servers["none"], "/api/chat", json.dumps(
        {"model": "tiny", "stream": False, "messages": [
            {"role": "user", "content": TEXT, "images": [_data_url(files["a"])]}]}).encode())
    assert status == 400 and "images" in got["error"]["message"], got


def test_a_kept_state_is_never_resumed_past_an_image(servers, files, tiny_dir):
    """Catches the turn cache keeping a state that holds image rows, or resuming one past
    a pad: turn 2 with image a continues a conversation whose first ids equal turn 1's
    with image b (same size), so b's kept state would be its longest prefix (the
    log-probabilities show rows the greedy tokens may not)."""
    srv = servers["dir"]
    turn1 = [{"role": "user", "content": [_image_part(_data_url(files["b"])), TEXT_PART]}]
    status, r1 = _post(srv, "/v1/chat/completions", json.dumps(
        {"model": "tiny", "max_tokens": 2, "messages": turn1}).encode())
    assert status == 200, r1
    turn2 = [{"role": "user", "content": [_image_part(_data_url(files["a"])), TEXT_PART]},
             r1["choices"][0]["message"], {"role": "user", "content": "and?"}]
    status, r2 = _post(srv, "/v1/chat/completions", json.dumps(
        {"model": "tiny", "max_tokens": GEN, "messages": turn2, "logprobs": True,
         "top_logprobs": 1}).encode())
    assert status == 200, r2
    prompt = r2["k3"]["prompt_ids"]
    assert prompt[:len(r1["k3"]["prompt_ids"])] == r1["k3"]["prompt_ids"]   # ids alike
    served = [c["logprob"] for c in r2["choices"][0]["logprobs"]["content"]]
    assert (r2["k3"]["generated_ids"], served) == _alone(tiny_dir, prompt, files["a"])


def test_anthropic_base64_image_gives_the_same_ids(servers, files, chat_ids):
    """Catches an Anthropic image block converted otherwise than OpenAI's part, and a
    token count that counts an image as its one pad."""
    body = {"model": "tiny", "max_tokens": GEN, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": _data_url(files["a"]).split(",", 1)[1]}},
        {"type": "text", "text": TEXT}]}]}
    status, got = _post(servers["none"], "/v1/messages", json.dumps(body).encode())
    assert status == 200, got
    assert (got["k3"]["prompt_ids"], got["k3"]["generated_ids"]) == chat_ids["a"]
    status, count = _post(servers["none"], "/v1/messages/count_tokens",
                          json.dumps(body).encode())
    assert status == 200 and count["input_tokens"] == len(chat_ids["a"][0])   # rows counted


def test_image_dir_reads_paths_inside_and_nothing_outside(servers, files, chat_ids):
    """Catches a path read without --image-dir, a relative path not resolved against it,
    and a ../ or symlink escape read."""
    srv, inside = servers["dir"], files["dir"]
    for url in ("a.png", str(inside / "a.png"), (inside / "a.png").as_uri()):
        assert _k3(_post(srv, "/v1/chat/completions",
                         _openai(_image_part(url), TEXT_PART))) == chat_ids["a"]
    assert _k3(_post(srv, "/v1/chat/completions",
                     _openai(_image_part("sub/b.png"), TEXT_PART))) == chat_ids["b"]
    status, body = _post(srv, "/v1/chat/completions", _openai(_image_part("a\0.png"), TEXT_PART))
    assert status == 400 and "NUL" in body["error"]["message"], body
    for url in ("../outside.png", str(files["outside"]), "escape.png", "sub/../../outside.png"):
        status, body = _post(srv, "/v1/chat/completions", _openai(_image_part(url), TEXT_PART))
        assert status == 400, (url, body)
        assert body["error"]["message"].startswith('"messages"[0]["content"][0]: the path is '
                                                   "outside the directory --image-dir names")
    status, body = _post(servers["none"], "/v1/chat/completions",
                         _openai(_image_part("a.png"), TEXT_PART))
    assert status == 400 and "--image-dir" in body["error"]["message"]


def test_a_model_without_a_tower_refuses_an_image_with_a_400(tiny_dir, files, tmp_path):
    """Catches an image reaching a server whose checkpoint has no vision tower (a crash,
    a 500, or the image dropped); control: a text request is answered."""
    text_only = text_only_model(tiny_dir, tmp_path)
    srv = _start(text_only, tmp_path / "serve.log", "--gen", 1, "--served-model-name", "tiny")
    try:
        status, body = _post(srv, "/v1/chat/completions",
                             _openai(_image_part(_data_url(files["a"])), TEXT_PART))
        assert status == 400 and "reads no images" in body["error"]["message"], body
        assert _post(srv, "/v1/chat/completions", _openai(TEXT_PART))[0] == 200
    finally:
        _stop(srv)


def _refusals(files, tmp_path):
    """(case, body, path, words the message holds), each refused with a 400."""
    png = files["a"].read_bytes()
    jpeg = tmp_path / "x.jpg"
    from PIL import Image
    Image.open(files["a"]).convert("RGB").save(jpeg)
    cut = "data:image/png;base64," + base64.b64encode(png[:200]).decode()
    bomb = "data:image/png;base64," + base64.b64encode(png_header(7169, 7168)).decode()
    at = '"messages"[0]["content"][0]'
    one = _data_url(files["a"])
    return [
        ("http", _openai(_image_part("http://example.com/a.png"), TEXT_PART), at,
         "fetches nothing"),
        ("https", _openai(_image_part("https://example.com/a.png"), TEXT_PART), at,
         "fetches nothing"),
        ("bad base64", _openai(_image_part("data:image/png;base64,@@@@"), TEXT_PART), at,
         "not valid base64"),
        ("type mismatch", _openai(_image_part(_data_url(jpeg)), TEXT_PART), at,
         "says image/png but the bytes are image/jpeg"),
        ("not an image type", _openai(_image_part(_data_url(files["a"], "text/plain")),
                                      TEXT_PART), at, "is not an image"),
        ("not an image", _openai(_image_part("data:image/png;base64," +
                                             base64.b64encode(b"hello").decode()), TEXT_PART),
         at, "not an image k3 reads"),
        ("truncated", _openai(_image_part(cut), TEXT_PART), at, "does not decode"),
        ("bomb", _openai(_image_part(bomb), TEXT_PART), at, "larger than k3 decodes"),
        ("detail", _openai(_image_part(one, detail="low"), TEXT_PART),
         at + '["image_url"]["detail"]', "one size"),
        ("too many", _openai(*[_image_part(one)] * 9, TEXT_PART), '"messages"[0]["content"][8]',
         "more than 8 images"),
        ("assistant", json.dumps({"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [_image_part(one)]},
            {"role": "user", "content": "and?"}]}).encode(), '"messages"[1]["content"][0]',
         "user message"),
        ("audio", _openai({"type": "input_audio", "input_audio": {}}, TEXT_PART), at,
         "not a text or image_url part"),
        ("file url", _openai(_image_part(files["a"].as_uri()), TEXT_PART), at,
         "--image-dir"),
        ("unknown key", _openai({**_image_part(one), "alt": "x"}, TEXT_PART), at,
         "unknown key 'alt'"),
    ]


def test_each_image_refusal_is_a_400_naming_the_field(servers, files, tmp_path):
    """Catches an image refusal that is a 500, a traceback, a 422, or a message that does
    not name the part; the control (the same image as a good data: URL) answers 200."""
    srv = servers["none"]
    assert _post(srv, "/v1/chat/completions",
                 _openai(_image_part(_data_url(files["a"])), TEXT_PART))[0] == 200
    for case, body, at, words in _refusals(files, tmp_path):
        status, got = _post(srv, "/v1/chat/completions", body)
        assert status == 400, (case, got)
        message = got["error"]["message"]
        assert message.startswith(at) and words in message, (case, message)
        assert "\n" not in message and got["error"]["param"] == "messages"
    status, got = _post(srv, "/tokenize", json.dumps({"messages": json.loads(_openai(
        _image_part(_data_url(files["a"])), TEXT_PART))["messages"]}).encode())
    assert status == 400 and "does not read images" in got["error"]["message"], got


def test_anthropic_image_refusals_name_the_block(servers, files):
    """Catches a url source fetched or ignored, and a refusal naming the converted
    message rather than the client's block."""
    good = {"type": "base64", "media_type": "image/png",
            "data": _data_url(files["a"]).split(",", 1)[1]}
    for source, words in (({"type": "url", "url": "https://example.com/a.png"},
                           "fetches nothing"),
                          ({**good, "data": "@@"}, "not valid base64"),
                          ({**good, "media_type": "image/gif"}, "says image/gif")):
        body = {"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "and"},
                                         {"type": "image", "source": source}]}]}
        status, got = _post(servers["none"], "/v1/messages", json.dumps(body).encode())
        assert status == 400, got
        assert got["type"] == "error"
        message = got["error"]["message"]
        assert message.startswith('"messages"[2]["content"][1]') and words in message, message


def test_read_parts_limits_and_a_model_without_a_tower(tiny_dir, files, monkeypatch):
    """Catches the byte limit not counted across a request's images, and an image sent
    to a model without a vision tower reaching the tower (it must be refused first)."""
    from libk3.vision_config import media_from_dict
    media = media_from_dict(json.loads((tiny_dir / "preprocessor_config.json").read_text()))
    part = _image_part(_data_url(files["a"]))
    message = [{"role": "user", "content": [part, part, TEXT_PART]}]
    with pytest.raises(ImageRefused, match="reads no images"):
        read_parts(message, None)
    with pytest.raises(ImageRefused, match=r'\["content"\]\[1\] is not a text or image_url'):
        read_parts([{"role": "user", "content": [part, {"type": "file"}]}], media)
    out, found = read_parts(message, media)
    assert len(found) == 2 and out[0]["content"].endswith(TEXT)
    monkeypatch.setattr(request_images, "MAX_IMAGE_BYTES", len(files["a"].read_bytes()) + 1)
    with pytest.raises(ImageRefused, match=r'\["content"\]\[1\]: the request.s images are over'):
        read_parts(message, media)


def test_batch_image_line_gives_the_servers_ids_and_a_bad_image_skips_its_line(
        tiny_dir, files, chat_ids, tmp_path):
    """Catches a batch line's image part read otherwise than the server's, a prefix
    shared past a pad (two images of one size give the same ids), a bad image ending the
    batch (or its line running without it), and a path read without --image-dir."""
    lines = [
        {"id": "data", "gen": GEN, "messages": [{"role": "user", "content": [
            _image_part(_data_url(files["a"])), TEXT_PART]}]},
        {"id": "bad", "gen": GEN, "messages": [{"role": "user", "content": [
            _image_part("data:image/png;base64,@@"), TEXT_PART]}]},
        {"id": "path", "gen": GEN, "messages": [{"role": "user", "content": [
            _image_part("sub/b.png"), TEXT_PART]}]},
        {"id": "text", "gen": GEN, "prompt": "hello"},
    ]
    batch = tmp_path / "b.jsonl"
    batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    # a small chunk makes the lines' common prefix (through their pads) worth sharing
    p = k3(tiny_dir, "--batch", batch, "--out", out, "--image-dir", files["dir"], "--quiet",
           "--prefill-chunk", 8)
    assert p.returncode == 0, p.stderr
    got = {r["id"]: (r["prompt_ids"], r["generated_ids"])
           for r in map(json.loads, out.read_text().splitlines())}
    assert got["data"] == chat_ids["a"] and got["path"] == chat_ids["b"]
    assert set(got) == {"data", "path", "text"}
    assert f'{batch}:2: skipped: "messages"[0]["content"][0]: the data is not valid base64' \
        in p.stderr
    out2 = tmp_path / "out2.jsonl"
    p = k3(tiny_dir, "--batch", batch, "--out", out2, "--quiet")
    assert p.returncode == 0 and f"{batch}:3: skipped:" in p.stderr and "--image-dir" in p.stderr
    assert {json.loads(x)["id"] for x in out2.read_text().splitlines()} == {"data", "text"}


def test_image_dir_goes_with_serve_or_batch(tiny_dir, files):
    """Catches --image-dir accepted where nothing reads it."""
    p = k3(tiny_dir, "-p", "hi", "--gen", 1, "--image-dir", files["dir"])
    assert p.returncode == 2 and "--image-dir goes with --serve or --batch" in p.stderr
