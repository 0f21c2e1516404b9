"""The damaged-pack properties of test_pack_integrity, on a compressed (v3) pack: any change
to trunk.json, any flipped bit of trunk.kz or trunk.blocks is refused by k3-run and
k3-pack verify alike in one line (exit 3), or, where the flip lands in bytes nothing
reads, accepted by both with the control's output (formats/pack.md v3)."""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import pytest

from k3_run.cli import main as k3run_main
from libk3.io.checkpoint import Checkpoint
from libk3.pack.writer import pack
from libk3.pack.compress import compress
from libk3.pack.schema import BLOCK_INDEX_FILE, COMPRESSED_TRUNK_FILE, open_pack

from .conftest import TINY
from .pack_mutations import MANIFEST
from .test_pack_integrity import (IDS, _assert_refused, _both, _canon, _flip_bit, _mutate,
                                  _nodes, _work_copy, budget_args)  # noqa: F401  (fixture)

HEALTH = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@pytest.fixture(scope="module")
def tiny_kz(tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity-v3") / "tiny.pack"
    with Checkpoint.open(TINY) as ckpt:
        pack(ckpt, out, progress=False)
    compress(out, progress=False)
    assert open_pack(out).compressed
    return out


@pytest.fixture(scope="module")
def control_out(tiny_kz, budget_args):
    """stdout of k3-run on the undamaged compressed pack."""
    res = CliRunner().invoke(k3run_main, [str(TINY), "--pack", str(tiny_kz), "--ids", IDS,
                                          "--gen", "1", *budget_args])
    assert res.exit_code == 0, res.stderr
    return res.stdout


def test_v3_control_is_accepted_by_both(tiny_kz, budget_args):
    """The control of every case below: the undamaged compressed pack passes both."""
    assert [c for c, _ in _both(tiny_kz, TINY, budget_args).values()] == [0, 0]


@settings(max_examples=30, deadline=None, suppress_health_check=HEALTH)
@given(data=st.data())
def test_v3_manifest_random_mutation_refused_by_both(tiny_kz, budget_args, data):
    """Catches a v3 trunk.json change (the codec block included) that either tool
    accepts, crashes on, or reports in more than one line or without naming the file."""
    doc = json.loads((tiny_kz / MANIFEST).read_text())
    path = data.draw(st.sampled_from(list(_nodes(doc))[1:]), label="path")
    op = data.draw(st.sampled_from(["replace", "delete", "add_key"]), label="op")
    _mutate(doc, path, op, data)
    assume(_canon(doc) != _canon(json.loads((tiny_kz / MANIFEST).read_text())))
    # a valid CRC or shard digest that the bytes then fail is reported against the data
    assume(not (path[0] == "layers" and path[-1] == "crc32"))
    assume(path[:2] != ("source", "shards"))
    d = _work_copy(tiny_kz)
    try:
        (d / MANIFEST).write_text(json.dumps(doc))
        _assert_refused(_both(d, TINY, budget_args), MANIFEST)
    finally:
        shutil.rmtree(d.parent)


@pytest.mark.parametrize("name", [COMPRESSED_TRUNK_FILE, BLOCK_INDEX_FILE])
@settings(max_examples=12, deadline=None, suppress_health_check=HEALTH)
@given(data=st.data())
def test_v3_any_bit_flip_refused_by_both_or_harmless(name, tiny_kz, budget_args, control_out,
                                                     data):
    """Catches a flipped bit of the compressed trunk or its block index that k3-run
    decodes into wrong weights, crashes on, or that only one tool refuses: both refuse
    (exit 3, one line), or both accept and the run prints the control's output."""
    size = (tiny_kz / name).stat().st_size
    bit = data.draw(st.integers(0, size * 8 - 1), label="bit")
    d = _work_copy(tiny_kz)
    try:
        _flip_bit(d / name, bit)
        out = _both(d, TINY, budget_args)
        codes = sorted(c for c, _ in out.values())
        if codes == [0, 0]:
            res = CliRunner().invoke(k3run_main, [str(TINY), "--pack", str(d), "--ids", IDS,
                                                  "--gen", "1", *budget_args])
            assert res.stdout == control_out
        else:
            lines = [e.strip().splitlines() for _, e in out.values()]
            assert codes == [3, 3] and all(len(x) == 1 for x in lines), out
            assert all(name in x[0] or "layer" in x[0] for x in lines), out
    finally:
        shutil.rmtree(d.parent)
