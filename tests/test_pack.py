"""k3-pack: page-aligned trunk, expert index, resume after SIGKILL, verify, bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from libk3 import names
from libk3.io.checkpoint import Checkpoint
import libk3.pack.writer as pack_mod
from libk3.pack.writer import (ALIGN, JOURNAL_FILE, MANIFEST_FILE, PARTIAL_FILE, TRUNK_FILE,
                               load_expert_index, load_manifest, pack, verify)

from .scripts import k3pack, k3pack_here


@pytest.fixture(scope="module")
def small_packed(small_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("p") / "small.pack"
    with Checkpoint.open(small_dir) as ckpt:
        pack(ckpt, out, progress=False)
    return out


@pytest.mark.parametrize("which", ["tiny", "small"])
def test_pack_trunk_tensors_byte_identical_and_aligned(which, tiny_dir, small_dir,
                                                       small_packed, tmp_path):
    """Catches a packer that converts, reorders or misplaces bytes, or misaligns a layer."""
    src = tiny_dir if which == "tiny" else small_dir
    out = small_packed if which == "small" else tmp_path / "tiny.pack"
    with Checkpoint.open(src) as ckpt:
        if which == "tiny":
            pack(ckpt, out, progress=False)
        man = load_manifest(out)
        trunk = (out / TRUNK_FILE).read_bytes()
        for lay in man["layers"]:
            assert lay["file_off"] % ALIGN == 0 and lay["padded"] % ALIGN == 0
            for sfx, t in lay["tensors"].items():
                name = names.layer(lay["layer"], sfx)
                want = ckpt.read_raw(name).tobytes()
                got = trunk[lay["file_off"] + t["off"]: lay["file_off"] + t["off"] + t["nbytes"]]
                assert got == want, name
                assert t["dtype"] == ckpt.entry(name).dtype
        head, rec = load_expert_index(out)
        assert rec.size == len(ckpt.config.moe_layers) * ckpt.config.num_experts
        for r in rec:
            run = ckpt.expert_run(int(r["layer"]), int(r["expert"]))
            assert (r["offset"], r["nbytes"]) == (run.offset, run.nbytes)
            assert head["shards"][r["shard"]] == os.path.basename(run.path)
            assert r["sub"].tolist() == [run.parts[k][0] for k in names.EXPERT_PARTS]
        for name, info in man["model_level"].items():
            assert info["offset"] == ckpt.entry(name).offset           # indexed, not copied
    assert not (out / PARTIAL_FILE).exists() and not (out / JOURNAL_FILE).exists()


@pytest.mark.parametrize("block", [4096, 3 * 4096])
def test_pack_many_pieces_per_layer_in_flight_give_the_same_bytes(block, small_dir, small_packed,
                                                                  tmp_path, monkeypatch):
    """Catches piece reordering between the parallel readers and writers, a payload not
    moved to the buffer's start (unaligned source offsets), a wrong last-piece padding or
    a layer journaled before all its writes: with tiny pieces every layer is split into
    many, and trunk.bin must equal the one packed in 16 MiB pieces, byte for byte."""
    monkeypatch.setattr(pack_mod, "COPY_BLOCK", block)
    out = tmp_path / "pieces.pack"
    with Checkpoint.open(small_dir) as ckpt:
        assert any(ckpt.layer_trunk_run(L).offset % ALIGN for L in range(ckpt.config.num_hidden_layers))
        assert max(ckpt.layer_trunk_run(L).nbytes for L in range(ckpt.config.num_hidden_layers)) > 8 * block
        pack(ckpt, out, progress=False)
    assert (out / TRUNK_FILE).read_bytes() == (small_packed / TRUNK_FILE).read_bytes()
    with Checkpoint.open(small_dir) as ckpt:
        assert verify(out, ckpt, progress=False)["layers"] == ckpt.config.num_hidden_layers


def test_pack_rerun_never_rewrites_a_finished_pack(tiny_dir, tmp_path):
    """Catches a rerun that rewrites (or touches) a complete pack."""
    out = tmp_path / "p"
    p = k3pack(tiny_dir, out, "--quiet")
    assert p.returncode == 0, p.stderr
    before = {f: (out / f).stat().st_mtime_ns for f in os.listdir(out)}
    p = k3pack_here(tiny_dir, out, "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["already_complete"] is True
    assert before == {f: (out / f).stat().st_mtime_ns for f in os.listdir(out)}


def test_pack_sigkill_midway_then_rerun_resumes(small_dir, small_packed, tmp_path):
    """Catches a pack that restarts from zero, trusts a torn layer, or leaves a partial
    directory looking complete after kill -9."""
    out = tmp_path / "p"
    proc = subprocess.Popen(["k3-pack", str(small_dir), str(out), "--quiet",
                             "--throttle-mbps", "20"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    journal = out / JOURNAL_FILE
    deadline = time.time() + 120
    while time.time() < deadline:
        if journal.exists() and len(journal.read_text().splitlines()) >= 4:   # header + 3
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / MANIFEST_FILE).exists() and not (out / TRUNK_FILE).exists()
    done_before = len(journal.read_text().splitlines()) - 1
    assert 3 <= done_before < 13
    p = k3pack_here(small_dir, out, "--json", "--quiet")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["resumed"] >= done_before - 1 and info["packed"] <= 13 - done_before + 1
    assert info["resumed"] + info["packed"] == 13
    assert (out / TRUNK_FILE).read_bytes() == (small_packed / TRUNK_FILE).read_bytes()
    assert json.loads((out / MANIFEST_FILE).read_text()) == json.loads(
        (small_packed / MANIFEST_FILE).read_text())


def test_pack_verify_catches_a_flipped_byte(tiny_dir, tmp_path):
    """Catches a verify that checks sizes only; control: the intact pack verifies."""
    out = tmp_path / "p"
    assert k3pack_here(tiny_dir, out, "--quiet").returncode == 0
    ok = k3pack_here("verify", out, "--against", tiny_dir, "--quiet")
    assert ok.returncode == 0, ok.stderr
    man = json.loads((out / MANIFEST_FILE).read_text())
    lay = man["layers"][5]
    with open(out / TRUNK_FILE, "r+b") as f:
        f.seek(lay["file_off"] + lay["nbytes"] // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    bad = k3pack_here("verify", out, "--quiet")
    assert bad.returncode == 3 and "layer 5" in bad.stderr and "checksum" in bad.stderr


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_pack_bad_inputs_each_refused_without_complete_looking_output(tiny_dir, tmp_path):
    """Catches each bad input producing a traceback, exit 0, or a trunk.json."""
    # control
    ok = k3pack_here(_copy(tiny_dir, tmp_path / "ok"), tmp_path / "ok.pack", "--quiet")
    assert ok.returncode == 0
    shards = sorted(p.name for p in tiny_dir.glob("*.safetensors"))
    cases = {}
    d = _copy(tiny_dir, tmp_path / "missing")
    (d / shards[3]).unlink()
    cases["missing"] = (d, "missing")
    d = _copy(tiny_dir, tmp_path / "trunc")
    with open(d / shards[4], "r+b") as f:
        f.truncate((d / shards[4]).stat().st_size - 100)
    cases["trunc"] = (d, "truncated")
    d = _copy(tiny_dir, tmp_path / "lacks")
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    victim = names.layer(2, "self_attn.dt_bias")
    _rewrite_without(d / idx["weight_map"][victim], victim)
    del idx["weight_map"][victim]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    cases["lacks"] = (d, "dt_bias")
    for key, (src, needle) in cases.items():
        out = tmp_path / f"{key}.pack"
        p = k3pack_here(src, out, "--quiet")
        assert p.returncode == 3, (key, p.stderr)
        assert needle in p.stderr, (key, p.stderr)
        assert "Traceback" not in p.stderr
        assert not (out / MANIFEST_FILE).exists()


def _rewrite_without(shard, victim):
    """Rewrite a shard without one tensor (header and data), keeping the rest."""
    from libk3.io.safetensors import read_header, write_shard
    ents = read_header(shard)
    blob = shard.read_bytes()
    tensors = [(e.name, e.dtype, e.shape, blob[e.offset:e.offset + e.nbytes])
               for e in ents if e.name != victim]
    write_shard(shard, tensors)


def test_pack_read_only_destination_refused(tiny_dir, tmp_path):
    """Catches a traceback when the destination cannot be written."""
    if os.geteuid() == 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        # root ignores permission bits; a path under a regular file cannot be created
        blocker = tmp_path / "file"
        blocker.write_text("x")
        p = k3pack(tiny_dir, blocker / "pack", "--quiet")
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        p = k3pack(tiny_dir, ro / "pack", "--quiet")
    assert p.returncode == 5 and "Traceback" not in p.stderr


def test_pack_refuses_up_front_when_disk_is_too_small(tiny_dir, tmp_path, monkeypatch):
    """Catches a packer that discovers a full disk halfway."""
    import shutil as sh
    from libk3.pack import writer as packmod
    from libk3.errors import BudgetError
    real = sh.disk_usage
    monkeypatch.setattr(packmod.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1000))
    with Checkpoint.open(tiny_dir) as ckpt, pytest.raises(BudgetError, match="free disk"):
        pack(ckpt, tmp_path / "p", progress=False)
    assert not (tmp_path / "p" / MANIFEST_FILE).exists()


def test_pack_dry_run_writes_nothing(tiny_dir, tmp_path):
    """Catches a dry run that creates files."""
    p = k3pack_here(tiny_dir, tmp_path / "p", "--dry-run", "--json")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["layers"] == 13 and info["trunk_bytes"] % ALIGN == 0 and info["state"] == "missing"
    assert not (tmp_path / "p").exists()


def test_pack_streams_same_logits_as_shards(tiny_dir, tmp_path):
    """Catches a pack whose tensor table binds the wrong bytes at run time."""
    out = tmp_path / "p"
    with Checkpoint.open(tiny_dir) as ckpt:
        pack(ckpt, out, progress=False)
    from libk3.engine.session import open_session
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    a = open_session(tiny_dir)
    b = open_session(tiny_dir, pack=out, trunk_bytes=10**9, cache_bytes=10**9)
    la, lb = a.forward(ids, a.new_state()), b.forward(ids, b.new_state())
    assert np.array_equal(la.view(np.uint32), lb.view(np.uint32))


def test_pack_reports_mb_per_s_against_the_source_disk_read(small_dir, tmp_path):
    """Catches a summary without the source disk's read rate when asked for it, a probe
    that runs when refused, and a rate that is not the pack's MB/s over the probe's."""
    from libk3.machine.storage import o_direct_check
    shard = sorted(small_dir.glob("*.safetensors"))[-1]
    direct = o_direct_check(shard)[0]
    p = k3pack_here(small_dir, tmp_path / "a", "--source-probe", "--json", "--quiet")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    if direct:
        assert info["source_seq_read_mb_per_s"] > 0
        assert info["of_source_read"] == pytest.approx(
            info["mb_per_s"] / info["source_seq_read_mb_per_s"], rel=0.01)
    else:
        assert info["source_seq_read_mb_per_s"] is None
    for flag in ("--no-source-probe", None):          # refused, or too small to be worth it
        out = tmp_path / f"b{flag}"
        p = k3pack_here(small_dir, out, *([flag] if flag else []), "--json", "--quiet")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["source_seq_read_mb_per_s"] is None
