"""The trunk ring and the expert cache, unit level: planning, slot safety, resync."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from libk3.model.weights import load_layer
from libk3.errors import BudgetError
from libk3.io.checkpoint import Checkpoint
from libk3.io.direct import FileSet, window_bytes
from libk3.stream.experts import ExpertCache
from libk3.budget import plan_trunk
from libk3.stream.trunk import runs_from_checkpoint
from libk3.stream.trunk_modes import open_trunk


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=20), st.integers(0, 200_000))
def test_plan_trunk_never_exceeds_the_budget(sizes, budget):
    """Catches a plan whose pins plus ring slots overflow the budget, or a ring that
    cannot hold the layers it must carry."""
    try:
        plan = plan_trunk(sizes, budget)
        pinned, ring = plan.pinned, plan.slots
    except BudgetError:
        assert budget < max(sizes)
        return
    assert sum(sizes[i] for i in pinned) + sum(ring) <= max(budget, sum(sizes))
    unpinned = [sizes[i] for i in range(len(sizes)) if i not in pinned]
    if unpinned:
        assert 1 <= len(ring) <= 2 and ring[0] >= max(unpinned)
        if len(ring) == 2:
            assert sorted(unpinned, reverse=True)[:2] == list(ring)
    else:
        assert ring == ()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=2, max_size=12), st.integers(0, 120_000))
def test_plan_trunk_more_budget_never_streams_more(sizes, budget):
    """Catches a non-monotone planner: more memory never means more reads, except when it
    buys the second ring slot (read-ahead overlap is worth more than a small pin)."""
    def plan(b):
        try:
            plan = plan_trunk(sizes, b)
            pinned, ring = plan.pinned, plan.slots
        except BudgetError:
            return None
        return sum(s for i, s in enumerate(sizes) if i not in pinned), len(ring)
    a, b = plan(budget), plan(budget + 5_000)
    if a is not None:
        assert b is not None
        if b[1] == a[1] or b[1] == 0:
            assert b[0] <= a[0]
        else:
            assert b[1] == 2 and a[1] == 1


def _check_bound(bound, want):
    """Same names, dtypes, shapes and bits as the resident binding."""
    assert set(bound) == set(want)
    for sfx, arr in bound.items():
        assert arr.dtype == want[sfx].dtype and arr.shape == want[sfx].shape, sfx
        assert arr.tobytes() == want[sfx].tobytes(), sfx


@pytest.mark.parametrize("slots", [1, 2])
def test_trunk_ring_binds_the_right_bytes_across_passes_and_aborts(tiny_dir, slots):
    """Catches a read-ahead that overwrites a slot in use, hands out a stale layer after an
    aborted pass, or binds tensors at wrong offsets."""
    with Checkpoint.open(tiny_dir) as ckpt:
        runs = runs_from_checkpoint(ckpt)
        sizes = sorted((r.nbytes for r in runs), reverse=True)
        budget = sizes[0] if slots == 1 else sizes[0] + sizes[1]
        files = FileSet()
        ts = open_trunk(ckpt.config, runs, budget, files)
        assert ts.n_slots == slots and not ts.pinned_plan
        want = {L: load_layer(ckpt, ckpt.config, L) for L in range(len(runs))}
        order = list(range(13)) * 2 + [0, 1, 2] + list(range(13)) + [5, 6] + list(range(13))
        for L in order:                      # two full passes, an abort, a restart...
            bound = ts.layer(L)
            _check_bound(bound, want[L])
            ts.release(L)
        ts.close()
        files.close()


def test_floor_slot_reads_the_next_layer_ahead_and_counts_what_was_taken(tiny_dir):
    """Catches a one-slot ring that reads only when asked (its read then overlaps nothing
    the forward does between layers, such as the head at the end of a pass): once a layer
    is handed out, the next ring layer (after the last, the first) is being read, at the
    latest from its release on, before the forward asks for it; handing it out reads
    nothing more, and a read-ahead nobody takes is not counted as read (so a run's report
    does not depend on when it closed)."""
    with Checkpoint.open(tiny_dir) as ckpt:
        runs = runs_from_checkpoint(ckpt)
        ts = open_trunk(ckpt.config, runs, max(r.nbytes for r in runs), FileSet())
        assert ts.n_slots == 1
        want = {L: load_layer(ckpt, ckpt.config, L) for L in range(len(runs))}
        counted = 0
        for L in list(range(len(runs))) * 2:
            ahead = ts._fill
            lw = ts.layer(L)
            assert ahead is None or lw._fill is ahead, L        # the read-ahead is handed out
            _check_bound(lw, want[L])
            nxt = (L + 1) % len(runs)
            assert ts._fill.layer == nxt
            ts.release(L)
            counted += runs[L].nbytes
            assert ts.stats["bytes_read"] == counted, L
            ts._fill.future.result()                       # read before it is asked for
            assert ts._fill.tally["bytes_read"] == runs[nxt].nbytes
        ts.close()
        assert ts.stats["bytes_read"] == counted


def _floor(ckpt, monkeypatch, piece=4096):
    """A one-slot streamer over ``ckpt``'s trunk runs reading in ``piece``-byte pieces."""
    from .floor_helpers import floor_streamer
    runs = runs_from_checkpoint(ckpt)
    ts, files = floor_streamer(ckpt.config, runs, max(r.nbytes for r in runs), monkeypatch,
                               piece)
    return ts, files, runs


def test_floor_reads_the_next_layer_into_the_room_beside_the_layer_in_use(tiny_dir, tmp_path,
                                                                         monkeypatch):
    """Catches a one-slot ring whose next layer waits for the release although the slot
    has room beside the layer in use (the disk then idles while the forward computes the
    layer's last tensors), and a read ahead that writes over the layer in use: over two
    passes, a next layer whose region is clear of the one in use is read whole before the
    release, one that overlaps it is not, and every layer in use keeps its bytes."""
    import time

    from libk3.io.direct import ALIGN, align_up
    from libk3.stream.trunk import LayerRun
    from .floor_helpers import within
    with Checkpoint.open(tiny_dir) as ckpt:
        ts, files, runs = _floor(ckpt, monkeypatch)
        ts.close()
        # layer 12's run behind 2x its size of padding in a file of its own: a slot three
        # times the other layers, so some fit beside the one in use and some do not
        r = runs[12]
        d = 2 * r.nbytes
        wide = tmp_path / "wide.bin"
        wide.write_bytes(bytes(d) + ckpt.read_span(r.path, r.offset, r.nbytes).tobytes())
        runs[12] = LayerRun(12, wide, 0, r.nbytes + d,
                            {k: (sub + d, nb, dt, sh) for k, (sub, nb, dt, sh) in r.tensors.items()})
        ts = open_trunk(ckpt.config, runs, runs[12].nbytes, files)
        assert ts.n_slots == 1
        want = {L: load_layer(ckpt, ckpt.config, L) for L in range(len(runs))}
        beside = over = 0
        for L in list(range(len(runs))) * 2:
            lw = ts.layer(L)
            use, ahead = lw._fill, ts._fill
            nxt = runs[ahead.layer]                    # the bytes its read writes
            written = ahead.at + align_up(nxt.offset % ALIGN + nxt.nbytes)
            clear = ahead.at >= use.at + ts._need[L] or written <= use.at
            if clear:
                within(ahead.future.result)            # read whole while L is in use
                beside += 1
            else:
                time.sleep(0.2)
                assert not ahead.future.done(), L      # waits for L's region
                over += 1
            _check_bound(lw, want[L])
            ts.release(L)
        assert beside and over
        ts.close()
        files.close()


def _first_and_last(run) -> tuple:
    """The run's first tensor and the first tensor whose bytes start past the first's
    end by a page (so they are in different pieces)."""
    order = sorted(run.tensors, key=lambda k: run.tensors[k][0])
    first = order[0]
    end = sum(run.tensors[first][:2])
    last = next(k for k in reversed(order) if run.tensors[k][0] >= end + 2 * 4096)
    return first, last


def test_floor_hands_out_a_layers_first_tensors_while_its_later_bytes_land(tiny_dir,
                                                                           monkeypatch):
    """Catches a floor slot handed out only once its whole layer is in (the forward then
    computes nothing while the layer's later tensors are read), and a tensor bound before
    its own bytes landed: with the reads of a layer's later pieces held, its first tensor
    comes with the right bytes and a later one waits; once released, every tensor is
    right."""
    from .floor_helpers import HeldReads, within
    with Checkpoint.open(tiny_dir) as ckpt:
        ts, files, runs = _floor(ckpt, monkeypatch)
        want = load_layer(ckpt, ckpt.config, 0)
        first, last = _first_and_last(runs[0])
        hold = HeldReads(files, runs[0].path, runs[0].offset + runs[0].tensors[last][0] - 4096)
        try:
            lw = within(lambda: ts.layer(0))
            got = within(lambda: lw[first])
            assert got.tobytes() == want[first].tobytes()
            with pytest.raises(AssertionError, match="still waiting"):
                within(lambda: lw[last], 1.0)
            assert hold.held
        finally:
            hold.release()
        _check_bound(lw, want)
        ts.release(0)
        ts.close()
        files.close()


def test_floor_read_failing_past_the_first_tensors_raises_when_they_are_asked_for(
        tiny_dir, monkeypatch):
    """Catches a failed read of a layer's later bytes that is lost (the forward computing
    on a slot that was never filled), or that leaves the slot unusable: the tensors
    before the failure are right, a later one raises the read's error, so does the
    release, and the next pass reads the layer again."""
    from libk3.errors import K3IOError
    from .floor_helpers import HeldReads
    with Checkpoint.open(tiny_dir) as ckpt:
        ts, files, runs = _floor(ckpt, monkeypatch)
        want = load_layer(ckpt, ckpt.config, 0)
        first, last = _first_and_last(runs[0])
        f = files.get(runs[0].path)
        read_window = f.read_window
        HeldReads(files, runs[0].path, runs[0].offset + runs[0].tensors[last][0] - 4096,
                  error=K3IOError("read failed: injected", path=runs[0].path))
        lw = ts.layer(0)
        assert lw[first].tobytes() == want[first].tobytes()
        with pytest.raises(K3IOError, match="injected"):
            lw[last]
        with pytest.raises(K3IOError, match="injected"):
            ts.release(0)
        f.read_window = read_window                       # the disk is back
        _check_bound(ts.layer(0), want)
        ts.release(0)
        ts.close()
        files.close()


def test_expert_cache_under_pressure_serves_the_right_bytes(small_dir):
    """Catches slot aliasing: with top_k + 1 slots, every fetched expert equals a direct
    read of its run, across many batches and evictions."""
    with Checkpoint.open(small_dir) as ckpt:
        cfg = ckpt.config
        files = FileSet()
        slots = cfg.num_experts_per_token + 1
        cache = ExpertCache(cfg, ckpt.expert_table(), slots * window_bytes(cfg.expert_bytes),
                            files, io_threads=3)
        rng = np.random.default_rng(0)
        for _ in range(40):
            L = int(rng.integers(1, cfg.num_hidden_layers))
            ids = rng.choice(cfg.num_experts, size=int(rng.integers(1, slots + 1)), replace=False)
            got = cache.fetch(L, ids)
            for e in ids:
                run = ckpt.expert_run(L, int(e))
                raw = ckpt.read_span(run.path, run.offset, run.nbytes)
                assert b"".join(a.tobytes() for a in got[int(e)]) == raw.tobytes()
        s = cache.stats
        assert s["requests"] == s["hits"] + s["misses"] and s["evictions"] > 0
        cache.close()
        files.close()


def test_expert_cache_refuses_fewer_than_top_k_plus_one_slots(small_dir):
    """Catches a cache that starts with too few slots to hold one layer's selection."""
    with Checkpoint.open(small_dir) as ckpt:
        cfg = ckpt.config
        with pytest.raises(BudgetError, match="top_k"):
            ExpertCache(cfg, ckpt.expert_table(),
                        cfg.num_experts_per_token * window_bytes(cfg.expert_bytes), FileSet(),
                        io_threads=1)


@pytest.mark.parametrize("direct", [True, False])
def test_read_window_pieces_in_flight_equal_one_read(direct, tmp_path):
    """Catches pieces landing at the wrong place, a lost last partial piece, or a window
    past the end of the file accepted, when the read-ahead keeps several pieces in flight."""
    from concurrent.futures import ThreadPoolExecutor

    from libk3.errors import CheckpointError
    from libk3.io.direct import YIELD_CHUNK, DirectFile, ReadGate, aligned_empty
    data = np.random.default_rng(3).integers(0, 256, 3 * YIELD_CHUNK + 5000, np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    f = DirectFile(path, use_direct=direct)
    gate = ReadGate()
    with ThreadPoolExecutor(max_workers=3) as pool:
        for off, n in ((0, data.size), (12345, data.size - 12345), (YIELD_CHUNK - 7, 2 * YIELD_CHUNK)):
            buf = aligned_empty(window_bytes(n))
            at = f.read_window(off, n, buf, yield_to=gate, pool=pool, depth=3)
            assert np.array_equal(buf[at:at + n], data[off:off + n]), (off, n)
        buf = aligned_empty(window_bytes(data.size))
        with pytest.raises(CheckpointError, match="ends early"):
            f.read_window(100, data.size, buf, yield_to=gate, pool=pool, depth=3)
    f.close()


def _mapping_of(addr: int) -> dict:
    """The /proc/self/smaps entry (fields and VmFlags) of the mapping holding ``addr``."""
    import re
    with open("/proc/self/smaps") as fh:
        for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", fh.read()):
            lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
            if lo <= addr < hi:
                fields = dict(re.findall(r"^(\w+):\s+(.*)$", block, re.M))
                return {**fields, "flags": fields.get("VmFlags", "").split()}
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize("nbytes", [1, 4096, 5000, (2 << 20) - 1, 2 << 20, (5 << 20) + 12345])
def test_aligned_empty_is_private_aligned_and_huge_page_advised(nbytes):
    """Catches buffers that direct reads cannot use (misaligned, short) and the shared
    anonymous mapping Python's mmap makes by default: shmem is never a transparent huge
    page, and reads into scattered 4 KiB pages went to the disk in ~700 KiB requests at
    half the rate (libk3.io.direct)."""
    import os
    import sys

    from libk3.io.direct import ALIGN, HUGE_PAGE, aligned_empty, align_up
    buf = aligned_empty(nbytes)
    addr = buf.ctypes.data
    assert buf.size == align_up(nbytes) and addr % ALIGN == 0
    buf[:] = 7                                         # writable, every byte
    if nbytes >= HUGE_PAGE:
        assert addr % HUGE_PAGE == 0
    if not sys.platform.startswith("linux"):
        pytest.skip("mapping flags are read from /proc/self/smaps")
    m = _mapping_of(addr)
    assert "sh" not in m["flags"]                      # private, not shmem
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if nbytes >= HUGE_PAGE and os.path.exists(thp) and "[never]" not in open(thp).read():
        assert "hg" in m["flags"]                      # MADV_HUGEPAGE on its whole pages
        assert m.get("THPeligible", "1").strip() == "1"


@pytest.mark.parametrize("pack", [False, True])
def test_a_closed_run_keeps_no_file_open(tiny_dir, tmp_path, pack):
    """Catches a streamed session whose close leaves the trunk's and the experts' files
    open (the shared FileSet was never closed: every in-process run, a server's or a
    test's, leaked one descriptor per shard until select() failed past fd 1024)."""
    from libk3.pack.writer import pack as write_pack
    from libk3.run.runner import RunOptions, open_run, settings_from

    tiny_pack = tmp_path / "tiny.pack"
    if pack:
        with Checkpoint.open(tiny_dir) as ckpt:
            write_pack(ckpt, tiny_pack, progress=False)

    def opened() -> set:
        out = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                out.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return out

    before = opened()
    opts = RunOptions(model=tiny_dir, pack=tiny_pack if pack else None, trunk_gb=0.001,
                      cache_gb=0.001)
    with open_run(opts) as run:
        run.generate([1, 2, 3], settings_from(1, 0.0, 1.0, 0))
    left = {p for p in opened() - before if str(tiny_dir) in p or str(tiny_pack) in p}
    assert left == set()
