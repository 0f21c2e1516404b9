"""k3-doctor with several drives: the shared-device warning, the s/token of a trunk
striped over several drives, and the placement and --stripe command it recommends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libk3.doctor import advice, drives
from libk3.doctor import report as doctor
from libk3.machine import memory as hwmem

from .scripts import tool

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
EST = {"trunk_streamed_bytes": 8e9, "expert_misses": 100.0, "compute_s": 0.5,
       "expert_io_s": 1.0}


def test_doctor_warns_when_two_stripe_directories_share_a_device(tmp_path):
    """Catches a stripe over two directories of one disk passing silently: the tmp
    directories share st_dev, so k3-doctor --stripe warns naming both, in the JSON and
    through the console script; control: with distinct devices (faked) no warning."""
    pack, s1 = tmp_path / "pack", tmp_path / "s1"
    diag = doctor.diagnose(FIXTURE, pack, quick=True, memory=hwmem.assumed_memory(8 * 10**9),
                           stripes=[s1])
    hits = [w for w in diag.report["warnings"] if "one device" in w]
    assert len(hits) == 1 and str(pack) in hits[0] and str(s1) in hits[0]
    p = tool("k3-doctor", FIXTURE, "--pack", pack, "--stripe", s1, "--quick", "--json",
             "--assume-memory-gb", "8")
    assert p.returncode == 0, p.stderr
    assert any("one device" in w for w in json.loads(p.stdout)["warnings"])
    fake = iter(range(10**6))
    assert drives.shared_device_warnings([pack, s1]) != []
    orig = drives.device
    try:
        drives.device = lambda d: next(fake)
        assert drives.shared_device_warnings([pack, s1]) == []
    finally:
        drives.device = orig


def test_placement_estimate_is_the_busiest_drives_reads_plus_compute():
    """Catches an estimate that still sums every drive's reads, or ignores the experts'
    drive: one drive holding both is the single-drive sum; the trunk over two other
    drives takes half the trunk time there while the experts' drive reads alone."""
    one = advice.placement_estimate(EST, {1: 1e9}, (1, 1e9), 10**7)
    assert one["seconds_per_token"] == pytest.approx(8.0 + 1.0 + 0.5)
    two = advice.placement_estimate(EST, {2: 1e9, 3: 1e9}, (1, 1e9), 10**7)
    assert two["io_s"] == pytest.approx(4.0) and two["seconds_per_token"] == pytest.approx(4.5)
    shared = advice.placement_estimate(EST, {1: 1e9, 2: 1e9}, (1, 1e9), 10**7)
    assert shared["io_s"] == pytest.approx(5.0)


def test_placement_picks_the_fastest_and_gives_the_stripe_command(tmp_path, monkeypatch):
    """Catches a recommendation that ignores the measurements: with the model on drive 1
    and two more equal drives, the trunk goes over drives 2 and 3 (not onto the experts'
    drive), and the k3-pack command carries --stripe for the second."""
    dirs = {tmp_path / n: i for i, n in enumerate(("model", "pack", "s1", "s2"), 1)}
    monkeypatch.setattr(drives, "device", lambda d: dirs[Path(d)])
    stores = [{"device": i, "reads": {"seq_best_bps": 1e9, "rand_best_bps": 1e9}}
              for i in dirs.values()]
    pl = drives.placement(stores, EST, 10**7, tmp_path / "model", tmp_path / "pack",
                          [tmp_path / "s1"])
    assert pl["pick"]["trunk_dirs"] == [str(tmp_path / "pack"), str(tmp_path / "s1")]
    assert pl["stripe_args"] == [str(tmp_path / "s1")]
    assert pl["pick"]["seconds_per_token"] == pytest.approx(4.5)
    slow = [dict(s) for s in stores]
    slow[2] = {"device": 3, "reads": {"seq_best_bps": 1e8, "rand_best_bps": 1e8}}
    pl = drives.placement(slow, EST, 10**7, tmp_path / "model", tmp_path / "pack",
                          [tmp_path / "s1"])
    assert pl["pick"]["trunk_dirs"] == [str(tmp_path / "pack")]       # a slow drive: not used
    nxt = doctor._next_steps(FIXTURE, tmp_path / "pack", tmp_path / "pack",
                             {"pack": {"state": "missing"}},
                             {"pick": "laptop", "placement": {
                                 "pack_dir": str(tmp_path / "pack"),
                                 "stripe_args": [str(tmp_path / "s1")]}}, [])
    assert f"--stripe {tmp_path / 's1'}" in nxt["commands"][0]
