"""A batch run's pace and deadline admission (issue 30): the pass-cost fit, the finish
time the lockstep scheduler really takes, and ticks that always make progress."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libk3.run import batch_run, runner
from libk3.engine.generate import GenSettings
from libk3.engine.core import EngineCore, Request
from libk3.engine.pace import SAFETY, Pace, Work
from libk3.model import forward as forward_mod

from .test_batch_cron import write_batch
from .test_progress import Clock


class FakeForward:
    """Logits of zeros for every fed row; each pass advances ``clock`` by a + b * tokens."""

    def __init__(self, clock, a, b, vocab=8):
        self.clock, self.a, self.b, self.vocab = clock, a, b, vocab

    def run(self, segs):
        tokens = sum(len(s.ids) for s in segs)
        self.clock.t += self.a + self.b * tokens
        return [np.zeros((len(s.ids) if s.all_logits else 1, self.vocab), np.float32)
                for s in segs]


def test_fit_recovers_the_pass_cost():
    pace = Pace()
    pace.record(0, 1, 9.0)                                   # warm-up: left out
    for p, w in [(0, 1), (0, 1), (64, 1), (0, 2), (0, 3), (60, 3), (0, 4), (0, 1)]:
        pace.record(p, w, 0.5 + 0.1 * w + 0.01 * p)
    a, b, bp, stretch = pace._fit()
    assert (a, b, bp) == pytest.approx((0.5, 0.1, 0.01)) and stretch == SAFETY
    # one pass feeding 10 prompt tokens beside 2 decoding sequences
    assert pace.finish([Work(10, 1), Work(0, 1), Work(0, 1)], 64) == \
        pytest.approx((0.5 + 0.2 + 0.1) * SAFETY)


def test_fit_of_one_pass_size_is_half_fixed_and_first_pass_left_out():
    pace = Pace()
    pace.record(64, 0, 100.0)            # the run's first pass: cold weights, left out
    assert not pace.measured
    pace.record(0, 2, 1.0)
    pace.record(0, 2, 1.0)
    a, b, bp, stretch = pace._fit()
    assert pace.measured and (a + 4 * b) * stretch == pytest.approx(1.5 * SAFETY)


def test_stretch_follows_how_far_passes_strayed():
    """Catches an estimate that ignores noise: passes 1.5x the fit's line on a tenth of
    the window stretch every estimate by 1.5 (a busier machine admits less)."""
    pace = Pace()
    pace.record(0, 1, 0.0)
    for i in range(40):
        w = 1 + i % 4
        pace.record(0, w, (1.0 + w) * (1.6 if i % 5 == 0 else 1.0))
    assert pace._fit()[3] > 1.3


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 150), st.integers(0, 30)), min_size=1, max_size=5),
       st.integers(1, 70), st.floats(0.0, 2.0), st.floats(0.001, 0.1))
def test_finish_is_the_time_lockstep_takes(works, chunk, a, b):
    """Catches a simulation that fills passes unlike plan_pass (prefill shared in slot
    order, the last chunk's logits giving the first token, one token per decoder)."""
    clock = Clock()
    fwd = FakeForward(clock, a, b)
    ls = EngineCore(fwd, lambda n: types.SimpleNamespace(pos=0, ids=[]), len(works),
                    chunk=chunk, clock=clock)
    for i, (p, g) in enumerate(works):
        ls.add(Request(i, list(range(1, p + 1)), GenSettings(gen=g)))
    pace = Pace()
    pace.record(0, 1, 0.0)               # warm-up slot
    for w in (1, 2):
        pace.record(0, w, a + b * w)
    pace.record(chunk, 1, a + b * (chunk + 1))
    est = pace.finish([Work(p, g) for p, g in works], chunk) / SAFETY
    while ls.lanes:
        ls.step()
    assert est == pytest.approx(clock.t, rel=1e-6, abs=1e-9)


class PacedBatch:
    """A batch file of ``n`` prompts of ``gen`` tokens on the tiny model, resident, at
    ``width``, every real forward pass costing a + b * tokens on ``clock``."""

    def __init__(self, tiny_dir, tmp_path, monkeypatch, n, gen, a, b, width=1):
        self.batch = write_batch(tmp_path / "b.jsonl", n, gen=gen)
        self.results = tmp_path / "r.jsonl"
        self.opts = runner.RunOptions(model=str(tiny_dir), resident=True, batch_width=width)
        self.base = runner.settings_from(gen=gen, temperature=0.0, top_p=1.0, seed=0)
        self.clock = Clock()
        real = forward_mod.Forward.run

        def timed(fwd, segments):
            self.clock.t += a + b * sum(len(s.ids) for s in segments)
            return real(fwd, segments)
        monkeypatch.setattr(forward_mod.Forward, "run", timed)

    def limits(self, deadline: float, started: float = 0.0):
        return batch_run.BatchLimits(deadline=deadline, clock=self.clock, started=started)

    def run(self, limits=None, said=None, results=None) -> dict:
        """run_batch's summary; its lines to ``said`` (a list), its results to
        ``results`` (default: ``self.results``)."""
        return batch_run.run_batch(self.opts, self.batch, results or self.results, self.base,
                                   [].append if said is None else said.append, limits)


@pytest.fixture
def paced(tiny_dir, tmp_path, monkeypatch):
    """``paced(n, gen, a, b, width=1)``: a PacedBatch."""
    return lambda *args, **kw: PacedBatch(tiny_dir, tmp_path, monkeypatch, *args, **kw)


def _gen_ids(path):
    return {json.loads(x)["id"]: json.loads(x)["generated_ids"]
            for x in path.read_text().splitlines()}


@pytest.mark.parametrize("width", [1, 4])
def test_deadline_ticks_always_finish_prompts(paced, tmp_path, width):
    """Catches admission that fills every slot whatever the deadline (the walk that found
    issue 30: every tick '0 done', its tokens thrown away): each tick finishes prompts,
    cuts none off, and the ticks together give the undisturbed run's results."""
    pb = paced(12, 12, 1.0, 0.1, width)
    clock = pb.clock
    # about a third of the batch's passes fit in one tick at width 1
    span = 12 * 12 * 1.3 / 3 / (1 if width == 1 else 2)
    ticks = []
    while len(ticks) < 6:
        limits = pb.limits(clock.t + span, started=clock.t)
        s = pb.run(limits)
        ticks.append((s["done"], s["cut_off"], s["discarded_tokens"]))
        assert clock.t <= limits.deadline
        if s["stopped"] is None:
            break
    assert all(done > 0 and cut == 0 and lost == 0 for done, cut, lost in ticks), ticks
    assert 2 <= len(ticks) <= 4, ticks
    ref = tmp_path / "ref.jsonl"
    pb.run(results=ref)
    assert _gen_ids(pb.results) == _gen_ids(ref)


def test_deadline_too_short_for_one_prompt_says_what_it_would_need(paced):
    """Catches a tick that ends with nothing done and no word why."""
    pb, said = paced(2, 200, 1.0, 0.0), []
    s = pb.run(pb.limits(60.0), said)
    assert (s["done"], s["stopped"], s["remaining"]) == (0, "deadline", 2)
    assert len(said) == 1 and "'p0'" in said[0] and "at least 4 min" in said[0], said


@pytest.mark.parametrize("width", [1, 4])
def test_deadline_tick_too_short_to_measure_says_what_would_fit(paced, width):
    """Catches a tick too short for even the pace to be measured (3 s at the floor)
    counting a prompt it never started as cut off and ending without saying what
    deadline would fit (or saying the deadline passed before the first prompt started,
    when one had): one prompt is cut, the other left for the next run, and the line
    names the prompt and a deadline from the passes seen."""
    pb, said = paced(2, 200, 1.0, 0.0, width), []
    s = pb.run(pb.limits(2.5), said)
    assert (s["done"], s["stopped"], s["remaining"]) == (0, "deadline", 2), s
    assert s["cut_off"] == 1, s
    assert len(said) == 1 and "'p0'" in said[0] and "at least 4 min" in said[0], said


def test_deadline_admission_widens_one_lane_at_a_time_until_the_width_is_priced(paced):
    """Catches admission pricing a wide pass from one width seen (half of it taken as
    fixed): where each sequence costs its share of a pass (compute-bound, a loaded
    machine), the first tick filled the lanes and cut prompts in flight at the deadline
    (4 cut, 40 tokens discarded here). Now none is cut and the tick finishes prompts;
    where passes cost the same whatever their width, ticks still fill lanes
    (test_deadline_ticks_always_finish_prompts, control)."""
    pb = paced(24, 12, 0.1, 1.0, width=8)                 # a pass costs its tokens
    s = pb.run(pb.limits(60.0))
    assert (s["cut_off"], s["discarded_tokens"]) == (0, 0), s
    assert s["done"] >= 2 and pb.clock.t <= 60.0, (s["done"], pb.clock.t)
