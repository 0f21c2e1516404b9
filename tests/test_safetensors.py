"""The strict one-shard reader, pread_into and write_shard (libk3/io/safetensors.py).

Conformance shards (the ``st`` vectors, loaded via tests/conformance.py) check the awkward but
legal cases; hand-made shards check that each broken invariant is refused, each with a
control copy that opens. Not caught here: tensor sets across shards (test_checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libk3.errors import CheckpointError
from libk3.io import safetensors as stmod
from libk3.io.dtypes import widen
from libk3.io.safetensors import (MAX_HEADER_BYTES, pread_into, read_header, scan_header,
                                  write_shard)

from .conformance import ROOT

ST = ROOT / "st"
SHARD1 = ST / "model-00001-of-00002.safetensors"
SHARD2 = ST / "model-00002-of-00002.safetensors"

# README section 6: name -> (dtype, shape, absolute offset, nbytes)
ST_TABLE = {
    "plain.f32.2d": ("F32", (16, 16), 1030, 1024),
    "plain.bf16.1d": ("BF16", (128,), 2054, 256),
    "tricky.f16.1d": ("F16", (64,), 2310, 128),
    "packed.u8.2d": ("U8", (7, 32), 2438, 224),
    "scalar.f32": ("F32", (), 2662, 4),
    "empty.f32": ("F32", (0, 8), 2666, 0),
    "language_model.model.layers.0.block_sparse_moe.experts.0.w1.weight_packed":
        ("U8", (2, 32), 2666, 64),
    "language_model.model.layers.0.block_sparse_moe.experts.1.w1.weight_packed":
        ("U8", (2, 32), 2730, 64),
    "rank3.f32": ("F32", (2, 3, 4), 2794, 96),
    "rank4.u8": ("U8", (2, 2, 2, 2), 2890, 16),
    "second.shard.f32": ("F32", (10, 10), 261, 400),
    "second.shard.u8": ("U8", (300,), 661, 300),
    'weird\\name."with"quotes': ("F32", (3,), 961, 12),
}


def _need_st():
    if not ST.is_dir():
        pytest.skip("shared conformance data not present")


def _raw(path, entry_offset, nbytes):
    with open(path, "rb") as f:
        f.seek(entry_offset)
        return np.frombuffer(f.read(nbytes), np.uint8)


def _read(ent):
    fd = os.open(ent.path, os.O_RDONLY)
    try:
        buf = np.empty(ent.nbytes, np.uint8)
        pread_into(fd, ent.offset, buf, path=ent.path)
    finally:
        os.close(fd)
    return widen(buf, ent.dtype, ent.shape)


# ---- conformance st/ --------------------------------------------------------------------

def test_read_header_st_table_matches_readme_offsets_names_and_shapes():
    """Catches: relative instead of absolute offsets, indexing __metadata__, a quote
    scanner that breaks on the escaped name, numel 0 for rank 0, rejecting equal starts."""
    _need_st()
    got = {}
    for path in (SHARD1, SHARD2):
        entries = read_header(path)
        assert [e.offset for e in entries] == sorted(e.offset for e in entries)
        for e in entries:
            assert e.path == str(path)
            got[e.name] = (e.dtype, e.shape, e.offset, e.nbytes)
    assert got == ST_TABLE
    assert "__metadata__" not in got


def test_read_header_st_every_tensor_reads_back_bit_exact():
    """Catches: widening that is not bit-exact (BF16 inf/NaN/-0, F16 subnormals), reading
    at aligned offsets only, or U8 being converted instead of kept raw."""
    _need_st()
    for path in (SHARD1, SHARD2):
        for ent in read_header(path):
            raw = _raw(path, ent.offset, ent.nbytes)
            arr = _read(ent)
            assert arr.shape == ent.shape
            if ent.dtype == "U8":
                assert arr.dtype == np.uint8
                assert np.array_equal(arr.reshape(-1), raw)
                continue
            assert arr.dtype == np.float32
            if ent.dtype == "BF16":
                want_bits = raw.view("<u2").astype(np.uint32) << 16
            elif ent.dtype == "F16":
                want_bits = raw.view("<f2").astype(np.float32).view(np.uint32)
            else:
                want_bits = raw.view("<u4")
            assert np.array_equal(arr.reshape(-1).view(np.uint32), want_bits), ent.name


def test_read_header_st_special_values_decode_as_documented():
    """Catches: BF16 NaN quietened to a number, -0 losing its sign, F16 subnormals
    flushed to zero; and the rank-0 / escaped-name values of README section 6."""
    _need_st()
    ents = {e.name: e for p in (SHARD1, SHARD2) for e in read_header(p)}
    bf = _read(ents["plain.bf16.1d"])
    assert bf[0] == np.inf and bf[1] == -np.inf and np.isnan(bf[2])
    assert bf[3] == 0 and not np.signbit(bf[3]) and bf[4] == 0 and np.signbit(bf[4])
    assert bf[5] == np.float32(2.0 ** -126)
    f16 = _read(ents["tricky.f16.1d"])
    assert f16[0] == np.inf and f16[1] == -np.inf and np.isnan(f16[2])
    assert f16[3] == 0 and not np.signbit(f16[3]) and np.signbit(f16[4])
    assert f16[5] == np.float32(2.0 ** -24)
    assert f16[6] == np.float32(1023 * 2.0 ** -24)
    assert f16[7] == np.float32(2.0 ** -14)
    assert _read(ents["scalar.f32"]).shape == () and _read(ents["scalar.f32"]) == 3.5
    assert _read(ents["empty.f32"]).shape == (0, 8)
    assert _read(ents['weird\\name."with"quotes']).tolist() == [1.0, 2.0, 3.0]


def test_scan_header_extent_st_equals_file_size():
    """Catches: an extent that forgets the 8-byte length or the header (k3-doctor would
    then report every healthy shard as truncated)."""
    _need_st()
    for path in (SHARD1, SHARD2):
        entries, extent = scan_header(path)
        assert extent == path.stat().st_size and entries == read_header(path)


# ---- writer -----------------------------------------------------------------------------

def _small_tensors():
    return [("a.f32", "F32", (2, 3), np.arange(6, dtype="<f4")),
            ("b.empty", "BF16", (0, 4), b""),
            ("c.u8", "U8", (5,), bytes(range(5))),
            ("d.scalar", "F32", (), np.array(3.5, "<f4"))]


def test_write_shard_round_trip_layout_and_values(tmp_path):
    """Catches: offsets written relative to the file, a header not padded to a multiple
    of 8, and a writer whose bytes the reader decodes to other values."""
    p = tmp_path / "x.safetensors"
    size = write_shard(p, _small_tensors(), metadata={"format": "pt"})
    assert size == p.stat().st_size
    n = int.from_bytes(p.read_bytes()[:8], "little")
    assert n % 8 == 0
    ents = read_header(p)
    assert [e.name for e in ents] == ["a.f32", "b.empty", "c.u8", "d.scalar"]
    vals = {e.name: _read(e) for e in ents}
    assert vals["a.f32"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert vals["b.empty"].shape == (0, 4)
    assert vals["c.u8"].tolist() == [0, 1, 2, 3, 4]
    assert vals["d.scalar"] == 3.5
    assert ents[0].offset == 8 + n
    umask = os.umask(0)
    os.umask(umask)
    assert p.stat().st_mode & 0o777 == 0o666 & ~umask     # not mkstemp's 0600


def test_write_shard_is_deterministic_and_leaves_no_temp(tmp_path):
    """Catches: dict-order or timestamp dependence in the header, and temporary files
    left beside the shard."""
    a, b = tmp_path / "a" / "s.safetensors", tmp_path / "b" / "s.safetensors"
    a.parent.mkdir()
    b.parent.mkdir()
    write_shard(a, _small_tensors())
    write_shard(b, _small_tensors())
    assert a.read_bytes() == b.read_bytes()
    assert sorted(os.listdir(a.parent)) == ["s.safetensors"]


def test_write_shard_holes_are_sparse_and_read_as_zeros(tmp_path):
    """Catches: a writer that materialises None data (a 1.5 TB synthetic checkpoint would
    fill the disk) or forgets to extend the file over a trailing hole."""
    p = tmp_path / "sparse.safetensors"
    big = 64 * 1024 * 1024
    write_shard(p, [("head", "U8", (4,), b"\x01\x02\x03\x04"),
                    ("hole", "U8", (big,), None)])
    st_ = p.stat()
    assert st_.st_size == scan_header(p)[1]
    assert st_.st_blocks * 512 < big // 4
    ents = {e.name: e for e in read_header(p)}
    fd = os.open(p, os.O_RDONLY)
    try:
        buf = np.ones(4096, np.uint8)
        pread_into(fd, ents["hole"].offset + big - 4096, buf)
    finally:
        os.close(fd)
    assert not buf.any()


def test_write_shard_streams_callable_chunks_and_checks_length(tmp_path):
    """Catches: a writer that accepts a stream shorter than shape x dtype (the reader
    would then see a shard whose tensors are shifted) or leaves its temporary behind."""
    p = tmp_path / "s.safetensors"
    write_shard(p, [("t", "U8", (10,), lambda: (np.arange(k, k + 5, dtype=np.uint8)
                                                 for k in (0, 5)))])
    assert _read(read_header(p)[0]).tolist() == list(range(10))
    bad = tmp_path / "bad.safetensors"
    with pytest.raises(CheckpointError, match="wrong length"):
        write_shard(bad, [("t", "U8", (10,), b"123")])
    assert not bad.exists() and sorted(os.listdir(tmp_path)) == ["s.safetensors"]


# ---- hand-made corrupt shards -----------------------------------------------------------

def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _raw_shard(path, header, data_len=None, length_field=None):
    """Write a shard from a header dict (or raw text) with zero data; the data region
    is as long as the largest end unless ``data_len`` says otherwise."""
    text = header if isinstance(header, (str, bytes)) else json.dumps(header)
    blob = text.encode() if isinstance(text, str) else text
    if data_len is None:
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"] \
            if isinstance(header, dict) else [0]
        data_len = max(ends, default=0)
    n = len(blob) if length_field is None else length_field
    path.write_bytes(n.to_bytes(8, "little") + blob + bytes(data_len))
    return path


GOOD = {"__metadata__": {"format": "pt"}, "a": _entry(), "b": _entry("U8", (4,), (8, 12))}


def _control(tmp_path):
    ents = read_header(_raw_shard(tmp_path / "control.safetensors", GOOD))
    assert [e.name for e in ents] == ["a", "b"]


def _refused(tmp_path, match, header=None, **kw):
    _control(tmp_path)
    p = _raw_shard(tmp_path / "bad.safetensors", GOOD if header is None else header, **kw)
    with pytest.raises(CheckpointError, match=match) as info:
        read_header(p)
    assert str(p) in str(info.value)
    return info.value


def test_read_header_refuses_truncated_shard(tmp_path):
    """Catches: a reader that trusts the header and finds the truncation only when a
    read returns short, mid-inference."""
    err = _refused(tmp_path, "past the end of the file", data_len=11)
    assert err.tensor == "b"


def test_read_header_refuses_header_length_past_eof(tmp_path):
    """Catches: allocating or reading N bytes before checking N against the file size."""
    _refused(tmp_path, "header length runs past", length_field=10 ** 12)


def test_read_header_refuses_implausible_header_length(tmp_path):
    """Catches: a reader with no cap on N, which would allocate hundreds of MB for a
    corrupt (but in-file) length field. Sparse file: no disk used."""
    _control(tmp_path)
    p = tmp_path / "huge.safetensors"
    with open(p, "wb") as f:
        f.write((MAX_HEADER_BYTES + 8).to_bytes(8, "little"))
        f.truncate(MAX_HEADER_BYTES + 64)
    with pytest.raises(CheckpointError, match="implausibly large"):
        read_header(p)


def test_read_header_refuses_file_shorter_than_length_field(tmp_path):
    """Catches: int.from_bytes on fewer than 8 bytes silently giving a small N."""
    _control(tmp_path)
    p = tmp_path / "short.safetensors"
    p.write_bytes(b"\x02\x00\x00")
    with pytest.raises(CheckpointError, match="shorter than the 8-byte"):
        read_header(p)


def test_read_header_refuses_overlapping_offsets(tmp_path):
    """Catches: an overlap check that compares only neighbours in header order, not in
    offset order."""
    hdr = {"b": _entry("U8", (4,), (4, 8)), "a": _entry("F32", (2,), (0, 8))}
    err = _refused(tmp_path, "overlaps", header=hdr)
    assert {err.tensor, "a", "b"} == {"a", "b"}


def test_read_header_accepts_empty_tensor_at_next_start_but_not_real_overlap(tmp_path):
    """Catches: treating a zero-byte tensor sharing a start as an overlap (the control)
    while still refusing two non-empty tensors that share a start."""
    ok = {"e": _entry("F32", (0, 3), (0, 0)), "a": _entry(), "z": _entry("U8", (0,), (8, 8))}
    assert {e.name for e in read_header(_raw_shard(tmp_path / "ok.safetensors", ok))} == \
        {"e", "a", "z"}
    _refused(tmp_path, "overlaps", header={"a": _entry(), "b": _entry("U8", (8,), (0, 8))})


def test_read_header_refuses_nbytes_not_matching_shape_times_dtype(tmp_path):
    """Catches: itemsize ignored (F32 read as 1 byte per element) or shape ignored."""
    err = _refused(tmp_path, "do not span shape x dtype",
                   header={"a": _entry("F32", (3,), (0, 8))})
    assert err.tensor == "a" and "12 bytes" in str(err)


def test_read_header_refuses_unknown_dtype(tmp_path):
    """Catches: a reader that guesses an item size for F64/I64 or a typo."""
    err = _refused(tmp_path, "unknown dtype", header={"a": _entry("F64", (1,), (0, 8))})
    assert err.tensor == "a"


@pytest.mark.parametrize("header, match", [
    ('{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
     '"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}', "twice"),
    ({"a": _entry(shape=(-2,), offsets=(0, 8))}, "non-negative"),
    ({"a": _entry(shape=(True, 2), offsets=(0, 8))}, "non-negative"),
    ({"a": _entry(shape=(2.0,), offsets=(0, 8))}, "non-negative"),
    ({"a": _entry(offsets=(8.0, 16.0))}, "two ints"),
    ({"a": _entry(offsets=(0, 8, 9))}, "two ints"),
    ({"a": _entry(offsets=(8, 0))}, "start <= end"),
    ({"a": dict(_entry(), extra=1)}, "wrong keys"),
    ({"a": {"dtype": "F32", "shape": [2]}}, "wrong keys"),
    ({"a": [1, 2]}, "not an object"),
    ({"__metadata__": {"k": 1}, "a": _entry()}, "__metadata__"),
    ('[1, 2]', "not a JSON object"),
    ('{"a": ', "not valid JSON"),
    (b'{"\xff": 1}', "not UTF-8"),
    ("[" * 100000 + "]" * 100000, "not valid JSON"),
    ({"a": _entry(shape=(2 ** 40, 2 ** 40), offsets=(0, 8))}, "implausibly many"),
], ids=["duplicate-name", "negative-dim", "bool-dim", "float-dim", "float-offsets",
        "three-offsets", "start-after-end", "extra-key", "missing-key", "entry-not-object",
        "metadata-not-strings", "top-level-array", "truncated-json", "not-utf8",
        "deep-nesting", "huge-numel"])
def test_read_header_refuses_malformed_entries(tmp_path, header, match):
    """Catches: json.loads keeping the last of two equal names, bools and floats passing
    as ints, extra or missing keys, bad __metadata__, deep nesting escaping as
    RecursionError, and unbounded shape products."""
    _refused(tmp_path, match, header=header, data_len=64)


def test_pread_into_loops_on_short_reads(tmp_path, monkeypatch):
    """Catches: a reader assuming one preadv fills the buffer (Linux returns at most
    ~2 GiB per call, and less on signals or network filesystems)."""
    p = tmp_path / "f.bin"
    data = np.arange(1000, dtype=np.uint16).tobytes()
    p.write_bytes(data)
    real = os.preadv
    calls = []

    def short(fd, bufs, offset):
        calls.append(offset)
        return real(fd, [memoryview(bufs[0])[:7]], offset)
    monkeypatch.setattr(stmod.os, "preadv", short)
    fd = os.open(p, os.O_RDONLY)
    try:
        buf = np.empty(len(data) - 10, np.uint8)
        pread_into(fd, 10, buf, path=p)
        assert buf.tobytes() == data[10:]
        assert len(calls) == math.ceil((len(data) - 10) / 7)
        with pytest.raises(CheckpointError, match="ends early") as info:
            pread_into(fd, len(data) - 5, np.empty(10, np.uint8), path=p, tensor="t")
        assert str(p) in str(info.value) and info.value.tensor == "t"
    finally:
        os.close(fd)


# ---- fuzz -------------------------------------------------------------------------------

def _valid_small_shard() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "s.safetensors")
        write_shard(p, _small_tensors() + [('q"uo\\te', "F16", (3,), bytes(6))],
                    metadata={"note": "fuzz"})
        with open(p, "rb") as f:
            return f.read()


VALID = _valid_small_shard()
_mutation = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, len(VALID) - 1),
                                                  st.integers(0, 255)), min_size=1, max_size=8)),
    st.tuples(st.just("truncate"), st.integers(0, len(VALID) - 1)),
    st.tuples(st.just("length"), st.integers(0, 2 ** 64 - 1)),
    st.tuples(st.just("length_near"), st.integers(-64, 64)),
)


def _mutate(kind, arg) -> bytes:
    b = bytearray(VALID)
    if kind == "flip":
        for i, v in arg:
            b[i] = v
    elif kind == "truncate":
        del b[arg:]
    elif kind == "length":
        b[:8] = arg.to_bytes(8, "little")
    else:
        n = max(0, int.from_bytes(b[:8], "little") + arg)
        b[:8] = n.to_bytes(8, "little")
    return bytes(b)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=_mutation)
def test_read_header_fuzz_only_checkpoint_errors_bounded_memory(tmp_path, mutation):
    """Catches: any corrupt header escaping as KeyError/TypeError/ValueError/
    RecursionError/MemoryError, hanging, or allocating by a corrupt length field."""
    blob = _mutate(*mutation)
    p = tmp_path / "fuzz.safetensors"
    p.write_bytes(blob)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        entries = read_header(p)
    except CheckpointError as e:
        assert str(p) in str(e)
        entries = None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 5.0
    assert peak < 32 * len(blob) + (64 << 10)      # measured worst: ~15x a 391-byte file
    if entries is not None:
        size = len(blob)
        for e in entries:
            assert 0 < e.offset and e.offset + e.nbytes <= size


def test_read_header_fuzz_control_valid_shard_opens(tmp_path):
    """Control for the fuzz test: the unmutated shard opens with all five tensors."""
    p = tmp_path / "ok.safetensors"
    p.write_bytes(VALID)
    assert len(read_header(p)) == 5


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["F32", "F16", "U8", "BF16"]),
                          st.lists(st.integers(0, 5), max_size=3)), min_size=1, max_size=6),
       st.integers(0, 2**32 - 1))
def test_safetensors_library_reads_what_we_write_and_agrees_with_our_reader(tmp_path, specs,
                                                                           seed):
    """The reference library as an oracle (the ``safetensors`` package, a test
    dependency: k3 reads shards itself, strictly and with pread, never through its mmap):
    every shard write_shard makes loads there with the same names, dtypes, shapes and
    (where numpy has the dtype) values, and read_header's offsets give the same bytes.
    Catches a header k3 writes that only k3 can read, or a reader that misplaces data."""
    safetensors = pytest.importorskip("safetensors")
    rng = np.random.default_rng(seed)
    np_of = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "BF16": np.uint16}
    tensors, arrays = [], {}
    for i, (dtype, shape) in enumerate(specs):
        a = rng.integers(0, 250, size=tuple(shape)).astype(np_of[dtype])
        name = f"t{i}.{dtype.lower()}"
        tensors.append((name, dtype, tuple(shape), a))
        arrays[name] = a
    path = tmp_path / f"s{seed}.safetensors"
    path.unlink(missing_ok=True)
    write_shard(path, tensors, metadata={"format": "pt"})
    ours = {e.name: e for e in read_header(path)}
    blob = path.read_bytes()
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert set(f.keys()) == set(arrays) == set(ours)
        assert f.metadata() == {"format": "pt"}
        for name, a in arrays.items():
            e = ours[name]
            sl = f.get_slice(name)
            assert sl.get_dtype() == e.dtype and tuple(sl.get_shape()) == e.shape
            assert blob[e.offset:e.offset + e.nbytes] == a.tobytes()
            if e.dtype != "BF16":                 # numpy has no bfloat16
                assert np.array_equal(f.get_tensor(name), a)
