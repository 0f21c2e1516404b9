"""Trace formats v1 and v2 (formats/trace.md, libk3/trace/format.py), the C-trace import, the stats and
replay reports, and the k3-trace console script end to end.

Each damage test makes one mutation of a good file and first checks that the good file
reads (the control).
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import zlib

import numpy as np
import pytest

from libk3.trace import format as tr
from libk3.trace import raw_import
from libk3.errors import FormatError, K3Error
from libk3.policies.registry import POLICIES
from libk3.trace.report import capacity_ladder, replay_report, trace_stats

NL, NE, TOPK = 5, 12, 3


def header(**over):
    d = dict(checkpoint="abc123", expert_bytes=1000, n_layers=NL, n_experts=NE, top_k=TOPK,
             source="k3-run", created_by="test")
    d.update(over)
    return tr.TraceHeader(**d)


def records(n, seed=0):
    rng = np.random.default_rng(seed)
    r = np.empty(n, tr.RECORD_DTYPE)
    r["pos"] = np.arange(n) // (NL * TOPK)
    r["seq"] = rng.integers(0, 3, n)
    r["layer"] = rng.integers(0, NL, n)
    r["expert"] = rng.integers(0, NE, n)
    r["phase"] = rng.integers(0, 3, n)
    return r


def write(path, recs, frame_records=100, **hdr):
    with tr.TraceWriter(path, header(**hdr), frame_records=frame_records) as w:
        w.append_records(recs)
    return path


def crashed_trace(path, n, frame_records):
    """Write ``n`` records to ``path`` and crash inside the writer; returns the
    ``.partial`` file a crashed run leaves behind."""
    with pytest.raises(RuntimeError):
        with tr.TraceWriter(path, header(), frame_records=frame_records) as w:
            w.append_records(records(n))
            raise RuntimeError("simulated crash")
    return path.with_name(path.name + ".partial")


def frame_offsets(path):
    """Byte offsets of each data frame (walking the headers)."""
    data = open(path, "rb").read()
    _, _, hlen, _ = tr.FILE_HEAD.unpack_from(data)
    off, out = tr.FILE_HEAD.size + hlen, []
    while data[off:off + 4] == tr.FRAME_TAG:
        out.append(off)
        _, _, plen, _ = tr.FRAME_HEAD.unpack_from(data, off)
        off += tr.FRAME_HEAD.size + plen
    return out


# ---- round trip ---------------------------------------------------------------------------

def test_trace_roundtrip_preserves_header_and_records_across_frames(tmp_path):
    """Catches lost or reordered records at frame boundaries and header fields dropped."""
    recs = records(1234)
    p = write(tmp_path / "t.k3trace", recs, frame_records=100, meta={"prompt": "x"})
    r = tr.TraceReader(p)
    assert r.header == header(meta={"prompt": "x"})
    frames = list(r.iter_frames())
    assert [f.size for f in frames] == [100] * 12 + [34]
    assert np.array_equal(np.concatenate(frames), recs)
    assert (r.n_frames, r.n_records) == (13, 1234)
    assert np.array_equal(r.layer_expert_keys(), recs["layer"].astype(np.int64) * NE
                          + recs["expert"])


def test_trace_append_writes_one_record_per_expert_in_order(tmp_path):
    """Catches append() transposing fields or losing the selection order."""
    p = tmp_path / "a.k3trace"
    with tr.TraceWriter(p, header()) as w:
        w.append(7, tr.PHASE_DECODE, 2, np.array([11, 0, 5]), seq=1)
        w.append(8, tr.PHASE_PREFILL, 4, [3])
    got = tr.TraceReader(p).read_all()
    assert got.tolist() == [(7, 1, 2, 11, 1), (7, 1, 2, 0, 1), (7, 1, 2, 5, 1),
                            (8, 0, 4, 3, 0)]


def test_trace_writer_publishes_the_final_name_only_at_close(tmp_path):
    """Catches a writer that writes in place (a crash would leave a file that looks
    complete)."""
    p = tmp_path / "w.k3trace"
    w = tr.TraceWriter(p, header(), frame_records=10)
    w.append_records(records(25))
    assert not p.exists() and w.partial_path.exists()
    w.close()
    assert p.exists() and not w.partial_path.exists()
    assert tr.TraceReader(p).read_all().size == 25


def test_trace_writer_refuses_out_of_range_records(tmp_path):
    """Catches writing an expert id the header says cannot exist."""
    w = tr.TraceWriter(tmp_path / "o.k3trace", header())
    w.append(0, tr.PHASE_DECODE, 1, [NE - 1])                         # control
    for layer, experts in ((1, [NE]), (NL, [0]), (-1, [0]), (0, [-1, 2])):
        with pytest.raises(FormatError, match="out of range"):
            w.append(0, tr.PHASE_DECODE, layer, experts)
    bad = records(3)
    bad["phase"][1] = 4
    with pytest.raises(FormatError, match="out-of-range record 1"):
        w.append_records(bad)
    w.abort()
    assert not (tmp_path / "o.k3trace").exists() and not w.partial_path.exists()


def test_trace_header_for_config_names_the_checkpoint():
    """Catches a k3-run header without the config's fingerprint, or whose expert size is
    not the bytes of one expert's six tensors: on the tiny checkpoint the sum of their
    entries, on the real dimensions model.md §4.1's 17,547,264; and dimensions that are
    not config.json's."""
    from pathlib import Path
    from libk3.config import config_from_dict, load_config
    from libk3.io.checkpoint import Checkpoint
    from libk3.k3_dims import REAL
    tiny = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
    cfg = load_config(tiny)
    t = json.loads((tiny / "config.json").read_text())["text_config"]
    h = tr.header_for_config(cfg, created_by="k3-run 0.1.0")
    with Checkpoint.open(tiny) as ckpt:
        one_expert = sum(ckpt.entry(n).nbytes for n in ckpt.names()
                         if ".layers.1.block_sparse_moe.experts.0." in n)
    assert (h.checkpoint, h.expert_bytes, h.n_layers, h.n_experts, h.top_k, h.source) == (
        cfg.fingerprint(), one_expert, t["num_hidden_layers"], t["num_experts"],
        t["num_experts_per_token"], "k3-run")
    real = tr.header_for_config(config_from_dict(dict(REAL)), created_by="k3-run 0.1.0")
    assert real.checkpoint != h.checkpoint                     # a fingerprint, not a constant
    assert (real.expert_bytes, real.n_layers, real.n_experts, real.top_k) == (
        17_547_264, 93, 896, 16)


# ---- damage -------------------------------------------------------------------------------

def test_trace_truncated_final_frame_is_reported_and_earlier_frames_stay_usable(tmp_path):
    """A crash mid-frame: strict reading names the frame and its offset; tolerant reading
    returns the intact frames. Catches a reader that loses everything, or one that
    silently returns a short trace."""
    recs = records(500)
    p = write(tmp_path / "t.k3trace", recs, frame_records=100)
    assert tr.TraceReader(p).read_all().size == 500                   # control
    offs = frame_offsets(p)
    cut = offs[4] + tr.FRAME_HEAD.size + 7                            # inside frame 4
    data = open(p, "rb").read()[:cut]
    q = tmp_path / "cut.k3trace"
    q.write_bytes(data)
    with pytest.raises(FormatError, match=rf"frame 4 at byte offset {offs[4]}"):
        tr.TraceReader(q).read_all()
    r = tr.TraceReader(q, tolerate_truncated_tail=True)
    got = r.read_all()
    assert np.array_equal(got, recs[:400])
    assert r.tail_error is not None and f"byte offset {offs[4]}" in str(r.tail_error)


def test_trace_crash_leaves_a_partial_file_missing_only_its_end_marker(tmp_path):
    """Leaving the writer by an exception keeps the frames written so far. Catches a
    writer that discards them, and a strict reader that accepts a file with no end."""
    p = tmp_path / "c.k3trace"
    partial = crashed_trace(p, 250, frame_records=100)
    assert not p.exists() and partial.exists()
    with pytest.raises(FormatError, match="without the end marker"):
        tr.TraceReader(partial).read_all()
    r = tr.TraceReader(partial, tolerate_truncated_tail=True)
    assert np.array_equal(r.read_all(), records(250))
    assert "frame 3" in str(r.tail_error)


def test_trace_corrupt_frame_in_the_middle_is_rejected_even_when_tolerant(tmp_path):
    """Damage followed by good data is not a crash: no mode may skip it silently."""
    p = write(tmp_path / "m.k3trace", records(300), frame_records=100)
    offs = frame_offsets(p)
    data = bytearray(open(p, "rb").read())
    data[offs[1] + tr.FRAME_HEAD.size + 10] ^= 0xFF
    q = tmp_path / "bad.k3trace"
    q.write_bytes(bytes(data))
    for tolerate in (False, True):
        with pytest.raises(FormatError, match=rf"frame 1 at byte offset {offs[1]}"):
            tr.TraceReader(q, tolerate_truncated_tail=tolerate).read_all()


def test_trace_corrupt_last_frame_of_a_crashed_file_is_tolerated(tmp_path):
    """A damaged final frame (checksum) of an unterminated file is a tail: tolerant mode
    keeps the rest, strict mode names it."""
    partial = crashed_trace(tmp_path / "x.k3trace", 300, frame_records=100)
    offs = frame_offsets(partial)
    data = bytearray(partial.read_bytes())
    data[-3] ^= 0x55
    partial.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=rf"frame 2 at byte offset {offs[2]}"):
        tr.TraceReader(partial).read_all()
    r = tr.TraceReader(partial, tolerate_truncated_tail=True)
    assert r.read_all().size == 200


@pytest.mark.parametrize("mutation,message", [
    (lambda d: b"K3TRACX\0" + d[8:], "bad magic"),
    (lambda d: d[:8] + struct.pack("<I", 3) + d[12:], "version"),
    (lambda d: d[:tr.FILE_HEAD.size + 5] + bytes([d[tr.FILE_HEAD.size + 5] ^ 1])
     + d[tr.FILE_HEAD.size + 6:], "header checksum"),
    (lambda d: d[:8] + struct.pack("<I", 1) + struct.pack("<I", 1 << 30) + d[16:],
     "header length"),
])
def test_trace_corrupt_header_is_rejected_naming_the_file(tmp_path, mutation, message):
    """Catches a reader that trusts a damaged header."""
    p = write(tmp_path / "h.k3trace", records(10))
    tr.TraceReader(p)                                                 # control
    q = tmp_path / "bad.k3trace"
    q.write_bytes(mutation(p.read_bytes()))
    with pytest.raises(FormatError, match=message) as e:
        tr.TraceReader(q)
    assert str(q) in str(e.value)


def _rewrite_header(path, out, edit):
    data = path.read_bytes()
    _, version, hlen, _ = tr.FILE_HEAD.unpack_from(data)
    doc = json.loads(data[tr.FILE_HEAD.size:tr.FILE_HEAD.size + hlen])
    edit(doc)
    blob = json.dumps(doc).encode()
    out.write_bytes(tr.FILE_HEAD.pack(tr.MAGIC, version, len(blob), zlib.crc32(blob)) + blob
                    + data[tr.FILE_HEAD.size + hlen:])
    return out


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.pop("top_k"), "missing"),
    (lambda d: d.update(colour="red"), "unknown"),
    (lambda d: d.update(n_experts=0), "n_experts"),
    (lambda d: d.update(checkpoint=None), "checkpoint"),
    (lambda d: d.update(source="elsewhere"), "source"),
])
def test_trace_header_field_errors_are_rejected(tmp_path, edit, message):
    """Catches a reader that defaults a missing field or accepts an impossible one."""
    p = write(tmp_path / "f.k3trace", records(10))
    _rewrite_header(p, tmp_path / "ok.k3trace", lambda d: None)
    tr.TraceReader(tmp_path / "ok.k3trace").read_all()               # control
    q = _rewrite_header(p, tmp_path / "bad.k3trace", edit)
    with pytest.raises(FormatError, match=message):
        tr.TraceReader(q)


def test_trace_out_of_range_record_in_a_file_is_rejected(tmp_path):
    """A header that shrank under its records (layer >= n_layers) is caught per frame."""
    recs = records(50)
    recs["layer"][17] = NL - 1
    p = write(tmp_path / "r.k3trace", recs)
    q = _rewrite_header(p, tmp_path / "bad.k3trace", lambda d: d.update(n_layers=NL - 1))
    with pytest.raises(FormatError, match="frame 0 .*out-of-range record"):
        tr.TraceReader(q).read_all()


@pytest.mark.parametrize("field,value,message", [
    ("tag", b"K3TX", "bad frame tag"),
    ("records", 0, "bad frame header"),
    ("records", tr.MAX_FRAME_RECORDS + 1, "bad frame header"),
])
def test_trace_bad_frame_header_is_rejected(tmp_path, field, value, message):
    """Invariants 6 and 7: a frame must start with its tag and hold 1..2^20 records.
    Catches a reader that allocates whatever a damaged count says."""
    p = write(tmp_path / "g.k3trace", records(300), frame_records=100)
    offs = frame_offsets(p)
    data = bytearray(p.read_bytes())
    if field == "tag":
        data[offs[1]:offs[1] + 4] = value
    else:
        data[offs[1] + 4:offs[1] + 8] = struct.pack("<I", value)
    q = tmp_path / "bad.k3trace"
    q.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=rf"frame 1 at byte offset {offs[1]}: {message}"):
        tr.TraceReader(q, tolerate_truncated_tail=True).read_all()


def test_trace_end_marker_must_match_and_end_the_file(tmp_path):
    """Catches trailing garbage or a file spliced from two traces."""
    p = write(tmp_path / "e.k3trace", records(120), frame_records=50)
    q = tmp_path / "tail.k3trace"
    q.write_bytes(p.read_bytes() + b"\0")
    with pytest.raises(FormatError, match="after the end marker"):
        tr.TraceReader(q).read_all()
    data = bytearray(p.read_bytes())
    data[-8:] = struct.pack("<Q", 119)
    q.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="end marker disagrees"):
        tr.TraceReader(q).read_all()


# ---- import of the C engine's raw trace ---------------------------------------------------

def test_import_raw_c_trace_round_trips_pairs_with_unknown_positions(tmp_path):
    """Catches swapped (layer, expert) columns and invented token positions."""
    pairs = np.array([[1, 2], [3, 4], [0, 895], [92, 0]], "<i4")
    raw = tmp_path / "expert_trace.bin"
    pairs.tofile(raw)
    info = raw_import.import_raw_c_trace(raw, tmp_path / "i.k3trace", n_layers=93, n_experts=896,
                                 expert_bytes=17547264, top_k=16, created_by="t")
    assert info["requests"] == 4
    r = tr.TraceReader(tmp_path / "i.k3trace")
    rec = r.read_all()
    assert rec["layer"].tolist() == [1, 3, 0, 92] and rec["expert"].tolist() == [2, 4, 895, 0]
    assert set(rec["pos"].tolist()) == {-1} and set(rec["phase"].tolist()) == {tr.PHASE_UNKNOWN}
    assert r.header.source == "import" and r.header.checkpoint is None


def test_import_streams_in_chunks_without_losing_pairs(tmp_path, monkeypatch):
    """Catches an off-by-one at chunk boundaries."""
    monkeypatch.setattr(raw_import, "IMPORT_CHUNK_PAIRS", 7)
    rng = np.random.default_rng(3)
    pairs = np.stack([rng.integers(0, 9, 100), rng.integers(0, 20, 100)], 1).astype("<i4")
    raw = tmp_path / "r.bin"
    pairs.tofile(raw)
    raw_import.import_raw_c_trace(raw, tmp_path / "o.k3trace", n_layers=9, n_experts=20,
                          expert_bytes=1, top_k=2, created_by="t")
    keys = tr.TraceReader(tmp_path / "o.k3trace").layer_expert_keys()
    assert np.array_equal(keys, pairs[:, 0] * 20 + pairs[:, 1])


@pytest.mark.parametrize("raw_bytes,message", [
    (np.array([1, 2, 3], "<i4").tobytes(), "odd number of int32s"),
    (np.array([1, 2], "<i4").tobytes() + b"\0\0", "whole number of int32s"),
    (np.array([1, 2, 93, 0], "<i4").tobytes(), "pair 1 at byte offset 8"),
    (np.array([1, -1], "<i4").tobytes(), "pair 0"),
])
def test_import_rejects_malformed_raw_traces_and_leaves_no_output(tmp_path, raw_bytes, message):
    """Catches importing half a pair or an impossible expert, or leaving a partial file."""
    good = tmp_path / "good.bin"
    np.array([1, 2, 3, 4], "<i4").tofile(good)                       # control
    raw_import.import_raw_c_trace(good, tmp_path / "g.k3trace", n_layers=93, n_experts=896,
                          expert_bytes=1, top_k=16, created_by="t")
    raw = tmp_path / "bad.bin"
    raw.write_bytes(raw_bytes)
    out = tmp_path / "b.k3trace"
    with pytest.raises(FormatError, match=message):
        raw_import.import_raw_c_trace(raw, out, n_layers=93, n_experts=896, expert_bytes=1,
                              top_k=16, created_by="t")
    assert not out.exists() and not (tmp_path / "b.k3trace.partial").exists()


# ---- reports ------------------------------------------------------------------------------

def test_stats_counts_tokens_distinct_experts_and_the_ceiling(tmp_path):
    """Hand-made decode trace: 2 tokens x 2 layers x 2 experts. Catches counting requests
    as tokens or distinct experts across layers as one."""
    p = tmp_path / "s.k3trace"
    with tr.TraceWriter(p, header(n_layers=2, n_experts=4, top_k=2)) as w:
        w.append(0, tr.PHASE_DECODE, 0, [1, 2])
        w.append(0, tr.PHASE_DECODE, 1, [1, 3])
        w.append(1, tr.PHASE_DECODE, 0, [1, 0])
        w.append(1, tr.PHASE_DECODE, 1, [3, 2])
    s = trace_stats(tr.TraceReader(p))
    assert (s["requests"], s["tokens"], s["tokens_estimated"]) == (8, 2, False)
    assert s["distinct_experts"] == 6                  # L0: 0,1,2  L1: 1,2,3
    assert s["reuse"] == pytest.approx(2 / 8)
    assert s["hit_rate_ceiling"] == pytest.approx(1 - 6 / 8)
    assert s["hottest"][0] == {"layer": 0, "expert": 1, "requests": 2}
    assert [x["distinct"] for x in s["per_layer"]] == [3, 3]


def test_capacity_ladder_uses_decimal_gb_and_skips_too_small_caches():
    """slots = floor(GB * 10^9 / expert bytes); fewer than top_k + 1 slots is skipped.
    Catches GiB arithmetic and replaying caches that cannot hold a layer."""
    rows, skipped = capacity_ladder(17547264, 16, capacities_gb=[8, 0.2, 64])
    assert [r["slots"] for r in rows] == [455, 3647]
    assert len(skipped) == 1 and "11 slots" in skipped[0]
    rows, skipped = capacity_ladder(17547264, 16, distinct=1000)   # from the trace
    assert [r["slots"] for r in rows] == [17, 32, 63, 125, 250, 500, 1000] and not skipped


def test_replay_report_gb_read_per_token_is_misses_times_expert_bytes(tmp_path):
    """Catches bytes per token computed from requests or hits."""
    from libk3.synth.traces import write_synth_trace
    p = write_synth_trace(tmp_path / "y.k3trace", 20, n_layers=4, n_experts=30, top_k=3,
                          expert_bytes=10**8)
    rep = replay_report(tr.TraceReader(p), policies=["lru", "belady"], slots=[10, 40])
    assert rep["tokens"] == 20 and rep["requests"] == 20 * 4 * 3
    for row in rep["capacities"]:
        for cell in row["policies"].values():
            assert cell["gb_read_per_token"] == pytest.approx(cell["misses"] * 0.1 / 20)
        assert row["policies"]["belady"]["hits"] >= row["policies"]["lru"]["hits"]


def test_replay_without_capacities_derives_them_from_the_trace(tmp_path):
    """Catches fixed 8-256 GB defaults, which for a small model are all bigger than every
    expert it touches (one row repeated seven times): with no capacity given, the ladder
    is fractions of the trace's distinct experts, the last holding all of them, so its
    hit rate is the ceiling (control: --slots still replays exactly what it is given)."""
    from libk3.synth.traces import write_synth_trace
    p = write_synth_trace(tmp_path / "d.k3trace", 60, n_layers=4, n_experts=64, top_k=3,
                          expert_bytes=4096)
    rep = replay_report(tr.TraceReader(p), policies=["lru"])
    slots = [r["slots"] for r in rep["capacities"]]
    distinct = rep["compulsory_misses"]
    assert len(slots) >= 4 and slots == sorted(set(slots)) and slots[-1] == distinct
    assert slots[0] >= 3 + 1 and not rep["skipped"]
    assert [r["capacity_bytes"] for r in rep["capacities"]] == [n * 4096 for n in slots]
    last = rep["capacities"][-1]["policies"]["lru"]["hit_rate_pct"]
    assert last == pytest.approx(rep["hit_rate_ceiling_pct"])
    given = replay_report(tr.TraceReader(p), policies=["lru"], slots=[7, 900])
    assert [r["slots"] for r in given["capacities"]] == [7, 900]


def test_trace_texts_print_small_sizes_in_units_that_differ(tmp_path):
    """Catches a small model's sizes printed as 0.00 GB or 1.6e-05 GB: the stats and the
    replay tables give each size in a unit that shows it, and the capacities of the
    ladder each read differently."""
    from libk3.synth.traces import write_synth_trace
    from libk3.trace.report import format_replay, format_stats
    p = write_synth_trace(tmp_path / "s.k3trace", 60, n_layers=4, n_experts=64, top_k=3,
                          expert_bytes=4096)
    rep = replay_report(tr.TraceReader(p), policies=["lru"])
    text = format_replay(rep) + "\n" + format_stats(trace_stats(tr.TraceReader(p)))
    assert "e-0" not in text and " 0.00 GB" not in text and "0.0 GB" not in text, text
    assert "KB" in text and "MB" in text
    cache = [ln.split()[0:2] for ln in text.splitlines()[4:4 + len(rep["capacities"])]]
    assert len({tuple(c) for c in cache}) == len(rep["capacities"]), cache


# ---- the console script ------------------------------------------------------------------

def k3_trace(*args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(["k3-trace", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_cli_import_stats_replay_end_to_end(tmp_path):
    """import -> stats --json -> replay --json through the installed console script.
    Catches broken option wiring and non-JSON output."""
    rng = np.random.default_rng(0)
    layer = np.tile(np.repeat(np.arange(1, 93), 16), 30)
    expert = rng.integers(0, 64, layer.size)
    raw = tmp_path / "expert_trace.bin"
    np.stack([layer, expert], 1).astype("<i4").tofile(raw)
    out = tmp_path / "t.k3trace"

    r = k3_trace("import", raw, out)
    assert r.returncode == 0, r.stderr
    assert f"{layer.size:,} requests" in r.stdout

    r = k3_trace("stats", out, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["requests"] == layer.size and s["tokens"] == 30 and s["tokens_estimated"]
    assert s["moe_layers_seen"] == 92 and s["pool_experts"] == 92 * 896

    r = k3_trace("replay", out, "--capacity-gb", "0.1,8", "--slots", "300",
                 "--policy", "lru,belady,layer-lfu", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert [c["slots"] for c in rep["capacities"]] == [455, 300]
    assert "100.00 MB = 5 slots skipped" in rep["skipped"][0]
    for c in rep["capacities"]:
        hr = {p: v["hit_rate_pct"] for p, v in c["policies"].items()}
        assert set(hr) == {"lru", "belady", "layer-lfu"}
        assert hr["belady"] >= hr["layer-lfu"] and hr["belady"] >= hr["lru"]

    r = k3_trace("replay", out, "--slots", "300", "--policy", "lru")
    assert r.returncode == 0 and "hit rate (%)" in r.stdout
    assert "adaptive" not in r.stdout                       # control for the next call

    r = k3_trace("replay", out, "--slots", "300")            # every policy, the default too
    assert r.returncode == 0, r.stderr
    head = r.stdout.splitlines()[3].split()
    assert head[2:] == [p + ("" if POLICIES[p].online else "*") for p in POLICIES]
    assert "adaptive followed (at the end): 5.26 GB " in r.stdout      # 300 x 17,547,264 B


def test_cli_errors_are_one_line_with_exit_codes(tmp_path):
    """Bad input gives one stderr line and the documented exit code, never a traceback."""
    bad = tmp_path / "not.k3trace"
    bad.write_bytes(b"garbage" * 10)
    r = k3_trace("stats", bad)
    assert r.returncode == FormatError.exit_code
    assert "bad magic" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    good = write(tmp_path / "g.k3trace", records(60))
    r = k3_trace("replay", good, "--slots", "5", "--policy", "nosuch", "--json")
    assert r.returncode == 2 and "unknown cache policy" in r.stderr
    assert json.loads(r.stdout)["error"] == "usage"


def test_cli_tolerate_truncated_reads_a_crashed_trace(tmp_path):
    """A crashed run's .partial file: refused with a hint by default, read with
    --tolerate-truncated and a warning. Catches the flag not reaching the reader."""
    partial = crashed_trace(tmp_path / "c.k3trace", 120, frame_records=50)
    r = k3_trace("stats", partial, "--json")
    assert r.returncode == FormatError.exit_code and "--tolerate-truncated" in r.stderr
    r = k3_trace("stats", partial, "--json", "--tolerate-truncated")
    assert r.returncode == 0 and json.loads(r.stdout)["requests"] == 120
    assert "warning" in r.stderr and "end marker" in r.stderr


def test_cli_plot_without_matplotlib_says_how_to_install_it(tmp_path):
    """Catches --plot without matplotlib failing as an ImportError, a run error (exit 1)
    or a hint naming a bare package instead of k3's own extra: one line naming --plot
    and `pip install 'k3[plot]'`, exit 2 (usage), before any replay."""
    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed; the message path cannot be exercised")
    good = write(tmp_path / "g.k3trace", records(60))
    r = k3_trace("replay", good, "--slots", "5", "--plot", tmp_path / "x.png")
    assert r.returncode == 2 and "--plot" in r.stderr, r.stderr
    assert "pip install 'k3[plot]'" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.png").exists()


def test_plot_extra_is_the_one_the_hint_names():
    """Catches an install hint naming an extra (or a distribution) pyproject.toml does
    not define: the hint's distribution is the project's and its plot extra installs
    matplotlib."""
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path
    from libk3.trace.report import PLOT_INSTALL
    doc = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert PLOT_INSTALL == f"pip install '{doc['project']['name']}[plot]'"
    assert any(d.startswith("matplotlib") for d in
               doc["project"]["optional-dependencies"]["plot"])


def test_plot_axes_read_in_sizes_and_slots_with_the_trace_and_model(tmp_path):
    """Catches a chart whose capacity ticks are raw floats (1.6e-05) and whose title says
    neither which trace nor which model: ticks in KB/MB/GB, a slot axis, and the trace's
    file name and model in the title (matplotlib's Agg backend; skipped without it)."""
    pytest.importorskip("matplotlib")
    from libk3.synth.traces import write_synth_trace
    from libk3.trace.report import plot_replay, replay_figure
    p = write_synth_trace(tmp_path / "plotted.k3trace", 60, n_layers=4, n_experts=64,
                          top_k=3, expert_bytes=4096)
    rep = replay_report(tr.TraceReader(p), policies=["lru", "belady"])
    fig = replay_figure(rep)
    ax = fig.axes[0]
    assert "plotted.k3trace" in ax.get_title() and "4 layers x 64 experts" in ax.get_title()
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert len(ticks) == len(rep["capacities"]) and len(set(ticks)) == len(ticks)
    assert all(t.endswith((" KB", " MB", " GB")) and "e-" not in t for t in ticks), ticks
    (top,) = [a for a in ax.child_axes if a.get_xlabel() == "slots"]
    assert [t.get_text() for t in top.get_xticklabels()] == \
        [f"{r['slots']:,}" for r in rep["capacities"]]
    import matplotlib.pyplot as plt
    plt.close(fig)
    plot_replay(rep, tmp_path / "x.png")
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
