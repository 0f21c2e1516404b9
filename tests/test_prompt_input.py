"""Prompt files and batch lines taken exactly as their bytes say (issue 13): CRLF and lone
CR kept, invalid UTF-8 refused with its offset, a prompt larger than the context refused
before it is read, batch lines split on b"\\n" only. End to end through k3-run."""

from __future__ import annotations

import json
import shutil

import pytest

from libk3.config import K3_CONTEXT, context_length
from libk3.run import batch as batchfile
from libk3.run.prompt_file import prompt_byte_bound
from libk3.text.tokenizer import K3Tokenizer
from .scripts import k3_here


def _prompt_ids(model, prompt_file, tmp_path):
    rep = tmp_path / "r.json"
    p = k3_here(model, "--prompt-file", prompt_file, "--gen", 0, "--report-json", rep)
    assert p.returncode == 0, p.stderr
    return json.loads(rep.read_text())["prompt_ids"]


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return K3Tokenizer.from_dir(tiny_dir)


def test_prompt_file_keeps_crlf_and_lone_cr(tiny_dir, tok, tmp_path):
    """Catches a prompt file read in text mode, whose newline translation turns CRLF and
    a lone CR into LF: the ids must be the encoding of the exact bytes."""
    text = "first line\r\nsecond\rthird\n"
    f = tmp_path / "p.txt"
    f.write_bytes(text.encode("utf-8"))
    want = tok.encode(text)
    assert want != tok.encode(text.replace("\r\n", "\n").replace("\r", "\n"))   # control
    assert _prompt_ids(tiny_dir, f, tmp_path) == want


def test_prompt_file_refuses_invalid_utf8_with_the_byte_offset(tiny_dir, tmp_path):
    """Catches invalid UTF-8 silently replaced by U+FFFD (or a traceback): exit 3, one
    stderr line naming the file and the offset of the first bad byte."""
    f = tmp_path / "bad.txt"
    f.write_bytes("héllo ".encode("utf-8") + b"\xff\xfe world")
    p = k3_here(tiny_dir, "--prompt-file", f, "--gen", 0)
    assert p.returncode == 3, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and str(f) in lines[0] and "byte offset 7" in lines[0]
    assert "Traceback" not in p.stderr


def _with_context(tiny_dir, tmp_path, n):
    """fixtures/tiny with text_config.max_position_embeddings = n (shards linked)."""
    d = tmp_path / f"ctx{n}"
    d.mkdir()
    for f in tiny_dir.iterdir():
        if f.suffix == ".safetensors":
            (d / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copy2(f, d / f.name)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = n
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_prompt_file_over_the_context_is_refused(tiny_dir, tok, tmp_path):
    """Catches a prompt longer than the model's context accepted: with a context of 8
    tokens, a 12-token prompt is refused (exit 3, naming the file); control: 8 tokens run."""
    model = _with_context(tiny_dir, tmp_path, 8)
    assert context_length(model) == 8 and context_length(tiny_dir) == K3_CONTEXT
    words = " ".join(f"w{i}" for i in range(40))
    fits = next(words[:n] for n in range(len(words), 0, -1) if len(tok.encode(words[:n])) == 8)
    over = next(words[:n] for n in range(len(words)) if len(tok.encode(words[:n])) == 12)
    ok, bad = tmp_path / "ok.txt", tmp_path / "over.txt"
    ok.write_text(fits)
    bad.write_text(over)
    assert len(_prompt_ids(model, ok, tmp_path)) == 8
    p = k3_here(model, "--prompt-file", bad, "--gen", 0)
    assert p.returncode == 3 and str(bad) in p.stderr and "context" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_prompt_file_larger_than_any_fitting_prompt_is_refused_unread(tiny_dir, tok, tmp_path):
    """Catches a reader that loads the whole file before checking it: a sparse file one
    byte over context x longest token (the largest file that could still fit) is refused
    from its size at once, at the real context (1 TB-scale reads would never finish);
    control: the bound is exactly that product."""
    bound = prompt_byte_bound(K3_CONTEXT, tok.longest_rank_bytes)
    assert bound == K3_CONTEXT * max(len(tok.token_bytes(i)) for i in range(tok.n_ranks))
    f = tmp_path / "huge.txt"
    with open(f, "wb") as fh:
        fh.truncate(bound + 1)
    p = k3_here(tiny_dir, "--prompt-file", f, "--gen", 0)
    assert p.returncode == 3 and "larger than the model's context" in p.stderr, p.stderr
    assert f"{bound + 1} bytes" in p.stderr


def test_batch_lines_split_on_newline_only_and_bad_utf8_is_that_lines_error(tiny_dir, tmp_path):
    """Catches str.splitlines (which splits a JSON string at a raw U+2028) and decoding
    with errors="replace" (which runs a prompt the user never wrote): line 1 holds a raw
    U+2028 and U+2029 and runs; line 2 has an invalid byte and is skipped with its number;
    line 3 (CRLF-terminated) runs."""
    ok = json.dumps({"id": "a", "prompt": "x\u2028y\u2029z"}, ensure_ascii=False).encode()
    assert "\u2028".encode() in ok                                  # raw, not escaped
    lines = [ok, b'{"id": "b", "prompt": "caf\xe9"}', b'{"id": "c", "ids": [1, 2]}\r']
    batch, out = tmp_path / "b.jsonl", tmp_path / "out.jsonl"
    batch.write_bytes(b"\n".join(lines) + b"\n")
    p = k3_here(tiny_dir, "--batch", batch, "--out", out, "--gen", 1, "--json")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    assert summary["done"] == 2 and summary["malformed"] == 1
    assert summary["errors"][0]["line"] == 2 and "UTF-8" in summary["errors"][0]["error"]
    assert f"{batch}:2: skipped" in p.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in results) == ["a", "c"]


def test_batch_parse_line_decodes_strictly(tmp_path):
    """Unit control for the batch reader: a valid line parses, an invalid byte names its
    offset in the line, and read_lines splits on b"\n" and nothing else."""
    f = tmp_path / "b.jsonl"
    f.write_bytes("a\u2028b\u2029c\x85d\x0ce\rf\ng".encode())
    assert [n for n, _ in batchfile.read_lines(f, 100)] == [1, 2]
    assert batchfile.parse_line(b'{"id": 1, "ids": [3]}', 10)["ids"] == [3]
    with pytest.raises(batchfile.BatchLineError, match="byte offset 5"):
        batchfile.parse_line(b'{"id"\x80: 1}', 10)
