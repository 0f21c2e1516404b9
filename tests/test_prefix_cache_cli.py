"""`k3-pack cache ls|verify|rm DIR` (formats/prefix-cache.md, "Managing the folder"):
listing a prefix cache folder most recently used first, checking every snapshot without
the model, and removing snapshots by age, by budget, by name or all; never a file that
is not a snapshot. Run in-process (click's CliRunner) except one real console script."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import traceback
from datetime import datetime

import pytest
from click.testing import CliRunner

from k3_pack.cli import main as k3pack_main
from libk3.engine.generate import prefill
from libk3.engine.prefix_cache import PrefixCache, list_entries
from libk3.engine.session import open_session
from libk3.units import size_text

from .scripts import k3pack

PROMPT = [5, 17, 300, 42, 7, 99, 128, 3, 250, 11, 64, 200, 9, 31, 8, 77, 41, 2, 19, 23]
LENGTHS = (3, 5, 20)
NOW = int(time.time())
# Last uses set on each copy: 5 tokens newest, then 3, then 20 (neither name nor size
# order, so a listing sorted by either is caught).
AGES = {3: 2000, 5: 1000, 20: 3000}
OTHER = ("notes.txt", "0000003-abc.k3state.bak")       # files that are not snapshots


@pytest.fixture(scope="module")
def session(tiny_dir):
    return open_session(tiny_dir)


@pytest.fixture(scope="module")
def template(session, tmp_path_factory):
    """A folder with snapshots of PROMPT's first 3, 5 and 20 ids, written by the cache."""
    d = tmp_path_factory.mktemp("template")
    cache = PrefixCache(d, 10 ** 9, session.cfg, session.weights_identity, "shards")
    for n in LENGTHS:
        st = session.new_state()
        prefill(session.forward, st, PROMPT[:n], 16, keep_logits=False)
        assert cache.store(st) is not None
    return d


@pytest.fixture
def folder(template, tmp_path):
    """A fresh copy of the template, last uses set by AGES, with two files that are not
    snapshots; -> (directory, {tokens: path})."""
    d = tmp_path / "pc"
    shutil.copytree(template, d)
    paths = {e.tokens: e.path for e in list_entries(d)}
    assert sorted(paths) == list(LENGTHS)
    for n, age in AGES.items():
        os.utime(paths[n], (NOW - age, NOW - age))
    for name in OTHER:
        (d / name).write_text("keep me")
    return d, paths


def _run(*args) -> subprocess.CompletedProcess:
    """k3-pack ARGS in this process; a traceback fails the test."""
    argv = [str(a) for a in args]
    res = CliRunner().invoke(k3pack_main, argv)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        pytest.fail("traceback:\n" + "".join(traceback.format_exception(res.exception)))
    return subprocess.CompletedProcess(["k3-pack", *argv], res.exit_code, res.stdout,
                                       res.stderr)


def _left(d) -> set:
    return set(os.listdir(d))


def _assert_others_kept(d):
    for name in OTHER:
        assert (d / name).read_text() == "keep me"


def _usage_error(res):
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


# ---- ls -------------------------------------------------------------------------------

def test_ls_lists_most_recent_first_with_weights_time_and_totals(folder, session):
    """Catches a listing in name, size or oldest-first order, a wrong last-use time or
    size, a weights column that is not the header's identity, files that are not
    snapshots listed, or a total that misses one."""
    d, paths = folder
    res = _run("cache", "ls", d)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 4
    for line, n in zip(lines, (5, 3, 20)):
        p = paths[n]
        used = datetime.fromtimestamp(NOW - AGES[n]).isoformat(timespec="seconds")
        assert line.split()[0] == p.name
        assert f" {n} tokens" in line and size_text(p.stat().st_size) in line
        assert used in line and line.endswith(session.weights_identity[:12])
    total = sum(p.stat().st_size for p in paths.values())
    assert lines[-1] == f"3 snapshots, {size_text(total)}"


def test_ls_json_holds_every_field(folder, session):
    """Catches --json rows out of order, a last use other than the mtime, a weights
    identity cut short, a missing fingerprint or a wrong byte total."""
    d, paths = folder
    res = _run("cache", "ls", d, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["directory"] == str(d)
    assert [r["name"] for r in doc["snapshots"]] == [paths[n].name for n in (5, 3, 20)]
    for r in doc["snapshots"]:
        assert r["weights"] == session.weights_identity
        assert r["fingerprint"] == session.cfg.fingerprint()
        assert r["last_used"] == NOW - AGES[r["tokens"]]
        assert r["bytes"] == (d / r["name"]).stat().st_size
    assert doc["bytes"] == sum(p.stat().st_size for p in paths.values())


def test_ls_says_unreadable_and_goes_on(folder):
    """Catches one snapshot whose header cannot be read ending the listing (a
    traceback or an error exit) or being shown with a made-up identity."""
    d, paths = folder
    bad = d / ("0000009-" + "e" * 40 + ".k3state")
    bad.write_bytes(b"not a state file at all")
    os.utime(bad, (NOW, NOW))                       # newest: listed first
    res = _run("cache", "ls", d)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith(bad.name) and lines[0].endswith("unreadable")
    assert len(lines) == 5 and lines[-1].startswith("4 snapshots")
    doc = json.loads(_run("cache", "ls", d, "--json").stdout)
    assert doc["snapshots"][0]["weights"] is None and doc["snapshots"][0]["tokens"] == 9
    assert doc["snapshots"][1]["weights"] is not None                       # control


def test_ls_empty_missing_or_file(tmp_path):
    """Catches an empty folder printing nothing (or a bare total), and a missing folder
    or a file given as DIR passing as empty instead of a one-line usage error."""
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "notes.txt").write_text("x")
    res = _run("cache", "ls", tmp_path / "e")
    assert res.returncode == 0 and res.stdout.strip() == f"no snapshots in {tmp_path / 'e'}"
    for bad in (tmp_path / "missing", tmp_path / "e" / "notes.txt"):
        res = _run("cache", "ls", bad)
        _usage_error(res)
        assert str(bad) in res.stderr


def test_ls_through_the_installed_console_script(folder):
    """Catches the `cache` group missing from the installed k3-pack (entry point,
    DefaultGroup taking `cache` for a checkpoint path)."""
    d, paths = folder
    res = k3pack("cache", "ls", d)
    assert res.returncode == 0, res.stderr
    assert [line.split()[0] for line in res.stdout.splitlines()[:3]] == \
        [paths[n].name for n in (5, 3, 20)]


# ---- verify ---------------------------------------------------------------------------

def _rewrite_header(path, change):
    """Rewrite a state file's JSON header with ``change(meta)`` and a valid checksum:
    damage only a check beyond the checksum can see."""
    data = path.read_bytes()
    magic, version, hlen = struct.unpack_from("<8sII", data)
    meta = json.loads(data[16:16 + hlen])
    change(meta)
    head = json.dumps(meta).encode()
    body = struct.pack("<8sII", magic, version, len(head)) + head + data[16 + hlen:-32]
    path.write_bytes(body + hashlib.sha256(body).digest())


def _damage(d, paths) -> set:
    """Four bad snapshots beside the three good ones: -> their names."""
    src = paths[20].read_bytes()
    truncated = d / ("0000020-" + "1" * 40 + ".k3state")
    truncated.write_bytes(src[:-1000])
    flipped = d / ("0000020-" + "2" * 40 + ".k3state")
    data = bytearray(src)
    data[len(data) - 32 - 100] ^= 0x01               # one bit of the last array
    flipped.write_bytes(bytes(data))
    misnamed = d / ("0000006-" + paths[5].name[8:])  # a 5-token snapshot named as 6
    misnamed.write_bytes(paths[5].read_bytes())
    short_ids = d / ("0000005-" + "3" * 40 + ".k3state")
    short_ids.write_bytes(paths[5].read_bytes())
    _rewrite_header(short_ids, lambda m: m["ids"].pop())
    return {p.name for p in (truncated, flipped, misnamed, short_ids)}


def test_verify_passes_a_sound_folder(folder):
    """Catches verify refusing good snapshots (a check too strict, a file that is not a
    snapshot counted), or a non-zero exit on a sound folder."""
    d, _ = folder
    res = _run("cache", "verify", d, "--quiet")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "3 snapshots checked, 0 bad"
    assert json.loads(_run("cache", "verify", d, "--json").stdout) == {
        "directory": str(d), "checked": 3, "bad": [], "removed": [], "failed": []}


def test_verify_finds_truncated_flipped_misnamed_and_short_ids_exit_3(folder):
    """Catches a checksum not read (the flipped bit), a truncated file passing, a name
    whose token count disagrees with its header, a header whose ids are not pos long
    (valid checksum), a silent or zero exit, or a bad snapshot removed without
    --remove-bad."""
    d, paths = folder
    bad = _damage(d, paths)
    before = _left(d)
    res = _run("cache", "verify", d, "--quiet")
    assert res.returncode == 3
    lines = res.stdout.splitlines()
    assert lines[-1] == "7 snapshots checked, 4 bad"
    assert {next(n for n in bad if n in line) for line in lines[:-1]} == bad
    assert len(lines) == 5 and all(str(d) in line for line in lines[:-1])
    assert len(res.stderr.strip().splitlines()) == 1 and "--remove-bad" in res.stderr
    assert _left(d) == before
    doc = json.loads(_run("cache", "verify", d, "--json").stdout)
    assert doc["checked"] == 7 and {b["name"] for b in doc["bad"]} == bad
    assert all(b["error"] for b in doc["bad"]) and doc["removed"] == []


def test_verify_remove_bad_removes_exactly_the_bad_ones(folder):
    """Catches --remove-bad removing a good snapshot or a file that is not a snapshot,
    leaving a bad one, or still exiting 3 once every bad one is gone."""
    d, paths = folder
    bad = _damage(d, paths)
    before = _left(d)
    res = _run("cache", "verify", d, "--remove-bad", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert set(doc["removed"]) == bad and {b["name"] for b in doc["bad"]} == bad
    assert _left(d) == before - bad
    _assert_others_kept(d)
    again = _run("cache", "verify", d)
    assert again.returncode == 0 and again.stdout.strip() == "3 snapshots checked, 0 bad"


# ---- rm -------------------------------------------------------------------------------

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_rm_all_removes_snapshots_and_stale_temporaries_only(folder):
    """Catches --all leaving a snapshot or a stale temporary, or removing a file that is
    not a snapshot, or a temporary that is recent (a write in flight)."""
    d, paths = folder
    stale = d / f".{paths[3].name}.{_dead_pid()}.tmp"
    stale.write_bytes(b"half")
    os.utime(stale, (NOW - 7200, NOW - 7200))
    fresh = d / f".{paths[5].name}.{_dead_pid()}.tmp"
    fresh.write_bytes(b"half")
    freed = sum(p.stat().st_size for p in paths.values())
    res = _run("cache", "rm", d, "--all")
    assert res.returncode == 0, res.stderr
    assert _left(d) == set(OTHER) | {fresh.name}
    _assert_others_kept(d)
    assert f"removed 3 snapshots, {size_text(freed)} freed" in res.stdout
    assert "1 stale temporary" in res.stdout
    assert sum(line.startswith("removed 0") for line in res.stdout.splitlines()) == 3


def test_rm_older_than_removes_only_those_unused_that_long(folder):
    """Catches --older-than counting from the wrong end (removing the recent ones), in
    the wrong unit (seconds or hours for days), or removing nothing."""
    d, paths = folder
    for n, days in ((3, 10), (5, 3), (20, 0)):
        t = NOW - days * 86400 - 60
        os.utime(paths[n], (t, t))
    res = _run("cache", "rm", d, "--older-than", 5, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert [r["name"] for r in doc["removed"]] == [paths[3].name]
    assert doc["bytes"] == doc["removed"][0]["bytes"] > 0
    assert _run("cache", "rm", d, "--older-than", 2.5).returncode == 0
    assert _left(d) == set(OTHER) | {paths[20].name}


def test_rm_keep_gb_removes_least_recently_used_until_within(folder):
    """Catches --keep-gb removing the newest first, stopping above the size asked,
    removing one too many at exactly the size, or reading G as other than 1e9 bytes."""
    d, paths = folder
    size = {n: p.stat().st_size for n, p in paths.items()}
    # LRU order: 20 (oldest), 3, 5. Keeping exactly 3 + 5 removes only 20.
    keep = size[3] + size[5]
    res = _run("cache", "rm", d, "--keep-gb", f"{keep / 1e9:.9f}")
    assert res.returncode == 0, res.stderr
    assert _left(d) == set(OTHER) | {paths[3].name, paths[5].name}
    res = _run("cache", "rm", d, "--keep-gb", f"{(keep - 1) / 1e9:.9f}", "--json")
    assert [r["name"] for r in json.loads(res.stdout)["removed"]] == [paths[3].name]
    assert _left(d) == set(OTHER) | {paths[5].name}
    _assert_others_kept(d)


def test_rm_by_name_and_an_unknown_name_removes_nothing(folder):
    """Catches a name that is not a snapshot in DIR (absent, or a file that is not a
    snapshot) being skipped or removed, the valid names beside it removed before the
    refusal, or named removal taking other snapshots."""
    d, paths = folder
    before = _left(d)
    absent = "0000004-" + "f" * 40 + ".k3state"
    for wrong in (absent, "notes.txt", "../pc/" + paths[3].name):
        res = _run("cache", "rm", d, paths[3].name, wrong)
        _usage_error(res)
        assert wrong in res.stderr
        assert _left(d) == before
    res = _run("cache", "rm", d, paths[3].name, paths[20].name)
    assert res.returncode == 0, res.stderr
    assert _left(d) == before - {paths[3].name, paths[20].name}
    assert "removed 2 snapshots" in res.stdout


@pytest.mark.parametrize("args", [[], ["--all", "--older-than", "1"],
                                  ["--keep-gb", "1", "NAME"], ["--all", "NAME"]])
def test_rm_needs_exactly_one_selector(folder, args):
    """Catches rm with no selector removing everything (or nothing, silently), or two
    selectors where one wins, instead of a one-line usage error before any removal."""
    d, paths = folder
    before = _left(d)
    args = [paths[3].name if a == "NAME" else a for a in args]
    res = _run("cache", "rm", d, *args)
    _usage_error(res)
    assert "exactly one" in res.stderr
    assert _left(d) == before
