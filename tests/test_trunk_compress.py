"""Compressed trunk (issue 16): the codec round-trips every BF16 pattern, a compressed pack
gives byte-identical logits at every budget and thread count, a damaged block is named by
verify and refused by k3-run (exit 3), and compressing resumes after an interruption."""

from __future__ import annotations

import json
import re
import shutil
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libk3.errors import FormatError
from libk3.io.checkpoint import Checkpoint
from libk3.kernels import bf16_block as blk
from libk3.kernels.bf16_planes import decode_block, encode_block
from libk3.pack.schema import (BLOCK_INDEX_FILE, COMPRESSED_TRUNK_FILE, MANIFEST_FILE,
                               TRUNK_FILE, open_pack)
from libk3.pack.codec import CODED, INDEX_RECORD, RAW, Codec, plan_blocks

from .scripts import k3, k3_here, k3pack, k3pack_here
from .test_run_cli import PROMPT, _budgets, _pack, _reference



def _compressed_copy(raw_pack, dest):
    shutil.copytree(raw_pack, dest)
    p = k3pack("compress", dest, "--quiet", "--json")
    assert p.returncode == 0, p.stderr
    return dest, json.loads(p.stdout)


@pytest.fixture(scope="module")
def small_raw(small_dir, tmp_path_factory):
    return _pack(small_dir, tmp_path_factory.mktemp("raw") / "small.pack")


@pytest.fixture(scope="module")
def small_kz(small_raw, tmp_path_factory):
    return _compressed_copy(small_raw, tmp_path_factory.mktemp("kz") / "small.pack")[0]


# ---- the codec ---------------------------------------------------------------------------

def _encode(u16) -> np.ndarray:
    out = np.empty(blk.HEADER_BYTES + 2 * u16.size, np.uint8)
    return out[:encode_block(u16, out)].copy()


def _decode(stored, k):
    out = np.full(2 * k, 0xAA, np.uint8)
    return decode_block(stored, out), out.view(np.uint16)


def test_block_round_trips_every_bf16_pattern_at_every_base():
    """Catches a code that loses a bit (the exponent's low bit sits in the low byte) or
    an escape patched wrongly: for every window base, a block holding all 3,840 patterns
    inside its window and one value of every exponent outside it (escaped) decodes
    exactly, in the nibble form, with that base."""
    m = np.arange(256, dtype=np.uint16)
    sign_mantissa = ((m & 0x80) << 8) | (m & 0x7F)
    for base in range(blk.MAX_BASE + 1):
        inside = (((base + np.arange(blk.WINDOW, dtype=np.uint16))[:, None] << 7)
                  | sign_mantissa[None, :]).ravel()
        outside = np.array([e for e in range(256) if not base <= e < base + blk.WINDOW],
                           np.uint16)
        u16 = np.concatenate([outside[:100] << 7 | 0x8055, inside, outside[100:] << 7 | 3])
        stored = _encode(u16)
        assert (stored[0], stored[1]) == (blk.NIBBLE, base)
        assert stored.size == blk.HEADER_BYTES + u16.size + (u16.size + 1) // 2 + 5 * outside.size
        status, out = _decode(stored, u16.size)
        assert status == blk.OK and np.array_equal(out, u16), base


def test_block_the_nibble_form_would_not_shrink_is_stored_verbatim():
    """Catches a block of spread exponents (random bits) stored larger than its values:
    it is written verbatim, 8 header bytes more than raw, and decodes exactly; one value
    fewer than the break-even keeps the nibble form."""
    u16 = np.random.default_rng(0).integers(0, 1 << 16, 4001, dtype=np.uint16)
    stored = _encode(u16)
    assert stored[0] == blk.VERBATIM and stored.size == blk.HEADER_BYTES + 2 * u16.size
    status, out = _decode(stored, u16.size)
    assert status == blk.OK and np.array_equal(out, u16)
    # k values with n escapes take 8 + 1.5k + 5n (k even): the nibble form wins while
    # 5n < k / 2
    k = 1000
    for n, mode in ((99, blk.NIBBLE), (100, blk.VERBATIM)):
        u16 = np.full(k, 0x3C00, np.uint16)
        u16[:n] = 0x0001                                  # exponent 0: outside the window
        assert _encode(u16)[0] == mode, n


def _nibble_block():
    u16 = np.full(64, 0x3C05, np.uint16)
    u16[[3, 40]] = 0x0001                                 # two escapes
    return _encode(u16), 64


@pytest.mark.parametrize("case, edit, status", [
    ("mode", lambda b: b.__setitem__(0, 2), blk.BAD_HEADER),
    ("reserved byte", lambda b: b.__setitem__(2, 1), blk.BAD_HEADER),
    ("base past the last window", lambda b: b.__setitem__(1, blk.MAX_BASE + 1),
     blk.BAD_HEADER),
    ("more escapes than values", lambda b: b.__setitem__(slice(4, 8), [65, 0, 0, 0]),
     blk.BAD_HEADER),
    ("one escape more than stored", lambda b: b.__setitem__(4, 3), blk.BAD_LENGTH),
    ("huge escape count", lambda b: b.__setitem__(slice(4, 8), [255] * 4), blk.BAD_HEADER),
    ("position past the block", lambda b: b.__setitem__(slice(-10, -6), [64, 0, 0, 0]),
     blk.BAD_ESCAPE),
    ("positions out of order", lambda b: b.__setitem__(slice(-10, -6), [2, 0, 0, 0]),
     blk.BAD_ESCAPE),
    ("position not marked", lambda b: b.__setitem__(slice(-10, -6), [41, 0, 0, 0]),
     blk.BAD_ESCAPE),
])
def test_block_header_or_escapes_that_lie_are_refused(case, edit, status):
    """Catches a decoder that trusts a block's header or escape list (a lie would make
    it read or write outside the block): each lie gives its status (control: the
    untouched block decodes)."""
    stored, k = _nibble_block()
    assert _decode(stored, k)[0] == blk.OK
    bad = stored.copy()
    edit(bad)
    assert _decode(bad, k)[0] == status, case


def _values(draw_kind, data):
    n = data.draw(st.integers(0, 3000), label="n")
    if draw_kind == "equal":
        return np.full(n, data.draw(st.integers(0, 0xFFFF)), np.uint16)
    if draw_kind == "all_exponents":
        e = np.arange(n) % 256
        return ((e << 7) | (np.arange(n) * 40503 & 0x807F)).astype(np.uint16)
    if draw_kind in ("gaussian", "escapes"):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        f = (rng.standard_normal(n) * 0.02).astype(np.float32)
        u16 = (f.view(np.uint32) >> 16).astype(np.uint16)
        if draw_kind == "escapes":            # zeros, huge and tiny values among them
            at = rng.random(n) < data.draw(st.sampled_from([0.001, 0.05, 0.5]))
            u16[at] = rng.integers(0, 1 << 16, int(at.sum()), dtype=np.uint16)
        return u16
    return np.frombuffer(data.draw(st.binary(min_size=2 * n, max_size=2 * n)), np.uint16)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["equal", "all_exponents", "gaussian", "escapes", "random"]),
       block=st.sampled_from([2, 6, 64, 1000, 4096]), data=st.data())
def test_codec_round_trips_any_layer(kind, block, data):
    """Catches any value, length or block split the codec does not restore exactly: a
    layer of a coded BF16 tensor (any length, including empty and odd element counts),
    an F32 tensor and a BF16 tensor at an odd offset (both raw), in blocks of ``block``
    bytes, decoded on 1 and 2 threads."""
    v = _values(kind, data)
    f32 = data.draw(st.binary(max_size=40).map(lambda b: b[:len(b) // 4 * 4]), label="f32")
    odd = data.draw(st.binary(max_size=9).map(lambda b: b[:len(b) // 2 * 2]), label="odd")
    run = np.frombuffer(v.tobytes() + f32 + b"\0" + odd, np.uint8).copy()
    tensors = [("w", 0, v.nbytes, "BF16"), ("f", v.nbytes, len(f32), "F32"),
               ("pad", v.nbytes + len(f32), 1, "U8"), ("odd", v.nbytes + len(f32) + 1,
                                                         len(odd), "BF16")]
    plan = plan_blocks(tensors, block, 0)
    assert all(plan.kind[b] == (CODED if plan.tensor[b] == "w" else RAW)
               for b in range(len(plan)))
    for threads in (1, 2):
        codec = Codec(threads)
        blob, rec = codec.encode(run, plan)
        p = plan.with_index(rec)
        assert p.stored_problem() is None
        out = np.full(run.size, 0xAA, np.uint8)
        codec.decode(p, 0, len(p), np.frombuffer(blob, np.uint8), 0, out, True, "x", 0)
        codec.close()
        assert out.tobytes() == run.tobytes()


@settings(max_examples=40, deadline=None)
@given(pos=st.integers(0, 10**6), flip=st.integers(1, 255))
def test_codec_damaged_block_names_it_or_decodes_without_crash(pos, flip):
    """Catches a decoder that trusts damaged bytes: with the checksum on, any flipped byte
    is refused naming its block; with it off, a damaged block is a FormatError or wrong
    bytes, never a crash or a write outside the block."""
    f = (np.random.default_rng(1).standard_normal(300_000) * 0.02).astype(np.float32)
    run = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    plan = plan_blocks([("mlp.w", 0, run.size, "BF16")])
    codec = Codec(1)
    blob, rec = codec.encode(run, plan)
    p = plan.with_index(rec)
    bad = np.frombuffer(blob, np.uint8).copy()
    pos %= bad.size
    bad[pos] ^= flip
    b = int(np.searchsorted(p.in_off, pos, side="right")) - 1
    out = np.zeros(run.size + 64, np.uint8)
    with pytest.raises(FormatError, match=f"layer 7 tensor mlp.w block {b} of {len(p)}: "
                                          "stored bytes do not match their checksum"):
        codec.decode(p, 0, len(p), bad, 0, out, True, "trunk.kz", 7)
    try:
        codec.decode(p, 0, len(p), bad, 0, out, False, "trunk.kz", 7)
    except FormatError as e:
        assert f"block {b} of" in str(e)
    assert not out[run.size:].any()
    codec.decode(p, 0, len(p), np.frombuffer(blob, np.uint8), 0, out, True, "trunk.kz", 7)
    assert out[:run.size].tobytes() == run.tobytes()           # control: intact bytes decode


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 60_000), escapes=st.sampled_from([0.0, 0.01, 0.2, 1.0]),
       block=st.sampled_from([64, 1000, 4096]), pages=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_in_place_schedule_decodes_exactly_in_any_order_it_allows(n, escapes, block, pages,
                                                                  seed):
    """Catches an in-place schedule that lets a block's output overwrite stored bytes not
    yet decoded (``BlockPlan.in_place`` too small, a missing wait in ``Task.after``) or
    lets a piece still being read land on decoded output: every piece is read at any
    moment (reads all start at once and land in any order), each run of blocks decodes
    at a random moment its piece and its waits allow, and the buffer ends up the run
    exactly, with at most one block plus 8 bytes a block (and two pages) of room."""
    from libk3.io.direct import ALIGN, align_up
    from libk3.stream.piece_reader import schedule

    rng = np.random.default_rng(seed)
    v = ((rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(
        np.uint16)
    at = rng.random(n) < escapes                  # 1.0: random bits, stored verbatim
    v[at] = rng.integers(0, 1 << 16, int(at.sum()), dtype=np.uint16)
    f32 = rng.integers(0, 256, 4 * (seed % 700), np.uint8)
    run = np.frombuffer(v.tobytes() + f32.tobytes(), np.uint8).copy()
    plan = plan_blocks([("w", 0, v.nbytes, "BF16"), ("f", v.nbytes, f32.size, "F32")],
                       block, 0)
    codec = Codec(1)
    blob, rec = codec.encode(run, plan)
    p = plan.with_index(rec)
    s = schedule(p, len(blob), pages * ALIGN)
    size = s.at + align_up(len(blob))
    assert size <= run.size + int(p.in_len.max(initial=0)) + 8 * len(p) + 2 * ALIGN
    stored = np.frombuffer(blob, np.uint8)
    buf = np.full(size, 0xAA, np.uint8)
    landed, done = set(), set()
    while len(done) < len(s.tasks):
        ready = [("read", k) for k in range(len(s.pieces)) if k not in landed]
        ready += [("decode", i) for i, t in enumerate(s.tasks) if i not in done
                  and all(k in landed for k in range(t.piece + 1)) and set(t.after) <= done]
        what, i = ready[rng.integers(len(ready))]
        if what == "read":
            a, n = s.pieces[i]
            buf[s.at + a:s.at + a + n] = stored[a:a + n]
            landed.add(i)
        else:
            t = s.tasks[i]
            codec.decode(p, t.lo, t.hi, buf, s.at + int(p.in_off[t.lo]), buf, True, "x", 0)
            done.add(i)
    codec.close()
    assert buf[:run.size].tobytes() == run.tobytes()


# ---- packs end to end -----------------------------------------------------------------

def test_compress_pack_layout_and_verify(small_raw, small_kz, small_dir):
    """Catches a compressed pack that is not smaller, not v3, keeps trunk.bin, or that
    verify (with the checkpoint, byte for byte after decoding) does not pass."""
    man = json.loads((small_kz / MANIFEST_FILE).read_text())
    raw = json.loads((small_raw / MANIFEST_FILE).read_text())
    assert man["version"] == 3 and raw["version"] == 2
    assert not (small_kz / TRUNK_FILE).exists() and (small_kz / BLOCK_INDEX_FILE).is_file()
    assert man["trunk_bytes"] < 0.8 * raw["trunk_bytes"]
    assert [l["crc32"] for l in man["layers"]] == [l["crc32"] for l in raw["layers"]]
    p = k3pack("verify", small_kz, "--against", small_dir, "--quiet", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["compressed"] is True
    again = k3pack_here("compress", small_kz, "--json", "--quiet")
    assert again.returncode == 0 and json.loads(again.stdout)["already_compressed"]


def test_run_compressed_pack_same_logits_at_every_budget_and_thread_count(
        small_dir, small_raw, small_kz, tmp_path):
    """Catches a decode on the read-ahead path that changes any byte, depends on the
    thread count, the ring or pinning: tokens and logits equal the resident forward's,
    and the report shows the trunk read compressed and decoded."""
    ref = _reference(small_dir)
    b = _budgets(small_dir)
    for i, (budget, threads) in enumerate([(b[1], "1"), (b[1], None), (b[2], None)]):
        r = _run_same_logits(small_dir, small_kz, ref, budget, threads, tmp_path / str(i))
        assert r["trunk_decode_seconds"] > 0
        assert r["trunk_bytes_read"] < 0.8 * r["trunk_bytes_decoded"]


def test_run_compressed_tiny_pack_same_logits(tiny_dir, tmp_path):
    """Catches a compressed pack whose layers hold only raw blocks (every tiny tensor is
    below the coded size) decoding wrongly: logits equal the resident forward's."""
    from libk3.pack.compress import compress

    raw = _pack(tiny_dir, tmp_path / "tiny.pack")
    kz = tmp_path / "tiny-kz.pack"
    shutil.copytree(raw, kz)
    res = compress(kz, progress=False, even_if_no_gain=True)   # k3-pack would keep it raw
    assert res.stored_bytes == res.raw_bytes and open_pack(kz).compressed
    r = _run_same_logits(tiny_dir, kz, _reference(tiny_dir), _budgets(tiny_dir)[1], None,
                         tmp_path / "t")
    assert r["trunk_bytes_decoded"] > 0


def test_compress_that_saves_nothing_says_so_and_leaves_the_pack_as_it_was(tiny_dir,
                                                                          tmp_path):
    """Catches a compress that rewrites a pack it does not shrink (tiny: every tensor is
    below the coded size, so the trunk would only gain its block index): it says so,
    and every file of the pack keeps its name and bytes (control: the small pack
    compresses, test_compress_pack_layout_and_verify)."""
    d = _pack(tiny_dir, tmp_path / "tiny.pack")
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    p = k3pack_here("compress", d, "--quiet")
    assert p.returncode == 0, p.stderr
    assert "saves nothing" in p.stdout and "left as it was" in p.stdout, p.stdout
    assert {q.name: q.read_bytes() for q in d.iterdir()} == before
    p = k3pack_here("compress", d, "--quiet", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["saves_nothing"] is True
    assert {q.name: q.read_bytes() for q in d.iterdir()} == before


def _run_same_logits(model, pack_dir, ref, budget, threads, stem) -> dict:
    """k3-run with ``threads`` in its own process, or with the default team (this
    machine's CPUs) in this one."""
    out, rep = stem.with_suffix(".npy"), stem.with_suffix(".json")
    args = (model, "--ids", PROMPT, "--gen", 6, *budget, "--pack", pack_dir,
            "--logits-out", out, "--report-json", rep)
    p = k3_here(*args) if threads is None else k3(*args, "--threads", threads)
    assert p.returncode == 0, p.stderr
    r = json.loads(rep.read_text())
    assert r["generated_ids"] == ref.generated_ids, (budget, threads)
    assert np.array_equal(np.load(out).view(np.uint32), ref.logits.view(np.uint32))
    return r


def _damage_block(pack_dir, L=2):
    """Flip one byte inside the first coded block of layer L; returns its block text."""
    pk = open_pack(pack_dir)
    plan, lay = pk.blocks[L], pk.manifest["layers"][L]
    b = int(np.flatnonzero(plan.kind == CODED)[0])
    at = lay["file_off"] + int(plan.in_off[b] + plan.in_len[b]) - 3
    with open(pack_dir / COMPRESSED_TRUNK_FILE, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x5A]))
    return f"layer {L} tensor {plan.tensor[b]} block {int(plan.part[b])} of {int(plan.parts[b])}"


def test_corrupt_block_named_by_verify_and_refused_by_run(small_dir, small_kz, tmp_path):
    """Catches a damaged compressed block that verify passes or k3-run decodes: both
    exit 3 naming the layer, tensor and block (control: the undamaged pack passes verify
    in test_compress_pack_layout_and_verify and runs in the logits test)."""
    bad = tmp_path / "bad.pack"
    shutil.copytree(small_kz, bad)
    where = _damage_block(bad)
    v = k3pack_here("verify", bad, "--quiet")
    assert v.returncode == 3 and where in v.stderr and "checksum" in v.stderr, v.stderr
    r = k3_here(small_dir, "--ids", "1,2", "--gen", 1, *_budgets(small_dir)[1], "--pack", bad)
    assert r.returncode == 3 and where in r.stderr, r.stderr
    assert len([ln for ln in r.stderr.strip().splitlines()      # a cold numba cache adds
                if not ln.startswith("compiling k3 kernels")]) == 1  # its notice first


def _nan_kz(small_raw, dest, L, sfx, element):
    """A compressed copy of ``small_raw`` whose layer L tensor ``sfx`` holds a NaN at
    ``element``, every checksum (the layer's crc32, the block's, the block index's) right:
    a pack deliberately rewritten, or compressed from a checkpoint holding the NaN. Returns
    it and the text naming the NaN's block."""
    import struct
    import zlib

    from libk3.io.dtypes import ITEMSIZE
    from libk3.pack import compress as pack_compress

    shutil.copytree(small_raw, dest)
    doc = json.loads((dest / MANIFEST_FILE).read_text())
    lay = doc["layers"][L]
    t = lay["tensors"][sfx]
    size = ITEMSIZE[t["dtype"]]
    with open(dest / TRUNK_FILE, "r+b") as f:
        f.seek(lay["file_off"] + t["off"] + size * element)
        f.write(struct.pack("<I", 0x7FC00000) if size == 4 else struct.pack("<H", 0x7FC0))
        f.seek(lay["file_off"])
        lay["crc32"] = zlib.crc32(f.read(lay["nbytes"]))
    (dest / MANIFEST_FILE).write_text(json.dumps(doc))
    pack_compress.compress(dest, progress=False)
    plan = open_pack(dest).blocks[L]
    b = int(np.searchsorted(plan.out_off, t["off"] + size * element, side="right") - 1)
    assert plan.tensor[b] == sfx
    return dest, plan, b


@pytest.mark.parametrize("L,sfx,element,budget", [
    (2, "self_attn.q_proj.weight", 200_000, 1),      # a coded block, the tensor's second
    (5, "self_attn.dt_bias", 3, 4),                  # a raw (F32) block, the layer pinned
])
def test_nan_in_a_decoded_block_named_by_verify_and_refused_by_run(
        small_dir, small_raw, tmp_path, L, sfx, element, budget):
    """Catches NaN/Inf in a compressed block whose checksums were all recomputed: verify
    must name its layer, tensor and block (it named the tensor only), and k3-run must
    refuse it when it decodes the block, exit 3 with one line naming the pack's trunk
    file, the layer, the tensor and the block, no token printed (it named only the layer
    whose output went non-finite, or printed tokens when the NaN did not reach an
    output). With --allow-nonfinite verify passes it with a warning; the undamaged pack
    passes verify and runs (test_compress_pack_layout_and_verify, the logits tests)."""
    bad, plan, b = _nan_kz(small_raw, tmp_path / "nan.pack", L, sfx, element)
    where = plan.where(L, b)
    assert plan.kind[b] == (CODED if budget == 1 else RAW)
    v = k3pack_here("verify", bad, "--quiet")
    assert v.returncode == 3 and len(v.stderr.strip().splitlines()) == 1, v.stderr
    assert where in v.stderr and "NaN or Inf" in v.stderr, v.stderr
    w = k3pack_here("verify", bad, "--quiet", "--allow-nonfinite")
    assert w.returncode == 0 and "warning: 1 trunk tensor(s)" in w.stderr, w.stderr
    r = k3_here(small_dir, "--ids", "1,2", "--gen", 1, *_budgets(small_dir)[budget], "--pack", bad)
    lines = [ln for ln in r.stderr.strip().splitlines()      # a cold numba cache adds
             if not ln.startswith("compiling k3 kernels")]   # its notice first
    assert r.returncode == 3 and len(lines) == 1 and r.stdout.strip() == "", r.stderr
    assert str(bad / COMPRESSED_TRUNK_FILE) in lines[0] and where in lines[0], lines[0]
    assert "NaN or Inf" in lines[0]


def test_block_index_damage_refused_at_open(small_kz, tmp_path):
    """Catches a block index read without its CRC: one changed stored length is refused
    when the pack is opened, naming trunk.blocks."""
    bad = tmp_path / "idx.pack"
    shutil.copytree(small_kz, bad)
    blob = bytearray((bad / BLOCK_INDEX_FILE).read_bytes())
    blob[0] ^= 1
    (bad / BLOCK_INDEX_FILE).write_bytes(bytes(blob))
    with pytest.raises(FormatError, match="trunk.blocks.*crc32"):
        open_pack(bad)
    open_pack(small_kz)                                            # control


def test_compress_resumes_after_interruption(small_raw, small_kz, tmp_path, monkeypatch):
    """Catches a compress that starts over, skips a layer, or keeps a damaged partial
    layer after an interruption: the raw pack stays usable meanwhile, the rerun resumes
    the verified layers and ends with the same bytes as an uninterrupted run."""
    from libk3.pack import compress as pack_compress

    d = tmp_path / "p.pack"
    shutil.copytree(small_raw, d)
    real, calls = Codec.encode, []

    def failing(self, *args):                 # one call per layer here (layers < 64 MiB)
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(Codec, "encode", failing)
    with pytest.raises(KeyboardInterrupt):
        pack_compress.compress(d, progress=False)
    monkeypatch.setattr(Codec, "encode", real)
    assert not open_pack(d).compressed                             # raw pack still whole
    with open(d / pack_compress.KZ_PARTIAL_FILE, "r+b") as f:      # damage layer 2's bytes
        f.seek(open_pack(small_kz).manifest["layers"][2]["file_off"] + 5)
        f.write(b"\xff\xfe")
    res = pack_compress.compress(d, progress=False)
    assert res.layers_resumed == 2
    assert (d / COMPRESSED_TRUNK_FILE).read_bytes() == \
        (small_kz / COMPRESSED_TRUNK_FILE).read_bytes()
    assert (d / BLOCK_INDEX_FILE).read_bytes() == (small_kz / BLOCK_INDEX_FILE).read_bytes()
    assert not (d / TRUNK_FILE).exists() and not (d / pack_compress.KZ_JOURNAL_FILE).exists()


def test_compress_and_verify_in_small_pieces_give_the_same_result(small_raw, small_kz,
                                                                  small_dir, tmp_path,
                                                                  monkeypatch):
    """Catches piece boundaries that change the stored bytes, the index, a layer's CRC or
    the NaN/Inf scan: compressing and verifying in pieces of a few blocks (odd offsets
    included) gives the same pack, and verify still passes it."""
    import libk3.pack.verify as pack_mod
    from libk3.pack import compress as pack_compress

    monkeypatch.setattr(pack_compress, "ENCODE_BYTES", 300_000)
    monkeypatch.setattr(pack_mod, "COPY_BLOCK", 200_000)
    d = tmp_path / "pieces.pack"
    shutil.copytree(small_raw, d)
    pack_compress.compress(d, threads=2, progress=False)
    assert (d / COMPRESSED_TRUNK_FILE).read_bytes() == \
        (small_kz / COMPRESSED_TRUNK_FILE).read_bytes()
    assert (d / BLOCK_INDEX_FILE).read_bytes() == (small_kz / BLOCK_INDEX_FILE).read_bytes()
    reader = pack_mod._DecodedLayers(open_pack(d), -1, d)
    reader.codec.close()
    assert len(reader.groups[1]) > 3                       # verify read layer 1 in pieces
    with Checkpoint.open(small_dir) as ckpt:
        assert pack_mod.verify(d, ckpt, progress=False)["ok"]


def _edit_manifest(d, fn):
    doc = json.loads((d / MANIFEST_FILE).read_text())
    fn(doc)
    (d / MANIFEST_FILE).write_text(json.dumps(doc))


@pytest.mark.parametrize("case, edit, field", [
    ("codec name", lambda doc: doc["trunk_codec"].update(name="bf16-exponent-lz4"),
     "trunk_codec.name"),
    ("block size", lambda doc: doc["trunk_codec"].update(block_bytes=131072),
     "trunk_codec.block_bytes"),
    ("stored", lambda doc: doc["layers"][3].update(stored=doc["layers"][3]["stored"] - 8),
     "layer 3: its blocks' stored lengths do not add up"),
    ("no codec", lambda doc: doc.pop("trunk_codec"), "missing key 'trunk_codec'"),
    ("raw file name", lambda doc: doc.update(trunk_file="trunk.bin"), "trunk_file"),
])
def test_compressed_manifest_lies_refused_at_open(case, edit, field, small_kz, small_raw,
                                                  tmp_path):
    """Catches a v3 manifest read without its codec fields checked (another codec or
    block size would decode garbage; a wrong stored length misplaces every later layer),
    and a v2 pack that claims v3 (control: both untouched packs open)."""
    bad = tmp_path / "bad.pack"
    shutil.copytree(small_kz, bad)
    _edit_manifest(bad, edit)
    with pytest.raises(FormatError, match=re.escape(field)):
        open_pack(bad)
    v2 = tmp_path / "v2.pack"
    shutil.copytree(small_raw, v2)
    _edit_manifest(v2, lambda doc: doc.update(version=3))
    with pytest.raises(FormatError, match="missing key 'trunk_codec'"):
        open_pack(v2)
    assert open_pack(small_kz).compressed and not open_pack(small_raw).compressed


def test_pack_of_the_earlier_zstd_codec_refused_with_the_way_out(small_kz, tmp_path):
    """Catches a pack compressed by an earlier k3 (the zstd exponent codec) read as this
    codec's blocks (garbage weights): it is refused at open, naming the codec and how to
    get a readable pack."""
    old = tmp_path / "old.pack"
    shutil.copytree(small_kz, old)
    _edit_manifest(old, lambda doc: doc["trunk_codec"].update(name="bf16-exponent-zstd"))
    with pytest.raises(FormatError, match=r"trunk_codec\.name: is not the codec this k3 "
                                          r"decodes.*bf16-exponent-zstd.*--compress-trunk"):
        open_pack(old)


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_streamer_decodes_a_compressed_pack_in_place_exactly(small_dir, small_raw, small_kz,
                                                             share):
    """Catches any byte of a layer that differs from the raw pack's when decoded in place,
    through the floor's single slot, the read-ahead and pinned layers, over two passes,
    and buffers without room to decode in place or with more than one block's (a slot
    holds its raw layer plus the largest ring layer's room; a pinned layer's buffer its
    own)."""
    from libk3.budget import ModelSizes, minimum_budget
    from libk3.io.direct import FileSet, window_bytes
    from libk3.pack.schema import open_pack
    from libk3.stream.trunk import runs_from_pack
    from libk3.stream.trunk_modes import open_trunk
    from libk3.pack.codec import BLOCK_BYTES

    with Checkpoint.open(small_dir) as c:
        sizes = ModelSizes.from_checkpoint(c)
        budget = max(minimum_budget(sizes).trunk_bytes + 1, int(sizes.trunk_bytes * share))
        streams = []
        for pk_dir in (small_raw, small_kz):
            pk = open_pack(pk_dir, c)
            streams.append(open_trunk(c.config, runs_from_pack(pk_dir, pk.manifest, pk.blocks),
                                      budget, FileSet(use_direct=True)))
        raw, kz = streams
        try:
            assert kz.n_slots == raw.n_slots and (kz.n_slots >= 2) == (share > 0)
            if share > 0:
                assert kz.pinned_plan                      # both read pools are used
            room = [r.buffer_bytes - window_bytes(r.nbytes) for r in kz.runs]
            assert all(0 <= x <= BLOCK_BYTES + 8 * len(r.blocks) + 4096
                       for x, r in zip(room, kz.runs))
            assert [a - b for a, b in zip(kz.slot_bytes, raw.slot_bytes)] == \
                [max(room[L] for L in kz.ring)] * kz.n_slots
            for _ in range(2):
                for L in range(len(kz.runs)):
                    a, b = raw.layer(L), kz.layer(L)
                    assert a.keys() == b.keys()
                    for k in a:
                        assert np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), (L, k)
                    raw.release(L)
                    kz.release(L)
        finally:
            raw.close()
            kz.close()


def _floor_streamer(c, pack_dir, monkeypatch, piece=16384):
    """A one-slot streamer over a pack of ``c``, reading in ``piece``-byte pieces."""
    from libk3.budget import ModelSizes, minimum_budget
    from libk3.pack.schema import open_pack
    from libk3.stream.trunk import runs_from_pack
    from .floor_helpers import floor_streamer

    pk = open_pack(pack_dir, c)
    return floor_streamer(c.config, runs_from_pack(pack_dir, pk.manifest, pk.blocks),
                          minimum_budget(ModelSizes.from_checkpoint(c)).trunk_bytes + 1,
                          monkeypatch, piece)


def test_floor_hands_out_a_compressed_layers_first_tensors_while_later_blocks_land(
        small_dir, small_kz, monkeypatch):
    """Catches a compressed floor layer handed out only once all of it is decoded, or a
    tensor bound before its blocks were decoded: with the stored bytes of the layer's last
    tensor held, its first tensor comes right (checked and decoded) and the last waits;
    once released, every tensor equals the checkpoint's."""
    from libk3.model.weights import load_layer
    from .floor_helpers import HeldReads, within

    with Checkpoint.open(small_dir) as c:
        ts, files = _floor_streamer(c, small_kz, monkeypatch)
        run = ts.runs[0]
        plan = run.blocks
        first = min(run.tensors, key=lambda k: run.tensors[k][0])
        last = plan.tensor[-1]
        b = plan.tensor.index(last)
        hold = HeldReads(files, run.path, run.offset + int(plan.in_off[b]))
        want = load_layer(c, c.config, 0)
        try:
            lw = within(lambda: ts.layer(0))
            assert within(lambda: lw[first]).tobytes() == want[first].tobytes()
            with pytest.raises(AssertionError, match="still waiting"):
                within(lambda: lw[last], 1.0)
            assert hold.held
        finally:
            hold.release()
        for k in want:
            assert lw[k].tobytes() == want[k].tobytes(), k
        ts.release(0)
        ts.close()
        files.close()


def test_floor_withholds_a_raw_layer_until_its_crc_matched(small_dir, small_raw, tmp_path,
                                                           monkeypatch):
    """Catches a raw layer's tensors handed out before the layer's one CRC was checked: a
    damaged byte in its last tensor must refuse even its first tensor (the forward never
    computes on bytes the checksum has not passed)."""
    bad = tmp_path / "bad.pack"
    shutil.copytree(small_raw, bad)
    lay = json.loads((bad / "trunk.json").read_text())["layers"][0]
    first = min(lay["tensors"], key=lambda k: lay["tensors"][k]["off"])
    last = max(lay["tensors"].values(), key=lambda t: t["off"])
    with open(bad / "trunk.bin", "r+b") as fh:
        fh.seek(lay["file_off"] + last["off"] + 11)
        byte = fh.read(1)[0]
        fh.seek(-1, 1)
        fh.write(bytes([byte ^ 0x40]))
    with Checkpoint.open(small_dir) as c:
        ts, files = _floor_streamer(c, bad, monkeypatch)
        with pytest.raises(FormatError, match="checksum"):
            ts.layer(0)[first]
        ts.close()
        files.close()


def _duplicate_block(pack_dir) -> int:
    """Copy a compressed layer's block over its neighbour of the same size (different
    bytes), recomputing that block's CRC in trunk.blocks and the index's CRC in
    trunk.json, the layer's own crc32 left as it was; the layer."""
    pk = open_pack(pack_dir)
    man = json.loads((pack_dir / MANIFEST_FILE).read_text())
    kz = pack_dir / COMPRESSED_TRUNK_FILE
    blob = bytearray((pack_dir / BLOCK_INDEX_FILE).read_bytes())
    rec = np.frombuffer(blob, INDEX_RECORD)
    first = 0
    with open(kz, "r+b") as f:
        for L, plan in enumerate(pk.blocks):
            at0 = man["layers"][L]["file_off"]
            for b in range(len(plan) - 1):
                n = int(plan.in_len[b])
                if n != int(plan.in_len[b + 1]) or plan.kind[b] != plan.kind[b + 1] \
                        or int(plan.out_len[b]) != int(plan.out_len[b + 1]):
                    continue
                f.seek(at0 + int(plan.in_off[b]))
                src = f.read(n)
                f.seek(at0 + int(plan.in_off[b + 1]))
                if f.read(n) == src:
                    continue
                f.seek(at0 + int(plan.in_off[b + 1]))
                f.write(src)
                rec[first + b + 1]["crc32"] = zlib.crc32(src)
                (pack_dir / BLOCK_INDEX_FILE).write_bytes(bytes(blob))
                man["trunk_codec"]["block_index_crc32"] = zlib.crc32(bytes(blob))
                (pack_dir / MANIFEST_FILE).write_text(json.dumps(man))
                return man["layers"][L]["layer"]
            first += len(plan)
    raise AssertionError("no two neighbouring blocks of one size")


def test_run_refuses_a_rewritten_block_whose_layer_crc_is_stale(tiny_dir, tmp_path):
    """Catches k3-run trusting a compressed layer whose blocks match the index but whose
    decoded bytes do not match the layer's crc32 (a block copied over its neighbour, the
    block and index CRCs recomputed): verify refused it, run generated other tokens; now
    both exit 3 naming the layer, one line (control: the pack before the edit runs)."""
    from libk3.pack.compress import compress
    kz = tmp_path / "tiny-kz.pack"
    shutil.copytree(_pack(tiny_dir, tmp_path / "tiny.pack"), kz)
    compress(kz, progress=False, even_if_no_gain=True)
    args = (tiny_dir, "--ids", "1,2,3", "--gen", 2, "--pack", kz, "-q")
    assert k3_here(*args).returncode == 0                                   # control
    L = _duplicate_block(kz)
    v = k3pack_here("verify", kz, "--quiet")
    assert v.returncode == 3 and f"layer {L}" in v.stderr, v.stderr
    r = k3_here(*args)
    assert r.returncode == 3 and f"layer {L}" in r.stderr, r.stderr
    assert len([ln for ln in r.stderr.strip().splitlines()
                if not ln.startswith("compiling k3 kernels")]) == 1, r.stderr
