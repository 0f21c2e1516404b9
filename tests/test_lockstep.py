"""The engine core in lockstep (issues 12, 45): every prompt's ids and logits equal running
it alone (an independent loop of plain forward calls, ``core_drive.reference_generate``),
whatever the width, its neighbours, when it joined, the budget or the thread count."""

from __future__ import annotations

import dataclasses
import types

import numba
import numpy as np
import pytest

from libk3.engine.core import Request, plan_pass
from libk3.engine.generate import GenSettings, generate, run_requests
from libk3.engine.session import open_session
from libk3.io.checkpoint import Checkpoint
from libk3.model.forward import Segment
from libk3.model.state import State
from libk3.budget import ModelSizes, minimum_budget

from .core_drive import reference_generate

CHUNK = 4          # small, so long prompts take several passes and share them


def _jobs(vocab: int, stop_early: int | None = None) -> list:
    """Seven prompts of mixed lengths (one of them several chunks), gens and samplers;
    the fifth stops early on ``stop_early`` (a token it generates, found by the caller)."""
    rng = np.random.default_rng(7)
    lens = [3, 11, 1, 6, 9, 2, 5]
    gens = [6, 3, 8, 0, 7, 5, 4]
    samp = [(0.0, 1.0, 0), (0.8, 0.9, 1), (1.3, 1.0, 2), (0.0, 1.0, 3), (0.7, 0.5, 4),
            (0.0, 1.0, 5), (1.0, 0.95, 6)]
    jobs = []
    for i, (n, g, (temp, top_p, seed)) in enumerate(zip(lens, gens, samp)):
        s = GenSettings(gen=g, temperature=temp, top_p=top_p, seed=seed, prefill_chunk=CHUNK)
        if i == 4 and stop_early is not None:
            s = dataclasses.replace(s, stop_ids=(stop_early,))
        jobs.append(Request(i, rng.integers(0, vocab, n).tolist(), s, logits=True))
    return jobs


def _alone(sess, job):
    return generate(sess.forward, sess.new_state(), job.prompt_ids, job.settings,
                    keep_logits=True)


def _lockstep(sess, jobs, width, join_prefill=True):
    for job in jobs:
        job.state = None                    # a fresh State for each run
    return run_requests(sess.forward, lambda n: State(sess.cfg, capacity=n), jobs, width,
                        chunk=CHUNK, join_prefill=join_prefill)


def _streamed(model_dir):
    """The smallest budget that works: every layer through the ring, top_k + 1 slots."""
    with Checkpoint.open(model_dir) as ckpt:
        floor = minimum_budget(ModelSizes.from_checkpoint(ckpt))
    return open_session(model_dir, trunk_bytes=floor.trunk_bytes + 1,
                        cache_bytes=floor.cache_bytes + 1)


def _half_streamed(model_dir):
    """Half the trunk (some layers pinned, the rest through the ring) and an eighth of the
    experts cached: streamed, at a fraction of the floor's run time on small."""
    with Checkpoint.open(model_dir) as ckpt:
        sizes = ModelSizes.from_checkpoint(ckpt)
    return open_session(model_dir, trunk_bytes=sizes.trunk_bytes // 2,
                        cache_bytes=sizes.cache_all_bytes // 8)


# The floor runs on tiny (same code paths: one ring slot, top_k + 1 expert slots, a union
# larger than the cache); small at the floor tripled this module's time for no new path.
@pytest.fixture(scope="module", params=["tiny-resident", "tiny-floor", "small-half"])
def sess(request, tiny_dir, small_dir):
    which, where = request.param.split("-")
    d = tiny_dir if which == "tiny" else small_dir
    s = {"resident": open_session, "floor": _streamed, "half": _half_streamed}[where](d)
    yield s
    s.weights.close()


@pytest.fixture(scope="module")
def jobs_and_alone(sess):
    """The jobs with an early stop, and each run alone (the reference)."""
    probe = _alone(sess, _jobs(sess.cfg.vocab_size)[4])
    jobs = _jobs(sess.cfg.vocab_size, stop_early=probe.generated_ids[2])
    return jobs, [_alone(sess, j) for j in jobs]


def test_core_at_width_one_equals_an_independent_loop(sess, jobs_and_alone):
    """Catches the core's one-prompt driver (``generate``) drifting from a plain loop of
    forward calls: a chunk fed twice, a sampler seeded at the wrong position, the last
    token not fed, a stop not honoured. Ids, stop reasons and logits bytes are equal."""
    jobs, alone = jobs_and_alone
    for job, got in zip(jobs, alone):
        ids, reason, logits = reference_generate(sess.forward, sess.new_state(),
                                                 job.prompt_ids, job.settings)
        assert got.generated_ids == ids and got.stop_reason == reason, job.tag
        assert np.array_equal(got.logits.view(np.uint32), logits.view(np.uint32))


@pytest.mark.parametrize("width", [1, 2, 3, 5])
def test_lockstep_ids_and_logits_equal_alone(sess, jobs_and_alone, width):
    """Catches any per-token arithmetic that depends on the other sequences of a pass
    (pairing in the block kernels, a shared state, a mixed-up cache row or sampler), a
    prompt that joins mid-way on a dirty slot, or stop handling that differs from
    ``generate``: ids and logits bytes equal the prompt run alone, at widths 1, 2, 3, 5."""
    jobs, alone = jobs_and_alone
    assert alone[4].stop_reason == "stop_id" and len(alone[4].generated_ids) == 3
    done, stats = _lockstep(sess, jobs, width)
    assert sorted(done) == list(range(len(jobs)))
    for job, want in zip(jobs, alone):
        got = done[job.tag]
        assert got.generated_ids == want.generated_ids, job.tag
        assert got.stop_reason == want.stop_reason
        n = got.logits.shape[0]              # the last generated token is never fed
        assert n == len(job.prompt_ids) + max(len(want.generated_ids) - 1, 0)
        assert np.array_equal(got.logits.view(np.uint32), want.logits[:n].view(np.uint32))
    assert stats.max_active == min(width, len(jobs))


def test_lockstep_prefill_as_its_own_pass_gives_the_same_bytes(sess, jobs_and_alone):
    """Catches a scheduler mode (newcomers' prefill not joining the decode step) that
    feeds a token twice or skips one."""
    jobs, alone = jobs_and_alone
    done, _ = _lockstep(sess, jobs, 3, join_prefill=False)
    for job, want in zip(jobs, alone):
        n = done[job.tag].logits.shape[0]
        assert done[job.tag].generated_ids == want.generated_ids
        assert np.array_equal(done[job.tag].logits.view(np.uint32),
                              want.logits[:n].view(np.uint32))


def test_lockstep_bit_identical_at_1_and_2_threads(tiny_dir):
    """Catches a multi-sequence pass whose result depends on the thread count."""
    s = open_session(tiny_dir)
    jobs = _jobs(s.cfg.vocab_size)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one, _ = _lockstep(s, jobs, 4)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two, _ = _lockstep(s, jobs, 4)
    finally:
        numba.set_num_threads(before)
    for tag in one:
        assert np.array_equal(one[tag].logits.view(np.uint32), two[tag].logits.view(np.uint32))


def test_lockstep_finished_prompt_leaves_and_next_takes_its_slot(tiny_dir):
    """Catches a batch that waits for the slowest sequence before refilling (a lockstep
    'generation' barrier): the short job finishes first and a queued job starts while
    the long one is still decoding."""
    s = open_session(tiny_dir)
    g = lambda n: GenSettings(gen=n, prefill_chunk=CHUNK)  # noqa: E731
    jobs = [Request("long", [1, 2, 3], g(12)), Request("short", [4, 5], g(1)),
            Request("queued", [6], g(2))]
    order, started = [], []
    pos = lambda: s.forward.passes  # noqa: E731

    def new_state(n):                       # called as a job takes a slot
        started.append(pos())
        return State(s.cfg, capacity=n)

    run_requests(s.forward, new_state, jobs, 2, chunk=CHUNK,
                 on_done=lambda job, res: order.append((job.tag, pos())))
    assert [t for t, _ in order] == ["short", "queued", "long"]
    assert started[2] == dict(order)["short"]          # took the freed slot at once


def test_lockstep_expert_union_is_fetched_once_per_pass(small_dir):
    """Catches experts fetched per sequence instead of once for the pass's union: in one
    decode pass of four sequences the cache sees each distinct expert of a layer once."""
    s = _streamed(small_dir)
    try:
        states = [State(s.cfg) for _ in range(4)]
        for i, st in enumerate(states):
            s.forward([10 + i, 20 + i], st)
        before = dict(s.weights.stats()["experts"])
        union0 = list(s.forward.expert_union)
        s.forward.run([Segment([30 + i], st, phase="decode") for i, st in enumerate(states)])
        after = s.weights.stats()["experts"]
        union = sum(s.forward.expert_union) - sum(union0)
        k, moe = s.cfg.num_experts_per_token, len(s.cfg.moe_layers)
        assert after["requests"] - before["requests"] == union
        assert moe * k <= union < 4 * moe * k             # the sequences shared some
    finally:
        s.weights.close()


def test_lockstep_refuses_two_segments_on_one_state(tiny_dir):
    """Catches a pass that lets two segments advance one State (positions would clash)."""
    s = open_session(tiny_dir)
    st = State(s.cfg)
    with pytest.raises(ValueError, match="share a State"):
        s.forward.run([Segment([1], st), Segment([2], st)])
    s.forward.run([Segment([1], st), Segment([2], State(s.cfg))])     # control


def test_plan_pass_shares_one_chunk_among_newcomers():
    """Catches a pass that exceeds the prefill chunk (activations beyond the reserve) or
    leaves a decoding sequence out while joining is on."""
    class L:
        def __init__(self, n, fed, nxt=None, keep_at=()):
            self.prompt, self.fed, self.next = list(range(n)), fed, nxt
            self.req = types.SimpleNamespace(keep_at=keep_at)

        @property
        def prefilling(self):
            return self.fed < len(self.prompt)
    a, b, c, d = L(3, 3, 9), L(6, 1), L(5, 0), L(2, 2, 8)
    plan = plan_pass([a, b, c, d], 7)
    assert [(x is b, ids, n) for x, ids, n in plan[:2]] == [(True, [1, 2, 3, 4, 5], 5),
                                                            (False, [0, 1], 2)]
    assert [(x, ids) for x, ids, _ in plan[2:]] == [(a, [9]), (d, [8])]
    assert [x for x, _, _ in plan_pass([a, b, c, d], 7, join_prefill=False)] == [b, c]
    e = L(6, 1, keep_at=(3, 5))                    # a pass ends where a prefix is kept
    assert [(ids, n) for _, ids, n in plan_pass([e, c], 7)] == [([1, 2], 2), ([0, 1, 2, 3, 4], 5)]
    e.fed = 3
    assert plan_pass([e], 7)[0][1:] == ([3, 4], 2)
    e.fed = 5
    assert plan_pass([e], 7)[0][1:] == ([5], 1)


class _Oracle:
    """Proposes each sequence's true continuation (the runs alone), every third token
    spoiled, so lanes accept some proposals and reject others."""

    taps = None

    def __init__(self, truths, vocab):
        self.truths, self.vocab = truths, vocab

    def propose(self, state, anchor, n, pick):
        from libk3.speculate.speculative import Proposal
        fed = state.ids + [anchor]
        for t in self.truths:
            if t[:len(fed)] == fed:
                out = t[len(fed):len(fed) + n]
                return Proposal([(x + 1) % self.vocab if (len(fed) + j) % 3 == 0 else x
                                 for j, x in enumerate(out)])
        return Proposal([])

    def observe(self, state, taps):
        pass


@pytest.mark.parametrize("width", [1, 3])
def test_lockstep_with_drafting_equals_alone(sess, jobs_and_alone, width):
    """Catches a lane whose verify pass shares rows with another lane's, a commit that
    keeps a rejected proposal, or a stop inside accepted proposals that is not honoured:
    every lane drafts (greedy and sampled), ids and logits bytes equal the runs alone."""
    from libk3.speculate.speculative import Drafting, Width

    class Every(Width):             # verify every proposal: this test is about exactness
        def choose(self, confidence, others=0):
            return len(confidence), 2.0
    jobs, alone = jobs_and_alone
    truths = [j.prompt_ids + a.generated_ids for j, a in zip(jobs, alone)]
    drafting = Drafting(_Oracle(truths, sess.cfg.vocab_size), 4)
    drafting.width = Every(4)
    for job in jobs:
        job.state = None
    done, _ = run_requests(sess.forward, lambda n: State(sess.cfg, capacity=n), jobs, width,
                           chunk=CHUNK, drafting=drafting)
    for job, want in zip(jobs, alone):
        got = done[job.tag]
        assert got.generated_ids == want.generated_ids, job.tag
        assert got.stop_reason == want.stop_reason
        n = got.logits.shape[0]
        assert n >= len(job.prompt_ids) + max(len(want.generated_ids) - 1, 0)
        assert np.array_equal(got.logits.view(np.uint32), want.logits[:n].view(np.uint32))
    st = drafting.stats
    assert 0 < st.accepted < st.drafted
