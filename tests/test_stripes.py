"""Striped packs (formats/pack.md "Striped trunk") and per-drive read queues: same logits
as an unstriped pack, every refusal (missing directory, damaged, truncated or foreign
stripe, read-only or full target), resume after kill -9, and the throttle's arithmetic."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from libk3.budget import ModelSizes, minimum_budget
from libk3.errors import K3IOError
from libk3.io.checkpoint import Checkpoint
from libk3.io.direct import HUGE_PAGE, DriveQueue, FileSet, ReadGate, TokenBucket
from libk3.pack import stripes
from libk3.pack.writer import JOURNAL_FILE, MANIFEST_FILE, TRUNK_FILE, pack

from .scripts import k3, k3_here, k3pack_here

PROMPT = "5,17,300,42,7,99,128,3"


def _floor(model_dir) -> tuple:
    with Checkpoint.open(model_dir) as ckpt:
        f = minimum_budget(ModelSizes.from_checkpoint(ckpt))
    return ("--trunk-gb", f"{(f.trunk_bytes + 1) / 1e9:.9f}",
            "--cache-gb", f"{(f.cache_bytes + 1) / 1e9:.9f}")


def _striped(model_dir, tmp_path, n: int = 1, name: str = "p"):
    out, dirs = tmp_path / name, [tmp_path / f"{name}-s{i}" for i in range(1, n + 1)]
    args = [a for d in dirs for a in ("--stripe", d)]
    p = k3pack_here(model_dir, out, "--quiet", *args)
    assert p.returncode == 0, p.stderr
    return out, dirs


def _logical_trunk(out) -> bytes:
    """The striped trunk's bytes in logical order (the stripes put back together)."""
    man = json.loads((out / MANIFEST_FILE).read_text())
    lay = stripes.open_layout(out, man)
    buf = bytearray(sum(lay.sizes))
    f = stripes.open_reader(lay, out / TRUNK_FILE, use_direct=False)
    try:
        assert f.preadv([buf], 0) == len(buf)
    finally:
        f.close()
    return bytes(buf)


@pytest.fixture(scope="module")
def tiny_plain(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "p"
    with Checkpoint.open(tiny_dir) as ckpt:
        pack(ckpt, out, progress=False)
    return out


def test_stripes_same_logits_as_unstriped_through_the_console_script(tiny_dir, tiny_plain,
                                                                     tmp_path):
    """Catches a stripe segment read from the wrong file or offset: k3-run --pack on a
    pack striped over two directories gives the logits bytes of the unstriped pack at
    the floor (one slot, every layer read every token), throttled queues included, and
    each drive's queue read its share; the stripes put back together are trunk.bin byte
    for byte (tiny's 2.9 MB trunk spans two 2 MiB stripes; a third file would be empty,
    which the layout test covers)."""
    out, dirs = _striped(tiny_dir, tmp_path, n=1)
    assert _logical_trunk(out) == (tiny_plain / TRUNK_FILE).read_bytes()
    assert any(p.stat().st_size > stripes.HEADER_BYTES for p in dirs[0].iterdir())
    runs = {}
    for name, extra in (("plain", ("--pack", tiny_plain)),
                        ("striped", ("--pack", out, "--io-throttle-mbps", "200"))):
        lo, rep = tmp_path / f"{name}.npy", tmp_path / f"{name}.json"
        p = k3(tiny_dir, "--ids", PROMPT, "--gen", 4, *_floor(tiny_dir), *extra,
               "--logits-out", lo, "--report-json", rep, "--quiet")
        assert p.returncode == 0, p.stderr
        runs[name] = np.load(lo)
        drives = json.loads(rep.read_text())["drives"]
        if name == "striped":        # a queue per drive, each reading its share
            for d in (out, *dirs, tiny_dir):
                assert drives[str(d.resolve())]["bytes_read"] > 0, (d, drives)
    assert np.array_equal(runs["plain"].view(np.uint32), runs["striped"].view(np.uint32))
    ok = k3pack_here("verify", out, "--against", tiny_dir, "--quiet")
    assert ok.returncode == 0, ok.stderr


def test_stripes_unstriped_pack_unchanged(tiny_dir, tiny_plain):
    """Catches the striped path leaking into plain packs: no stripes field, trunk.bin
    as before."""
    man = json.loads((tiny_plain / MANIFEST_FILE).read_text())
    assert "stripes" not in man and man["version"] == 2
    assert (tiny_plain / TRUNK_FILE).stat().st_size == man["trunk_bytes"]


def test_stripes_moved_directory_refused_then_found_with_stripe_dir(tiny_dir, tmp_path):
    """Catches a missing stripe drive read as zeros or a traceback: exit 3 naming the
    directory; --stripe-dir points at where it is now and the run goes through."""
    out, dirs = _striped(tiny_dir, tmp_path)
    moved = tmp_path / "elsewhere"
    shutil.move(dirs[0], moved)
    p = k3_here(tiny_dir, "--ids", "1,2", "--pack", out, "--preset", "max")
    assert p.returncode == 3 and str(dirs[0]) in p.stderr and "missing" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    p = k3_here(tiny_dir, "--ids", "1,2", "--pack", out, "--preset", "max",
                "--stripe-dir", moved)
    assert p.returncode == 0, p.stderr
    v = k3pack_here("verify", out, "--stripe-dir", moved, "--quiet")
    assert v.returncode == 0, v.stderr


def _stripe_file(d):
    (f,) = list(d.iterdir())
    return f


def test_stripes_damaged_truncated_and_foreign_stripes_refused(tiny_dir, tmp_path):
    """Catches a stripe file trusted without its identity: a damaged header, a truncated
    file and another pack's stripe in its place are each exit 3 naming the file; a
    flipped data byte fails verify naming the stripe files of the layer."""
    out, (d1,) = _striped(tiny_dir, tmp_path, name="a")
    other, (o1,) = _striped(tiny_dir, tmp_path, name="b")
    f = _stripe_file(d1)
    good = f.read_bytes()

    def refused(why):
        p = k3pack_here("verify", out, "--quiet")
        assert p.returncode == 3 and str(f) in p.stderr and why in p.stderr, p.stderr
        f.write_bytes(good)

    f.write_bytes(good[:100] + b"X" + good[101:])
    refused("header is damaged")
    f.write_bytes(good[:-4096])
    refused("truncated")
    f.write_bytes(_stripe_file(o1).read_bytes())
    refused("another pack")
    _stripe_file(d1).unlink()
    p = k3pack_here("verify", out, "--quiet")
    assert p.returncode == 3 and "missing" in p.stderr and str(f) in p.stderr
    f.write_bytes(good)
    man = json.loads((out / MANIFEST_FILE).read_text())
    lay = man["layers"][-1]                   # the last layer ends in stripe 1
    data = bytearray(good)
    data[-(man["trunk_bytes"] - lay["file_off"] - lay["nbytes"] // 2)] ^= 0x10
    f.write_bytes(bytes(data))
    p = k3pack_here("verify", out, "--quiet")
    assert p.returncode == 3 and f"layer {lay['layer']}" in p.stderr and str(f) in p.stderr
    p = k3_here(tiny_dir, "--ids", "1,2", "--pack", out, "--preset", "max")
    assert p.returncode == 3 and str(f) in p.stderr, p.stderr


def test_stripes_unmounted_drive_and_read_only_target_refused(tiny_dir, tmp_path, monkeypatch):
    """Catches packing onto the root disk when a drive is not mounted (the stripe
    directory's parent missing: exit 5 naming it, nothing created), and the OS errors of
    a read-only or full stripe disk mapped to exit 5 naming the stripe file."""
    gone = tmp_path / "not-mounted" / "stripe"
    p = k3pack_here(tiny_dir, tmp_path / "p", "--stripe", gone, "--quiet")
    assert p.returncode == 5 and str(gone) in p.stderr and not gone.parent.exists()
    lay, _ = stripes.plan_layout(tmp_path / "q", [tmp_path / "q1"], TRUNK_FILE, 3 * HUGE_PAGE,
                                 stripes.new_pack_id())
    for d in (tmp_path / "q", tmp_path / "q1"):
        d.mkdir()
    out = stripes.StripedOut(lay, direct=False)
    try:
        for code, words in ((errno.EROFS, "read-only"), (errno.ENOSPC, "disk full")):
            def fail(*a, code=code):
                raise OSError(code, os.strerror(code))
            monkeypatch.setattr(stripes.os, "pwrite", fail)
            with pytest.raises(K3IOError) as e:
                out.pwrite(bytes(2 * HUGE_PAGE), 0)
            assert e.value.exit_code == 5 and words in str(e.value)
            assert str(out.partial[0]) in str(e.value)
    finally:
        monkeypatch.undo()
        out.close()


def test_stripes_sigkill_midway_then_rerun_resumes(small_dir, tmp_path):
    """Catches a striped pack that restarts from zero or trusts a torn layer after kill
    -9: the rerun resumes the journaled layers, keeps its pack id, and the stripes hold
    the trunk an unstriped pack writes."""
    out, sd = tmp_path / "p", tmp_path / "s1"
    proc = subprocess.Popen(["k3-pack", str(small_dir), str(out), "--quiet", "--stripe",
                             str(sd), "--throttle-mbps", "20"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    journal = out / JOURNAL_FILE
    deadline = time.time() + 120
    while time.time() < deadline:
        if journal.exists() and len(journal.read_text().splitlines()) >= 4:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / MANIFEST_FILE).exists()
    head = json.loads(journal.read_text().splitlines()[0])
    done_before = len(journal.read_text().splitlines()) - 1
    assert done_before >= 3
    p = k3pack_here(small_dir, out, "--json", "--quiet", "--stripe", sd)
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["resumed"] >= done_before - 1 and info["resumed"] + info["packed"] == 13
    man = json.loads((out / MANIFEST_FILE).read_text())
    assert man["stripes"]["pack_id"] == head["stripes"]["pack_id"]
    plain = tmp_path / "plain"
    with Checkpoint.open(small_dir) as ckpt:
        pack(ckpt, plain, progress=False)
    assert _logical_trunk(out) == (plain / TRUNK_FILE).read_bytes()
    assert not list(sd.glob("*.partial")) and not list(out.glob("*.partial"))


def test_stripes_compress_keeps_the_trunk_striped(tiny_dir, tiny_plain, tmp_path):
    """Catches compress writing a striped pack's trunk.kz to one drive or losing the
    raw stripes before the switch: after compress (forced: tiny's trunk does not shrink)
    trunk.kz is striped over the same directories, the raw stripes are gone, verify
    --against passes and the logits are the plain pack's."""
    from libk3.pack.compress import compress

    out, (d1,) = _striped(tiny_dir, tmp_path)
    compress(out, progress=False, even_if_no_gain=True)
    man = json.loads((out / MANIFEST_FILE).read_text())
    assert man["version"] == 3 and man["trunk_file"] == "trunk.kz"
    assert [p.name.split(".")[1] for p in d1.iterdir()] == ["kz"]
    assert k3pack_here("verify", out, "--against", tiny_dir, "--quiet").returncode == 0
    got = []
    for pk in (tiny_plain, out):
        lo = tmp_path / f"{pk.name}.npy"
        p = k3_here(tiny_dir, "--ids", PROMPT, "--gen", 3, *_floor(tiny_dir), "--pack", pk,
                    "--logits-out", lo, "--quiet")
        assert p.returncode == 0, p.stderr
        got.append(np.load(lo))
    assert np.array_equal(got[0].view(np.uint32), got[1].view(np.uint32))


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 64).map(lambda k: k * 4096 * 97),
       count=st.integers(2, 5), off=st.integers(0, 10**6), n=st.integers(0, 10**6))
def test_stripes_layout_covers_every_byte_once(total, count, off, n):
    """Catches a layout that loses or doubles a byte: the files' shares add up to the
    trunk, and a range's segments tile it in order, each inside its file's share."""
    stripe = HUGE_PAGE
    sizes = [stripes.data_bytes(total, count, i, stripe) for i in range(count)]
    assert sum(sizes) == total
    off, n = min(off, total), min(n, total - min(off, total))
    pos = 0
    for i, at, p, k in stripes.segments(off, n, count, stripe):
        assert p == pos and 0 < k <= stripe
        assert stripes.HEADER_BYTES <= at and at + k <= stripes.HEADER_BYTES + sizes[i]
        pos += k
    assert pos == n


def test_token_bucket_caps_the_rate_with_a_fake_clock():
    """Catches a throttle that lets reads through faster than its rate, or one that
    sleeps when under it: with a fake clock, 100 reads of 1 MB at 10 MB/s after a 1 MB
    burst wait 9.9 s in all; a read after an idle second waits nothing."""
    now = [0.0]
    slept = []

    def sleep(s):
        slept.append(s)
        now[0] += s
    b = TokenBucket(10e6, burst=1e6, clock=lambda: now[0], sleep=sleep)
    for _ in range(100):
        b.take(1_000_000)
    assert sum(slept) == pytest.approx(99 * 0.1)
    assert 100e6 / now[0] == pytest.approx(10e6 * 100 / 99)
    now[0] += 1.0
    assert b.take(500_000) == 0.0
    big = b.take(5_000_000)                  # larger than the burst: waits for its debt
    assert big == pytest.approx((5_000_000 - 1_000_000 + 500_000) / 10e6)


def test_drive_queues_one_per_directory(tmp_path):
    """Catches reads of two drives sharing one queue: files in two directories get two
    queues, each with the default depth and the throttle; reads go through them."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "f").write_bytes(bytes(range(256)) * 64)
    fs = FileSet(use_direct=False, throttle_mbps=1000)
    try:
        fa, fb = fs.get(tmp_path / "a" / "f"), fs.get(tmp_path / "b" / "f")
        assert fa.queue is not fb.queue and isinstance(fa.queue, DriveQueue)
        assert fa.queue.bucket is not None and fa.queue.depth == fs.depth
        buf = np.zeros(4096 * 6, np.uint8)
        at = fb.read_window(100, 1000, buf)
        assert bytes(buf[at:at + 1000]) == (bytes(range(256)) * 64)[100:1100]
        assert fs.drive_stats()[str((tmp_path / "b").resolve())]["bytes_read"] >= 1000
    finally:
        fs.close()


def test_read_gate_holds_back_only_reads_of_the_busy_drive():
    """Catches trunk reads of one drive waiting for expert reads of another (the two
    would then never overlap): an urgent read on drive a blocks a's read-ahead and a
    read-ahead that does not say its drive, never b's; two directories of one device
    are one drive to the gate."""
    gate = ReadGate()
    assert not gate._blocked(None)
    with gate.urgent(("a",)):
        assert gate._blocked(("a",)) and gate._blocked(None) and gate._blocked(("b", "a"))
        assert not gate._blocked(("b",))
        with gate.urgent():
            assert gate._blocked(("b",))        # an urgent read of no known drive: all wait
        assert not gate._blocked(("b",))
    assert not gate._blocked(("a",)) and not gate._blocked(None)
    fs = FileSet(use_direct=False)
    try:
        q1, q2 = fs.queue_for(__file__), fs.queue_for(ReadGate.__init__.__code__.co_filename)
        assert q1 is not q2 and q1.device == q2.device is not None
    finally:
        fs.close()


def test_stripes_prefix_cache_resumes_on_a_striped_pack(tiny_dir, tiny_plain, tmp_path):
    """Catches the prefix cache missing a striped pack (its identity, its default
    folder): a saved prompt is resumed by a longer one; --stripe-dir on an unstriped
    pack is a usage error (exit 2)."""
    out, _ = _striped(tiny_dir, tmp_path)
    base = ("--gen", 1, "--preset", "max", "--pack", out, "--prefix-cache", "auto")
    p = k3_here(tiny_dir, "--ids", PROMPT, *base, "--save-prefix")
    assert p.returncode == 0, p.stderr
    rep = tmp_path / "r.json"
    p = k3_here(tiny_dir, "--ids", PROMPT + ",9,10", *base, "--report-json", rep)
    assert p.returncode == 0, p.stderr
    assert json.loads(rep.read_text())["reused_tokens"] == len(PROMPT.split(","))
    p = k3_here(tiny_dir, "--ids", "1", "--preset", "max", "--pack", tiny_plain,
                "--stripe-dir", tmp_path)
    assert p.returncode == 2 and "not" in p.stderr, p.stderr


@pytest.mark.parametrize("field, change", [
    ("stripes.pack_id", lambda s: s.update(pack_id="XYZ")),
    ("stripes.stripe_bytes", lambda s: s.update(stripe_bytes=HUGE_PAGE + 4096)),
    ("stripes.header_bytes", lambda s: s.update(header_bytes=512)),
    ("stripes.files", lambda s: s.update(files=s["files"][:1])),
    ("stripes.files[0].dir", lambda s: s["files"][0].update(dir="elsewhere")),
    ("stripes.files[1].name", lambda s: s["files"][1].update(name="trunk.bin.0.1")),
    ("stripes.files[1].data_bytes", lambda s: s["files"][1].update(data_bytes=4096)),
    ("stripes", lambda s: s.update(extra=1)),
])
def test_stripes_manifest_field_refused_naming_it(tiny_dir, tmp_path, field, change):
    """Catches a stripes field that turns into a wrong offset or file: each bad value is
    exit 3 from verify naming trunk.json and the field, before any trunk byte is read."""
    out, _ = _striped(tiny_dir, tmp_path)
    man = json.loads((out / MANIFEST_FILE).read_text())
    change(man["stripes"])
    (out / MANIFEST_FILE).write_text(json.dumps(man))
    p = k3pack_here("verify", out, "--quiet")
    assert p.returncode == 3 and "trunk.json" in p.stderr and field in p.stderr, p.stderr
