"""The tokenizer's derived-form cache (libk3.text.tokenizer_cache, formats/tokenizer.md
"Derived-form cache") and reading the tokenizer lazily (libk3.text.tokenizer.LazyTokenizer).

Every test compares against a tokenizer derived in memory from the same files (no
cache), which tests/test_tokenizer.py checks against tiktoken.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from libk3.text import tokenizer as tokmod
from libk3.text import tokenizer_cache as tc
from libk3.text.tokenizer import K3Tokenizer, LazyTokenizer
from libk3.text.tokenizer_files import CONFIG_FILE, KIMI_FILE, TIKTOKEN_FILE
from libk3.synth.bpe import write_tokenizer_files

RANKS, VOCAB = 3840, 4096
TEXTS = ["The capital of France is", "Hello 世界 <|end_of_msg|> [EOS]", "def f(x):\n    return x",
         "👨\u200d👩\u200d👧 café 1234567 \r\n\t end  "]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tokcache_model")
    write_tokenizer_files(d, RANKS, VOCAB)
    return d


@pytest.fixture(scope="module")
def plain(model) -> K3Tokenizer:
    return K3Tokenizer.from_dir(model, VOCAB)


def same_behaviour(tok: K3Tokenizer, ref: K3Tokenizer) -> None:
    for text in TEXTS:
        for allow in (False, True):
            ids = tok.encode(text, allow_special=allow)
            assert ids == ref.encode(text, allow_special=allow), repr(text)
            assert tok.decode_bytes(ids) == ref.decode_bytes(ids) == text.encode()
    every = list(range(tok.vocab_size))
    assert tok.decode_bytes(every) == ref.decode_bytes(every)
    assert tok.whole_only_ranks == ref.whole_only_ranks
    assert tok.special_ids == ref.special_ids


def no_rederiving(monkeypatch) -> None:
    """Make reading tiktoken.model or deriving merges fail: a hit must need neither."""
    def boom(*a, **k):
        raise AssertionError("the cache was not used")
    monkeypatch.setattr(tokmod, "read_tiktoken_model", boom)
    monkeypatch.setattr(tokmod, "derive_merges", boom)


def test_tokenizer_cache_written_once_then_reused(model, plain, tmp_path, monkeypatch):
    """Catches a cache that is written but never read (every run re-derives), or one whose
    ids or bytes differ from deriving in memory."""
    path = tmp_path / "c" / "tok.k3tok"
    first = K3Tokenizer.from_dir(model, VOCAB, cache=path)
    assert first.cache_status == "written" and path.is_file()
    same_behaviour(first, plain)
    with monkeypatch.context() as m:
        no_rederiving(m)
        again = K3Tokenizer.from_dir(model, VOCAB, cache=path)
        assert again.cache_status == "hit"
        same_behaviour(again, plain)
    with pytest.raises(AssertionError, match="not used"):       # control: the trap works
        no_rederiving(monkeypatch)
        K3Tokenizer.from_dir(model, VOCAB)


def test_tokenizer_cache_stale_when_a_file_changes(model, tmp_path):
    """Catches a key that ignores a tokenizer file, the vocab size or the version: the
    cached merges of other ranks would be used silently."""
    d = tmp_path / "m"
    d.mkdir()
    for name in (TIKTOKEN_FILE, CONFIG_FILE, KIMI_FILE):
        (d / name).write_bytes((model / name).read_bytes())
    path = tmp_path / "tok.k3tok"
    assert K3Tokenizer.from_dir(d, VOCAB, cache=path).cache_status == "written"
    assert K3Tokenizer.from_dir(d, VOCAB, cache=path).cache_status == "hit"     # control
    write_tokenizer_files(d, 3000, VOCAB)           # other ranks, other specials
    tok = K3Tokenizer.from_dir(d, VOCAB, cache=path)
    assert tok.cache_status == "rewritten" and tok.n_ranks == 3000
    same_behaviour(tok, K3Tokenizer.from_dir(d, VOCAB))
    (d / KIMI_FILE).unlink()                        # the built-in split regex instead
    assert K3Tokenizer.from_dir(d, VOCAB, cache=path).cache_status == "rewritten"
    assert K3Tokenizer.from_dir(d, VOCAB + 4, cache=path).cache_status == "rewritten"


def test_tokenizer_cache_stale_after_a_version_bump(model, tmp_path, monkeypatch):
    """Catches a reader that accepts a file written by another layout version."""
    path = tmp_path / "tok.k3tok"
    K3Tokenizer.from_dir(model, VOCAB, cache=path)
    monkeypatch.setattr(tc, "VERSION", tc.VERSION + 1)
    assert K3Tokenizer.from_dir(model, VOCAB, cache=path).cache_status == "rewritten"
    assert K3Tokenizer.from_dir(model, VOCAB, cache=path).cache_status == "hit"


def _damage(data: bytes, how: str) -> bytes:
    hlen = struct.unpack_from("<I", data, 12)[0]
    body = 16 + hlen
    if how == "flipped payload byte":
        return data[:body + 100] + bytes([data[body + 100] ^ 1]) + data[body + 101:]
    if how == "truncated":
        return data[:len(data) // 2]
    if how == "bad magic":
        return b"X" + data[1:]
    if how == "header not JSON":
        return data[:16] + b"{" * hlen + data[body:]
    if how == "lying section size":
        header = json.loads(data[16:body])
        header["sections"][0][1] += 1
        header["sections"][1][1] -= 1
        head = json.dumps(header, sort_keys=True).encode()
        return data[:12] + struct.pack("<I", len(head)) + head + data[body:]
    if how == "empty":
        return b""
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["flipped payload byte", "truncated", "bad magic",
                                 "header not JSON", "lying section size", "empty"])
def test_tokenizer_cache_damaged_file_is_rebuilt(model, plain, tmp_path, how):
    """Catches a reader that trusts a damaged cache (wrong merges or bytes, or a crash)
    instead of deriving again and rewriting it."""
    path = tmp_path / "tok.k3tok"
    K3Tokenizer.from_dir(model, VOCAB, cache=path)
    good = path.read_bytes()
    assert tc.decode(good, tc.cache_key(_files(model), VOCAB)) is not None      # control
    path.write_bytes(_damage(good, how))
    tok = K3Tokenizer.from_dir(model, VOCAB, cache=path)
    assert tok.cache_status == "rewritten"
    same_behaviour(tok, plain)
    assert path.read_bytes() == good                # rebuilt byte for byte (deterministic)


def _files(d: Path) -> dict:
    return {TIKTOKEN_FILE: d / TIKTOKEN_FILE, CONFIG_FILE: d / CONFIG_FILE,
            KIMI_FILE: d / KIMI_FILE}


@pytest.fixture()
def unwritable_dir(tmp_path) -> Path:
    """A cache directory nobody can write to: read-only, and (root ignores permission
    bits) below a regular file, so even root cannot create it."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_bytes(b"")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    return ro if not os.access(ro, os.W_OK) else blocker / "cache"


def test_tokenizer_cache_unwritable_dir_falls_back_to_memory(model, plain, unwritable_dir):
    """Catches a run that fails (or writes elsewhere) when the cache cannot be written."""
    path = unwritable_dir / "tok.k3tok"
    tok = K3Tokenizer.from_dir(model, VOCAB, cache=path)
    assert tok.cache_status == "in-memory" and not path.exists()
    same_behaviour(tok, plain)


def test_tokenizer_cache_write_failure_after_mkdir_falls_back_to_memory(model, plain,
                                                                       tmp_path):
    """Catches a fallback that only covers the directory: here the directory exists and
    the write itself fails (the cache's name is taken by a directory), which the atomic
    writer reports as K3IOError, not OSError."""
    path = tmp_path / "cache" / "tok.k3tok"
    path.mkdir(parents=True)
    tok = K3Tokenizer.from_dir(model, VOCAB, cache=path)
    assert tok.cache_status == "in-memory" and path.is_dir()
    same_behaviour(tok, plain)


def test_tokenizer_cache_location(tmp_path):
    """Catches ignoring XDG_CACHE_HOME, honouring a relative one (the XDG rule says to
    ignore it), two model directories sharing one file, or a pack that is not used."""
    env = {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    a = tc.cache_path(tmp_path / "a", env=env)
    assert a.parent == tmp_path / "xdg" / "k3" / "tokenizer"
    assert a != tc.cache_path(tmp_path / "b", env=env)
    assert a == tc.cache_path(tmp_path / "a", env=env)
    env["XDG_CACHE_HOME"] = "relative/dir"
    assert tc.cache_path(tmp_path / "a", env=env).parent == \
        tmp_path / "home" / ".cache" / "k3" / "tokenizer"
    assert tc.cache_path(tmp_path / "a", tmp_path / "pack", env=env) == \
        tmp_path / "pack" / tc.FILE_NAME


def test_lazy_tokenizer_reads_nothing_until_used(model, tmp_path, monkeypatch):
    """Catches a run that reads and derives the tokenizer although it decodes nothing,
    or that builds the encoder (merges, HF) just to decode."""
    path = tmp_path / "tok.k3tok"
    lazy = LazyTokenizer(model, VOCAB, path)
    assert lazy.decode([]) == "" and lazy.decode_bytes([]) == b""
    dec = lazy.stream_decoder()
    assert lazy.loaded is None and not path.exists()
    ids = K3Tokenizer.from_dir(model, VOCAB, cache=path).encode("Hi 世界")   # warms it
    with monkeypatch.context() as m:
        no_rederiving(m)
        assert "".join(dec.push(i) for i in ids) + dec.flush() == "Hi 世界"
    assert lazy.loaded.cache_status == "hit" and lazy.loaded._hf_pair is None
    assert lazy.encode("Hi") == lazy.loaded.encode("Hi")
    assert lazy.loaded._hf_pair is not None                       # control: encode builds it
