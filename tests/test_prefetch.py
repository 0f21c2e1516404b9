"""Experts read ahead from a prediction (libk3.model.predict, libk3.stream.experts): the
guesses never displace the cache, never change a logit at any budget or thread count, and
the trace of a run prices them offline exactly as the live cache counted them."""

from __future__ import annotations

import json
import struct
import subprocess

import numba
import numpy as np
import pytest

from libk3.engine.session import open_session
from libk3.errors import FormatError
from libk3.io.checkpoint import Checkpoint
from libk3.io.direct import FileSet, window_bytes
from libk3.stream.experts import ExpertCache
from libk3.trace import format as tr
from libk3.trace.prediction import price_prediction, visits
from tests.scripts import k3, k3trace

PROMPT = [5, 17, 300, 42]
FED = [7, 9, 11, 13, 2]


def test_guesses_never_displace_the_cache_and_land_the_right_bytes(small_dir):
    """Catches a read-ahead that evicts what the cache holds (its policy would then hit
    less than a cache of its policy slots without guesses), hands a guess's slot to the
    wrong expert, or counts bytes it did not read."""
    with Checkpoint.open(small_dir) as ckpt:
        cfg = ckpt.config
        slot, k = window_bytes(cfg.expert_bytes), cfg.num_experts_per_token
        files = FileSet()
        main, staged = k + 3, 5
        ahead = ExpertCache(cfg, ckpt.expert_table(), (main + staged) * slot, files, 3,
                            prefetch=staged)
        plain = ExpertCache(cfg, ckpt.expert_table(), main * slot, files, 3)
        assert ahead.n_slots == plain.n_slots == main and ahead.prefetch_slots == staged
        rng = np.random.default_rng(1)
        for step in range(60):
            L = int(rng.integers(1, cfg.num_hidden_layers))
            ids = rng.choice(cfg.num_experts, size=int(rng.integers(1, main + 1)), replace=False)
            guess = np.r_[ids[:int(rng.integers(0, ids.size + 1))],
                          rng.choice(cfg.num_experts, size=3)]      # some right, some wrong
            if step % 4:
                ahead.prefetch(L, rng.permutation(guess))
            got = ahead.fetch(L, ids)
            plain.fetch(L, ids)
            for e in ids:
                run = ckpt.expert_run(L, int(e))
                assert b"".join(a.tobytes() for a in got[int(e)]) == \
                    ckpt.read_span(run.path, run.offset, run.nbytes).tobytes()
        a, p = ahead.stats, plain.stats
        assert [a[x] for x in ("requests", "hits", "misses", "evictions")] == \
            [p[x] for x in ("requests", "hits", "misses", "evictions")]
        assert 0 < a["prefetch_used"] <= a["prefetch_reads"] and a["prefetch_hits"] > 0
        wasted = a["prefetch_bytes_wasted"] // cfg.expert_bytes
        assert a["prefetch_reads"] == a["prefetch_used"] + wasted + a["prefetch_cancelled"]
        assert a["bytes_read"] == (a["misses"] + wasted) * cfg.expert_bytes
        ahead.close(), plain.close(), files.close()


def _logits(model, prefetch, extra):
    with Checkpoint.open(model) as ckpt:
        cfg = ckpt.config
    s = open_session(model, trunk_bytes=10 ** 10, prefetch_experts=prefetch,
                     cache_bytes=window_bytes(cfg.expert_bytes)
                     * (cfg.num_experts_per_token + 1 + extra))
    try:
        st = s.new_state()
        out = [s.forward(PROMPT, st)] + [s.forward([t], st, phase="decode") for t in FED]
        return np.concatenate(out), s.weights.stats()["experts"]
    finally:
        s.weights.close()


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_prediction_never_changes_a_logit_at_any_budget_or_thread_count(model, tiny_dir,
                                                                        small_dir):
    """Catches a guess whose bytes reach the arithmetic in place of the routed expert's,
    or a prediction that alters the state: logits byte-identical with prediction off, on
    at several caps and cache sizes, on 1 and 2 threads; and the guesses were used."""
    d = {"tiny": tiny_dir, "small": small_dir}[model]
    want, _ = _logits(d, 0, 4)
    threads = [1, 2] if numba.config.NUMBA_NUM_THREADS >= 2 else [1]
    before = numba.get_num_threads()
    try:
        for n in threads:
            numba.set_num_threads(n)
            for prefetch, extra in ((None, 4), (1, 4), (64, 12), (None, 0)):
                got, st = _logits(d, prefetch, extra)
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (n, prefetch)
                if extra:
                    assert st["prefetch_used"] > 0 and st["prefetch_predictions"] > 0
    finally:
        numba.set_num_threads(before)


def _flags(model, extra=4, prefetch=None):
    with Checkpoint.open(model) as ckpt:
        cfg = ckpt.config
    k = cfg.num_experts_per_token
    slots = k + 1 + extra + (k if prefetch is None else prefetch)
    return cfg, slots, ["--trunk-gb", "10", "--cache-gb",
                        f"{slots * window_bytes(cfg.expert_bytes) / 1e9:.9f}"]


def test_k3_run_reports_prediction_and_its_trace_prices_it_exactly(small_dir, tmp_path):
    """Catches a front end that loses the option or the figures, logits that move with
    prediction on, or a trace whose offline pricing (k3-trace predict) disagrees with
    what the live cache counted: predictions, hits, reads started and reads used."""
    cfg, slots, flags = _flags(small_dir)
    runs = {}
    for name, extra in (("off", ["--prefetch-experts", 0]), ("on", ["--trace", tmp_path / "t.k3trace"])):
        p = k3(small_dir, "--ids", "4,8,15,16,23,42", "--gen", 8, *flags, *extra,
               "--logits-out", tmp_path / f"{name}.npy", "--report-json", tmp_path / f"{name}.json")
        assert p.returncode == 0, p.stderr
        runs[name] = (np.load(tmp_path / f"{name}.npy"),
                      json.loads((tmp_path / f"{name}.json").read_text()), p.stderr)
    (lo, off, _), (la, on, text) = runs["off"], runs["on"]
    assert np.array_equal(lo.view(np.uint32), la.view(np.uint32))
    assert on["generated_ids"] == off["generated_ids"]
    assert off["prefetch_predictions"] == 0 and off["prefetch_slots"] == 0
    assert on["prefetch_slots"] == cfg.num_experts_per_token
    assert on["prefetch_predictions"] > 0 and 0 <= on["prefetch_hit_rate"] <= 1
    assert on["expert_wait_seconds"] >= 0 and "prefetch:" in text
    q = k3trace("predict", tmp_path / "t.k3trace", "--slots", slots, "--prefetch",
                cfg.num_experts_per_token, "--json")
    assert q.returncode == 0, q.stderr
    doc = json.loads(q.stdout)
    rep = doc["with"]
    assert [rep[x] for x in ("predictions", "predicted", "hits", "reads", "used")] == \
        [on[x] for x in ("prefetch_predictions", "prefetch_predicted", "prefetch_hits",
                         "prefetch_reads", "prefetch_used")]
    assert doc["requests"] == on["expert_requests"]
    assert rep["misses"] == on["expert_requests"] - round(on["cache_hit_rate"]
                                                          * on["expert_requests"])
    r = tr.TraceReader(tmp_path / "t.k3trace")
    assert r.version == 2
    assert (r.read_all(predictions=True)["phase"] == tr.PHASE_PREDICTED).sum() > 0
    assert (r.read_all()["phase"] == tr.PHASE_PREDICTED).sum() == 0


def _v1(path, out):
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack("<I", 1)
    out.write_bytes(bytes(data))
    return out


def test_old_traces_still_read_and_replay_and_v1_cannot_hold_predictions(tmp_path):
    """Catches a reader that refuses version 1 files (every trace recorded before
    predictions), counts predicted records as requests, or lets a v1 file carry them."""
    h = tr.TraceHeader(checkpoint="c", expert_bytes=10, n_layers=3, n_experts=6, top_k=2,
                       source="k3-run", created_by="t")
    plain, mixed = tmp_path / "p.k3trace", tmp_path / "m.k3trace"
    with tr.TraceWriter(plain, h) as w:
        w.append(0, tr.PHASE_DECODE, 1, [1, 2])
        w.append(0, tr.PHASE_DECODE, 2, [3, 4])
    with tr.TraceWriter(mixed, h) as w:
        w.append(0, tr.PHASE_PREDICTED, 1, [1, 5])
        w.append(0, tr.PHASE_DECODE, 1, [1, 2])
        w.append(0, tr.PHASE_PREDICTED, 2, [3, 4])
        w.append(0, tr.PHASE_DECODE, 2, [3, 4])
    old = tr.TraceReader(_v1(plain, tmp_path / "old.k3trace"))
    assert old.version == 1
    assert old.layer_expert_keys().tolist() == tr.TraceReader(plain).layer_expert_keys().tolist()
    assert tr.TraceReader(mixed).layer_expert_keys().tolist() == [7, 8, 15, 16]
    assert [(L, None if g is None else g.tolist(), r.tolist()) for L, g, r in
            visits(tr.TraceReader(mixed).read_all(predictions=True))] == \
        [(1, [1, 5], [1, 2]), (2, [3, 4], [3, 4])]
    rep = price_prediction(tr.TraceReader(mixed), 5, policy="lru", cap=2)
    assert rep["staging_slots"] == 2 and rep["with"]["hits"] == 3 and rep["with"]["used"] == 3
    assert rep["with"]["bytes_wasted"] == 10 and rep["without"]["misses"] == 4
    with pytest.raises(FormatError, match="no predicted records"):
        price_prediction(old, 5, policy="lru", cap=2)
    with pytest.raises(FormatError, match="out-of-range record"):
        tr.TraceReader(_v1(mixed, tmp_path / "bad.k3trace")).read_all()


def test_trace_size_prices_prediction_per_split(tiny_dir, tmp_path):
    """Catches `k3-trace size --prefetch` pricing a split unlike `k3-trace predict` at the
    same slots (another replay, another cap), losing the read-ahead's extra reads, or
    sizing a trace without predictions as if it had them (it must refuse)."""
    cfg, slots, flags = _flags(tiny_dir)
    pk = tmp_path / "pack"
    assert subprocess.run(["k3-pack", str(tiny_dir), str(pk), "-q"], capture_output=True,
                          timeout=600).returncode == 0
    for name, extra in (("on", []), ("off", ["--prefetch-experts", 0])):
        p = k3(tiny_dir, "--ids", "4,8,15,16,23,42", "--gen", 6, *flags, "--pack", pk,
               "--trace", tmp_path / f"{name}.k3trace", *extra)
        assert p.returncode == 0, p.stderr
    k = cfg.num_experts_per_token
    budget = 2 * slots * window_bytes(cfg.expert_bytes) + 10 ** 7
    q = k3trace("size", tmp_path / "on.k3trace", "--budget-gb", f"{budget / 1e9:.9f}",
                "--pack", pk, "--seq-mbps", 1000, "--rand-mbps", 500, "--prefetch", k, "--json")
    assert q.returncode == 0, q.stderr
    rep = json.loads(q.stdout)
    rows = [r for r in rep["splits"] if r["feasible"]]
    assert rows and rep["prefetch"] == k
    for r in rows[:3]:
        pr = r["prefetch"]
        want = price_prediction(tr.TraceReader(tmp_path / "on.k3trace"), r["cache_slots"],
                                policy=rep["policy"], cap=k)["with"]
        assert pr["expert_bytes_per_token"] * rep["tokens"] == pytest.approx(want["bytes_read"])
        assert pr["expert_wait_bytes_per_token"] * rep["tokens"] == \
            pytest.approx(want["wait_bytes"])
        assert pr["expert_wait_bytes_per_token"] <= pr["expert_bytes_per_token"]
    q = k3trace("size", tmp_path / "off.k3trace", "--budget-gb", f"{budget / 1e9:.9f}",
                "--pack", pk, "--seq-mbps", 1000, "--rand-mbps", 500, "--prefetch", k)
    assert q.returncode != 0 and "no predicted records" in q.stderr
    assert len(q.stderr.strip().splitlines()) == 1
