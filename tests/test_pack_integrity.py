"""Nothing silently wrong with packs: the schema gate shared by k3-run and k3-pack verify,
the per-layer CRC on first read, the sampled-content identity, NaN/Inf in trunk tensors
and in layer outputs; the damage properties hold for a raw pack (formats/pack.md v2) and
a compressed one (v3: trunk.kz and its block index).

What these tests deliberately do not catch: a checkpoint that differs from the packed one
only outside the sampled blocks of its shards and outside the trunk runs (k3-run samples,
it does not hash 1.56 TB; ``verify --against`` compares every trunk byte), and with
``--verify-reads first`` a trunk.bin changed while a run is going, after the layer's first
pass (``every`` catches it; tested below).
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import tempfile
import traceback
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from k3_pack.cli import main as k3pack_main
from k3_run.cli import main as k3run_main
from libk3 import names
from libk3.engine.session import Reads, open_session
from libk3.errors import FormatError, NonFiniteError
from libk3.io.checkpoint import Checkpoint
from libk3.io.dtypes import EXPONENT_MASK
from libk3.io.identity import SAMPLE_BLOCK, sample_blocks
from libk3.pack.nonfinite import RunScan
from libk3.pack.compress import compress
from libk3.pack.schema import BLOCK_INDEX_FILE, COMPRESSED_TRUNK_FILE, open_pack
from libk3.pack.writer import JOURNAL_FILE, pack
from libk3.budget import ModelSizes

from .conftest import TINY
from .pack_mutations import CASES, INDEX, MANIFEST, TRUNK, make_case

IDS = "3,1,4,1,5"


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity") / "tiny.pack"
    with Checkpoint.open(TINY) as ckpt:
        pack(ckpt, out, progress=False)
    return out


@pytest.fixture(scope="module")
def tiny_kz(tiny_pack, tmp_path_factory):
    """tiny_pack compressed (v3); every tiny tensor is below the coded size, so its blocks
    are stored raw, framed and checksummed as v3 says."""
    out = tmp_path_factory.mktemp("integrity-v3") / "tiny.pack"
    shutil.copytree(tiny_pack, out)
    compress(out, progress=False, even_if_no_gain=True)
    assert open_pack(out).compressed
    return out


@pytest.fixture(params=["v2", "v3"])
def any_pack(request):
    """(the pack, the file its trunk bytes are in): raw, then compressed."""
    if request.param == "v2":
        return request.getfixturevalue("tiny_pack"), TRUNK
    return request.getfixturevalue("tiny_kz"), COMPRESSED_TRUNK_FILE


@pytest.fixture(scope="module")
def budget_args():
    """Half the trunk pinned, half streamed through the ring: both read paths are used."""
    with Checkpoint.open(TINY) as ckpt:
        sizes = ModelSizes.from_checkpoint(ckpt)
    return ["--trunk-gb", f"{sizes.trunk_bytes / 2 / 1e9:.9f}",
            "--cache-gb", f"{sizes.cache_all_bytes / 1e9:.9f}"]


def _invoke(main, args):
    """(exit code, stderr) of a console script run in-process; fails on a traceback."""
    res = CliRunner().invoke(main, [str(a) for a in args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        pytest.fail("traceback:\n" + "".join(traceback.format_exception(res.exception)))
    return res.exit_code, res.stderr


def _both(pack_dir, model, budget_args):
    """{tool: (exit code, stderr)} of k3-pack verify --against and k3-run --pack."""
    return {"verify": _invoke(k3pack_main, ["verify", pack_dir, "--against", model, "--quiet"]),
            "run": _invoke(k3run_main, [model, "--pack", pack_dir, "--ids", IDS, "--gen", 1,
                                        *budget_args])}


def _assert_refused(out: dict, needle):
    """Both tools exit 3 with one line holding ``needle`` (or one of a tuple of them)."""
    needles = needle if isinstance(needle, tuple) else (needle,)
    for tool, (code, err) in out.items():
        lines = err.strip().splitlines()
        assert code == 3, (tool, code, err)
        assert len(lines) == 1, (tool, err)
        assert any(n in lines[0] for n in needles), (tool, needle, err)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_pack_mutation_verify_refuses_exactly_what_run_refuses(name, tiny_pack, budget_args,
                                                               tmp_path):
    """Catches a damaged pack (one field, byte or file per case) that k3-run streams
    silently or crashes on, or that verify passes while k3-run refuses it (or the
    reverse). Control: the unmutated copy, which both accept."""
    want, needle = next((w, n) for c, w, n, _ in CASES if c == name)
    d, model = make_case(name, tiny_pack, tmp_path, TINY)
    out = _both(d, model, budget_args)
    if want == "accept":
        assert out == {"verify": (0, ""), "run": (0, out["run"][1])}, out
        assert "error" not in out["run"][1]
    else:
        _assert_refused(out, needle)


# ---- property-based: random mutations of trunk.json, experts.idx and trunk.bin ----------

def _nodes(doc, path=()):
    yield path
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _nodes(v, path + (i,))


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def _flip_bit(path, bit):
    """Flip bit ``bit`` (0 = the first byte's lowest) of the file at ``path`` in place."""
    blob = bytearray(path.read_bytes())
    blob[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(blob))


def _mutate(doc, path, op, data):
    """Apply one drawn change at ``path``: replace it by any JSON value, delete it, or add
    a key to it (a dict)."""
    parent = _get(doc, path[:-1])
    if op == "replace":
        parent[path[-1]] = data.draw(_JSON, label="value")
    elif op == "delete":
        del parent[path[-1]]
    else:
        node = _get(doc, path)
        assume(isinstance(node, dict))
        node[data.draw(st.text(min_size=1, max_size=6), label="key")] = 0


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([0, 1, -1, 4096])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
    | st.sampled_from(["../x", "/etc/hostname", "BF16", "F32", "trunk.bin"]),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
    max_leaves=6)


def _canon(doc) -> str:
    return json.dumps(doc, sort_keys=True)


def _work_copy(tiny_pack) -> Path:
    d = Path(tempfile.mkdtemp(prefix="k3mut")) / "pack"
    shutil.copytree(tiny_pack, d)
    return d


def test_pack_control_is_accepted_by_both(any_pack, budget_args):
    """The control of every damage case below: the undamaged pack passes both tools."""
    assert [c for c, _ in _both(any_pack[0], TINY, budget_args).values()] == [0, 0]


@settings(max_examples=35, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_pack_manifest_random_mutation_refused_by_both(any_pack, budget_args, data):
    """Catches any trunk.json change (a value replaced by any JSON value, a key deleted or
    added; v3's codec block included) that either tool accepts, crashes on, or reports
    in more than one line or without naming the file. Changes that leave the document
    equal are skipped."""
    packed, trunk = any_pack
    doc = json.loads((packed / MANIFEST).read_text())
    paths = list(_nodes(doc))
    path = data.draw(st.sampled_from(paths[1:]), label="path")
    op = data.draw(st.sampled_from(["replace", "delete", "add_key"]), label="op")
    _mutate(doc, path, op, data)
    assume(_canon(doc) != _canon(json.loads((packed / MANIFEST).read_text())))
    d = _work_copy(packed)
    try:
        (d / MANIFEST).write_text(json.dumps(doc))
        if path[:2] == ("source", "shards") and op == "replace" and len(path) == 4:
            # a shard's size or content differs; a value of the wrong kind (a null name)
            # is a field of trunk.json refused as such
            needle = ("different checkpoint", MANIFEST)
        elif path[0] == "layers" and path[-1] == "crc32" and op == "replace" \
                and type(crc := _get(doc, path[:-1])["crc32"]) is int and 0 <= crc < 2**32:
            needle = trunk                             # a valid CRC that the bytes fail
        else:
            needle = MANIFEST
        _assert_refused(_both(d, TINY, budget_args), needle)
    finally:
        shutil.rmtree(d.parent)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_pack_index_any_bit_flip_refused_by_both(tiny_pack, budget_args, data):
    """Catches a flipped bit anywhere in experts.idx (magic, header length, header JSON,
    any record field) that either tool accepts or crashes on."""
    size = (tiny_pack / INDEX).stat().st_size
    bit = data.draw(st.integers(0, size * 8 - 1), label="bit")
    d = _work_copy(tiny_pack)
    try:
        _flip_bit(d / INDEX, bit)
        _assert_refused(_both(d, TINY, budget_args), INDEX)
    finally:
        shutil.rmtree(d.parent)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_pack_trunk_any_bit_flip_refused_inside_a_run_accepted_in_padding(tiny_pack, budget_args,
                                                                         data):
    """Catches a flipped trunk.bin bit inside a layer's run that k3-run computes with
    (no CRC on read) or that only one tool refuses; a flip in the zero padding between
    runs changes nothing and both accept it."""
    layers = json.loads((tiny_pack / MANIFEST).read_text())["layers"]
    size = (tiny_pack / TRUNK).stat().st_size
    bit = data.draw(st.integers(0, size * 8 - 1), label="bit")
    hit = next((lay["layer"] for lay in layers
                if lay["file_off"] <= bit // 8 < lay["file_off"] + lay["nbytes"]), None)
    d = _work_copy(tiny_pack)
    try:
        with open(d / TRUNK, "r+b") as f:
            f.seek(bit // 8)
            b = f.read(1)[0]
            f.seek(bit // 8)
            f.write(bytes([b ^ (1 << (bit % 8))]))
        out = _both(d, TINY, budget_args)
        if hit is None:
            assert [c for c, _ in out.values()] == [0, 0], out
        else:
            _assert_refused(out, f"layer {hit}: trunk bytes do not match")
    finally:
        shutil.rmtree(d.parent)


@pytest.fixture(scope="module")
def control_out(tiny_kz, budget_args):
    """stdout of k3-run on the undamaged compressed pack."""
    res = CliRunner().invoke(k3run_main, [str(TINY), "--pack", str(tiny_kz), "--ids", IDS,
                                          "--gen", "1", *budget_args])
    assert res.exit_code == 0, res.stderr
    return res.stdout


@pytest.mark.parametrize("name", [COMPRESSED_TRUNK_FILE, BLOCK_INDEX_FILE])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_pack_v3_any_bit_flip_refused_by_both_or_harmless(name, tiny_kz, budget_args,
                                                          control_out, data):
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


# ---- identity and format version, end to end through the console scripts ------------------

def _cli(*args):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600)


def test_pack_identity_refuses_another_checkpoint_with_the_same_layout(tiny_pack, tmp_path):
    """Catches an identity of names and sizes only: `synth --seed 1` has every shard name
    and size of the tiny fixture (seed 0) and other weights. Control: the fixture itself."""
    from libk3.synth.checkpoint import synth_checkpoint
    other = synth_checkpoint(tmp_path / "tiny-seed1", "tiny", seed=1, progress=False)
    assert [(p.name, p.stat().st_size) for p in sorted(other.glob("*.safetensors"))] == \
        [(p.name, p.stat().st_size) for p in sorted(TINY.glob("*.safetensors"))]
    assert _invoke(k3pack_main, ["verify", tiny_pack, "--against", TINY, "--quiet"])[0] == 0
    p = _cli("k3-run", other, "--pack", tiny_pack, "--ids", IDS, "--preset", "max")
    out = {"run": (p.returncode, p.stderr),
           "verify": _invoke(k3pack_main, ["verify", tiny_pack, "--against", other, "--quiet"])}
    _assert_refused(out, "model-00001-of-000014.safetensors")
    assert all(str(tiny_pack) in err for _, err in out.values())


def test_pack_old_version_refused_with_a_repack_hint(tiny_pack, tmp_path):
    """Catches a v1 pack (identity of names and sizes only) read as if it were v2, or a
    refusal that does not say what to do; k3-pack into it neither rewrites it nor crashes."""
    d = tmp_path / "old.pack"
    shutil.copytree(tiny_pack, d)
    doc = json.loads((d / MANIFEST).read_text())
    doc["version"] = 1
    (d / MANIFEST).write_text(json.dumps(doc))
    out = {"run": _invoke(k3run_main, [TINY, "--pack", d, "--ids", IDS, "--preset", "max"]),
           "verify": _invoke(k3pack_main, ["verify", d, "--quiet"])}
    _assert_refused(out, "pack format v1")
    assert all("re-pack" in err for _, err in out.values())
    before = (d / MANIFEST).read_bytes()
    code, err = _invoke(k3pack_main, [TINY, d, "--quiet"])
    assert code == 3 and "format v1" in err
    assert (d / MANIFEST).read_bytes() == before


def test_pack_sampled_blocks_are_bounded_and_cover_header_data_middle_end():
    """Catches a digest that grows with the shard (the real model has 96 shards of ~16 GB)
    or skips the first tensor bytes after the header."""
    big = 16 * 10**9
    blocks = sample_blocks(big, 8 + 800_000)
    assert [o for o, _ in blocks] == [0, 800_008, big // 2 - SAMPLE_BLOCK // 2, big - SAMPLE_BLOCK]
    assert all(n == SAMPLE_BLOCK for _, n in blocks)
    assert sample_blocks(3 * SAMPLE_BLOCK, 100) == [(0, 3 * SAMPLE_BLOCK)]


# ---- CRC on first read, in the run ------------------------------------------------------

def _flip(pack_dir, layer):
    """Flip the lowest mantissa bit of a layer's fourth element: still a finite weight."""
    lay = json.loads((pack_dir / MANIFEST).read_text())["layers"][layer]
    with open(pack_dir / TRUNK, "r+b") as f:
        f.seek(lay["file_off"] + 6)
        b = f.read(1)[0]
        f.seek(lay["file_off"] + 6)
        f.write(bytes([b ^ 0x01]))


def _session(pack_dir, verify_reads):
    with Checkpoint.open(TINY) as ckpt:
        sizes = ModelSizes.from_checkpoint(ckpt)
    return open_session(TINY, pack=pack_dir, trunk_bytes=sizes.trunk_bytes // 2,
                        cache_bytes=sizes.cache_all_bytes,
                        reads=Reads(direct_io=False, verify_reads=verify_reads))


@pytest.mark.parametrize("verify_reads", ["first", "every"])
def test_trunk_crc_checked_on_first_read_or_every_read(tiny_pack, verify_reads):
    """Catches a check that never runs, runs on every read under `first` (its cost is
    one pass) or only once under `every`. Control: a run from the shards (no CRCs)
    checks nothing."""
    s = _session(tiny_pack, verify_reads)
    trunk = s.weights.trunk
    try:
        for _ in range(3):
            s.forward([3, 1, 4], s.new_state())
        pinned, ring = len(trunk.pinned_plan), 13 - len(trunk.pinned_plan)
        assert 0 < pinned < 13
        if verify_reads == "first":
            assert trunk.stats["crc_checks"] == 13
        else:                           # the read-ahead may have read up to a ring ahead
            assert 0 <= trunk.stats["crc_checks"] - (pinned + 3 * ring) <= trunk.n_slots
    finally:
        s.weights.close()
    with Checkpoint.open(TINY) as ckpt:
        sizes = ModelSizes.from_checkpoint(ckpt)
    s = open_session(TINY, trunk_bytes=sizes.trunk_bytes // 2, cache_bytes=sizes.cache_all_bytes)
    try:
        s.forward([3, 1, 4], s.new_state())
        assert s.weights.trunk.stats["crc_checks"] == 0
    finally:
        s.weights.close()


def test_run_verify_reads_option_reaches_the_trunk(tiny_pack, budget_args, tmp_path):
    """Catches --verify-reads parsed but not passed down (every read checked either way,
    or only the first); an unknown value is a usage error (exit 2)."""
    checks = {}
    for mode in ("first", "every"):
        rep = tmp_path / f"{mode}.json"
        code, err = _invoke(k3run_main, [TINY, "--pack", tiny_pack, "--ids", IDS, "--gen", 3,
                                         *budget_args, "--verify-reads", mode,
                                         "--report-json", rep])
        assert code == 0, err
        checks[mode] = json.loads(rep.read_text())["trunk_crc_checks"]
    assert checks["first"] == 13 and checks["every"] > 13
    assert _invoke(k3run_main, [TINY, "--pack", tiny_pack, "--ids", IDS,
                                "--verify-reads", "sometimes"])[0] == 2


@pytest.mark.parametrize("where", ["pinned", "ring"])
def test_trunk_crc_mismatch_stops_the_run_naming_pack_file_and_layer(tiny_pack, tmp_path, where):
    """Catches a damaged pinned layer (read once, at load) or streamed layer (read by the
    read-ahead thread) whose bytes reach the kernels."""
    d = tmp_path / "p"
    shutil.copytree(tiny_pack, d)
    s = _session(d, "first")
    try:
        trunk = s.weights.trunk
        layer = min(trunk.pinned_plan) if where == "pinned" else max(trunk.ring)
        _flip(d, layer)
        with pytest.raises(FormatError) as e:
            s.forward([3, 1, 4], s.new_state())
        assert str(d / TRUNK) in str(e.value) and f"layer {layer}:" in str(e.value)
        assert "\n" not in str(e.value)
    finally:
        s.weights.close()


def test_trunk_crc_every_catches_what_first_lets_through(tiny_pack, tmp_path):
    """Catches `every` checking only the first pass; documents `first`: trunk.bin changed
    under a running process after a streamed layer's first pass is not seen."""
    d = tmp_path / "p"
    shutil.copytree(tiny_pack, d)
    for mode in ("first", "every"):
        shutil.copyfile(tiny_pack / TRUNK, d / TRUNK)
        s = _session(d, mode)
        try:
            s.forward([3, 1, 4], s.new_state())
            layer = max(s.weights.trunk.ring)
            _flip(d, layer)
            if mode == "first":
                s.forward([3, 1, 4], s.new_state())
            else:
                with pytest.raises(FormatError, match=f"layer {layer}:"):
                    s.forward([3, 1, 4], s.new_state())
        finally:
            s.weights.close()


# ---- NaN / Inf ------------------------------------------------------------------------

_SPECIAL = {"BF16": [0x7FC0, 0x7F80, 0xFF80], "F16": [0x7E00, 0x7C00, 0xFC00],
            "F32": [0x7FC00000, 0x7F800000, 0xFF800000]}


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_runscan_finds_the_first_nonfinite_element_across_any_piece_cuts(data):
    """Catches a scan that misses an element cut by a piece boundary, mixes two tensors'
    carried bytes, reports the wrong index, or calls a finite value special (control:
    tensors without specials report nothing)."""
    run, tensors, want = bytearray(), {}, {}
    for k in range(data.draw(st.integers(1, 3), label="tensors")):
        dtype = data.draw(st.sampled_from(sorted(EXPONENT_MASK)), label="dtype")
        view, mask = EXPONENT_MASK[dtype]
        n = data.draw(st.integers(1, 70), label="n")
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
        bits = (rng.integers(0, 2**31, n, dtype=np.uint64) & ~np.uint64(mask)).astype(view)
        specials = data.draw(st.lists(st.integers(0, n - 1), max_size=2), label="at")
        for i in specials:
            bits[i] = data.draw(st.sampled_from(_SPECIAL[dtype]), label="special")
        run += bytes(data.draw(st.integers(0, 3), label="gap"))
        tensors[f"t{k}"] = {"off": len(run), "nbytes": bits.nbytes, "dtype": dtype}
        run += bits.tobytes()
        if specials:
            want[f"t{k}"] = min(specials)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(run) - 1), max_size=6), label="cuts")))
    scan = RunScan(tensors)
    buf = np.frombuffer(bytes(run), np.uint8)
    for a, b in zip([0] + cuts, cuts + [len(run)]):
        scan.feed(buf[a:b])
    assert scan.found == want


def _poison(model_dir, name, offset_elems, bits):
    """Write one element's bit pattern into a tensor of a checkpoint copy."""
    with Checkpoint.open(model_dir) as ckpt:
        ent = ckpt.entry(name)
    fmt = {"BF16": "<H", "F16": "<H", "F32": "<I"}[ent.dtype]
    with open(ent.path, "r+b") as f:
        f.seek(ent.offset + offset_elems * struct.calcsize(fmt))
        f.write(struct.pack(fmt, bits))


def test_pack_nonfinite_refused_naming_the_tensor_then_packed_with_the_flag(tmp_path):
    """Catches NaN/Inf packed silently, a refusal naming no tensor, a rerun with
    --allow-nonfinite that re-copies or forgets the refused layer, verify passing the
    pack, and k3-run printing tokens from NaN. Control: the fixture packs with no
    warning and nothing reported."""
    code, err = _invoke(k3pack_main, [TINY, tmp_path / "ok.pack", "--quiet"])
    assert code == 0 and err == ""
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    nan_vec = names.layer(2, "self_attn.dt_bias")                  # F32 vector
    inf_mat = names.layer(6, "self_attn.q_proj.weight")            # BF16 matrix
    _poison(model, nan_vec, 3, 0x7FC00000)
    _poison(model, inf_mat, 100, 0x7F80)
    out = tmp_path / "p"
    code, err = _invoke(k3pack_main, [model, out, "--quiet"])
    assert code == 3 and len(err.strip().splitlines()) == 1, err
    assert nan_vec in err and "--allow-nonfinite" in err
    assert len((out / JOURNAL_FILE).read_text().splitlines()) == 1 + 3     # layers 0..2 kept
    res = CliRunner().invoke(k3pack_main, [str(model), str(out), "--quiet", "--json",
                                           "--allow-nonfinite"])
    assert res.exit_code == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["nonfinite_tensors"] == [nan_vec, inf_mat] and info["resumed"] == 3
    assert "warning: 2 trunk tensor(s) hold NaN or Inf" in res.stderr
    code, err = _invoke(k3pack_main, ["verify", out, "--against", model, "--quiet"])
    assert code == 3 and nan_vec in err and "2 trunk tensor(s)" in err
    code, err = _invoke(k3pack_main, ["verify", out, "--quiet", "--allow-nonfinite"])
    assert code == 0 and "warning: 2 trunk tensor(s)" in err
    r = _cli("k3-run", model, "--pack", out, "--ids", IDS, "--gen", 2, "--preset", "max")
    assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "layer 2 produced NaN or Inf" in r.stderr and r.stdout.strip() == ""


@pytest.mark.parametrize("where,bits,message", [
    (None, None, None),
    ((6, "self_attn.q_proj.weight"), 0x7FC0, "layer 6 produced NaN or Inf"),
    ((9, "mlp_res_norm.weight"), np.inf, "layer 9 produced NaN or Inf"),
    (("lm_head",), 0xFF80, "the logits hold NaN or Inf"),
    ((5, "block_sparse_moe.gate.e_score_correction_bias"), np.nan,
     "layer 5 produced NaN or Inf (in its routing scores"),
])
def test_forward_stops_at_the_first_nonfinite_layer_output(where, bits, message):
    """Catches a forward that samples from NaN logits, names a later layer than the first
    one whose output is non-finite, misses an Inf, or routes on NaN scores (the router then
    selects id -1, which crashed the resident run and read the wrong expert streamed);
    control (no damage): runs."""
    s = open_session(TINY)
    if where is not None and where[0] == "lm_head":
        s.forward.head()[0][5, 7] = bits
    elif where is not None:
        arr = s.weights.layer(where[0])[where[1]]
        arr.reshape(-1)[3] = bits
    if message is None:
        assert np.isfinite(s.forward([3, 1, 4], s.new_state())).all()
        return
    with pytest.raises(NonFiniteError) as e:
        s.forward([3, 1, 4], s.new_state())
    assert message in str(e.value) and e.value.exit_code == 3
