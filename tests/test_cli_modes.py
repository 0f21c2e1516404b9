"""k3-run in modes (docs/run.md "Modes"): each mode through the console script, each old
one-command spelling giving what its mode gives, an option of another mode refused by
name, and a model directory named like a mode."""

from __future__ import annotations

import json
import os

import pytest

from .hostile import Outcome, check_refused
from .scripts import k3
from .test_batch_cli import _lines, _rows

TALK = "Hi there\n\n"


def _ok(p):
    assert p.returncode == 0, p.stderr
    return p


def _refused(p, *names) -> str:
    return check_refused(Outcome(p.returncode, p.stderr, p.stdout), 2, *names)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("modes") / "b.jsonl"
    p.write_text("\n".join(_lines(4)) + "\n")
    return p


def test_prompt_mode_named_or_not_gives_the_same_text_and_ids(tiny_dir):
    """Catches `k3-run prompt MODEL` and `k3-run MODEL` (the default) reaching different
    options: the same stdout; control: another prompt gives other ids."""
    plain = _ok(k3(tiny_dir, "--ids", "1,2,3", "-n", 3, "--json", "-q"))
    named = _ok(k3("prompt", tiny_dir, "--ids", "1,2,3", "-n", 3, "--json", "-q"))
    ids = json.loads(plain.stdout)["generated_ids"]
    assert len(ids) == 3 and json.loads(named.stdout)["generated_ids"] == ids
    other = _ok(k3(tiny_dir, "--ids", "4,5,6", "-n", 3, "--json", "-q"))
    assert json.loads(other.stdout)["prompt_ids"] != json.loads(plain.stdout)["prompt_ids"]
    text = _ok(k3(tiny_dir, "Hello there", "-n", 3))
    assert _ok(k3("prompt", "-m", tiny_dir, "Hello there", "-n", 3)).stdout == text.stdout


def test_batch_mode_writes_the_lines_the_old_batch_flag_writes(tiny_dir, prompts, tmp_path):
    """Catches `k3-run batch MODEL FILE --out R` and `k3-run MODEL --batch FILE --out R`
    (and -m MODEL) running different batches: the same result lines, every id."""
    new, old, by_m = tmp_path / "new.jsonl", tmp_path / "old.jsonl", tmp_path / "m.jsonl"
    _ok(k3("batch", tiny_dir, prompts, "--out", new, "-q"))
    _ok(k3(tiny_dir, "--batch", prompts, "--out", old, "-q"))
    _ok(k3("batch", "-m", tiny_dir, prompts, "--out", by_m, "-q"))
    assert len(_rows(new)) == 4
    assert _rows(new) == _rows(old) == _rows(by_m)


@pytest.mark.parametrize("flag", ["--chat", "-i", "-cnv", "--conversation"])
def test_chat_mode_says_what_the_old_chat_flags_say(tiny_dir, flag):
    """Catches an old chat spelling not reaching the chat mode (or reaching it with other
    options): the same transcript on stdout."""
    want = _ok(k3("chat", tiny_dir, "-n", 3, input=TALK))
    assert want.stdout.strip() and "k3 chat with tiny" in want.stderr
    got = _ok(k3(tiny_dir, flag, "-n", 3, input=TALK))
    assert got.stdout == want.stdout and got.stderr == want.stderr


def test_perplexity_mode_prints_what_the_old_flag_prints(tiny_dir):
    """Catches `k3-run perplexity MODEL TEXT` scoring otherwise than `--perplexity TEXT`:
    the same JSON, byte for byte."""
    text = tiny_dir.parent / "perplexity.txt"
    new = _ok(k3("perplexity", tiny_dir, text, "-c", 64, "--json", "-q"))
    old = _ok(k3(tiny_dir, "--perplexity", text, "-c", 64, "--json", "-q"))
    assert json.loads(new.stdout)["windows"] >= 1 and new.stdout == old.stdout


def test_serve_mode_answers_as_the_old_serve_flag(tiny_dir, tmp_path):
    """Catches `k3-run serve MODEL ADDRESS` serving otherwise than `--serve ADDRESS`: the
    same completion; and the address rule holding in both spellings."""
    pytest.importorskip("aiohttp")
    from .test_serve import _post, _start, _stop

    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 3}).encode()
    texts = []
    for mode_first in (True, False):
        srv = _start(tiny_dir, tmp_path / f"{mode_first}.log", "--gen", 3,
                     mode_first=mode_first)
        try:
            status, doc = _post(srv, "/v1/completions", body)
        finally:
            _stop(srv)
        assert status == 200, doc
        texts.append(doc["choices"][0]["text"])
    assert texts[0] == texts[1]
    _refused(k3("serve", tiny_dir, "0.0.0.0:0"), "--api-key")
    _refused(k3(tiny_dir, "--serve", "0.0.0.0:0"), "--api-key")


@pytest.mark.parametrize("argv, says", [
    (["batch", "{tiny}", "{prompts}", "--out", "r.jsonl", "--api-key", "k"],
     "--api-key goes with --serve (k3-run serve)"),
    (["chat", "{tiny}", "--ids", "1"], "--ids goes with one prompt"),
    (["serve", "{tiny}", "--out", "r.jsonl"], "--out goes with --batch"),
    (["{tiny}", "--ids", "1", "-np", "2"], "--batch-width also with --serve"),
    (["{tiny}", "--ids", "1", "-sys", "x"], "go with --chat (k3-run chat)"),
    (["perplexity", "{tiny}", "{text}", "--seed", "3"], "generation options"),
    (["{tiny}", "--chat", "--batch", "{prompts}"], "exactly one of"),
])
def test_an_option_of_another_mode_is_refused_by_name(tiny_dir, prompts, tmp_path, argv,
                                                      says):
    """Catches an option the mode does not read being taken silently, or read as a short
    option with a value (-np 2 as -n p, -sys as -s ys): one line saying where it goes,
    exit 2; control: in its own mode the option parses (--help after it)."""
    fill = dict(tiny=tiny_dir, prompts=prompts, text=tiny_dir.parent / "perplexity.txt")
    argv = [a.format(**fill) for a in argv]
    _refused(k3(*argv, cwd=tmp_path), says)


def test_each_mode_s_help_lists_its_own_options_only():
    """Catches a mode listing every option again: batch's help has --out and not
    --api-key, serve's the reverse; the top help lists the modes."""
    top = _ok(k3("--help")).stdout
    assert all(m in top for m in ("prompt", "batch", "chat", "serve", "perplexity"))
    batch, serve = _ok(k3("batch", "--help")).stdout, _ok(k3("serve", "--help")).stdout
    assert "--out" in batch and "--api-key" not in batch
    assert "--api-key" in serve and "--out " not in serve


def test_a_model_directory_named_like_a_mode_runs_as_a_path(tiny_dir, tmp_path):
    """Catches the mode word and a model folder named `chat` confused: `./chat` is the
    model (the tiny model's ids); `k3-run chat ./chat` chats with it; `k3-run chat
    --ids 1` is the chat mode (the documented rule: a mode's name first is the mode),
    refused by name."""
    d = tmp_path / "chat"
    d.mkdir()
    for f in os.listdir(tiny_dir):
        os.symlink(tiny_dir / f, d / f)
    want = json.loads(_ok(k3(tiny_dir, "--ids", "1,2", "-n", 2, "--json", "-q")).stdout)
    got = json.loads(_ok(k3("./chat", "--ids", "1,2", "-n", 2, "--json", "-q",
                            cwd=tmp_path)).stdout)
    assert got["generated_ids"] == want["generated_ids"]
    assert "k3 chat with chat" in _ok(k3("chat", "./chat", "-n", 2, input=TALK,
                                         cwd=tmp_path)).stderr
    _refused(k3("chat", "--ids", "1", cwd=tmp_path), "--ids goes with one prompt")


@pytest.mark.parametrize("argv, mode, rest", [
    (["M", "--batch=f.jsonl", "--out", "r"], "batch", ["M", "--out", "r", "f.jsonl"]),
    (["M", "--serve=8080"], "serve", ["M", "8080"]),
    (["--serve", "9000", "-m", "M"], "serve", ["M", "9000"]),
    (["-t", "1", "M", "--serve", "--port", "9"], "serve", ["-t", "1", "M", "--port", "9"]),
    (["M", "--perplexity", "-x.txt"], "perplexity", ["M", "--", "-x.txt"]),
    (["M", "-cnv", "-n", "2"], "chat", ["M", "-n", "2"]),
    (["M", "-p", "--chat", "-n5"], "prompt", ["M", "-p", "--chat", "-n5"]),
    (["batch", "-m", "M", "p.jsonl", "--out", "r"], "batch", ["M", "p.jsonl", "--out", "r"]),
])
def test_old_spellings_and_m_become_the_mode_s_arguments(argv, mode, rest):
    """Catches the words read otherwise than click reads them: --batch=FILE or
    --serve=PORT missed, --serve taking the next option as its address, a file named
    like an option read as one, -cnv read as -c nv, a prompt text `--chat` (the value of
    -p) taken for the mode, -m's model not the first argument."""
    from k3_run.aliases import split
    from k3_run.cli import main
    assert split(argv, main.commands)[::2] == (mode, rest)
