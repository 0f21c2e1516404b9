"""The sampler's settings beyond temperature and top-p (formats/model/numerics.md section 12):
the logit bias, repetition, presence and frequency penalties, top-k and min-p, against a
brute-force oracle; and the engine's promise that they change no exactness: greedy is the argmax of
the adjusted logits, the same tokens at any thread count, with drafting, in lockstep."""

from __future__ import annotations

import collections
import dataclasses
import re

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libk3.engine.generate import GenSettings, generate, run_requests
from libk3.engine.core import Request
from libk3.engine.sampler import Sampler
from libk3.engine.session import open_session
from libk3.model.state import State

from .test_speculative import assert_draws_follow

REPETITIVE = [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12, 13]
PENALISED = dict(repetition_penalty=1.6, presence_penalty=0.7, frequency_penalty=0.4)


def oracle(logits, position, context, *, start=0, temperature=0.0, top_p=1.0, top_k=0,
           min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
           seed=0, logit_bias=()) -> int:
    """The token numerics.md section 12 defines, one id at a time: the logit bias
    ((id, bias) pairs) then the penalties in Python floats (float64, the same operations
    in the same order), the candidates by sorting (probability descending, id ascending)
    and cutting by hand."""
    V = len(logits)
    assert len(context) == position
    x = [float(v) for v in np.asarray(logits, np.float32)]
    for v, b in logit_bias:
        x[v] = x[v] + b
    for v in set(context):
        x[v] = x[v] / repetition_penalty if x[v] > 0 else x[v] * repetition_penalty
    for v, n in collections.Counter(context[start:]).items():
        x[v] = (x[v] - frequency_penalty * n) - presence_penalty
    if temperature == 0:
        return max(range(V), key=lambda v: (x[v], -v))        # the first maximum
    z = np.array(x) / temperature
    e = np.exp(z - z.max())
    p = e / e.sum()
    keep = sorted(range(V), key=lambda v: (-p[v], v))
    top = p[keep[0]]
    if min_p > 0:
        keep = [v for v in keep if p[v] >= min_p * top]
    if top_k > 0:
        keep = keep[:top_k]
    if top_p < 1:
        total = 0.0
        for v in keep:
            total += p[v]
        acc, cut = 0.0, []
        for v in keep:
            acc += p[v]
            cut.append(v)
            if acc >= top_p * total:
                break
        keep = cut
    u = np.random.Generator(np.random.PCG64([seed, position])).random(V)
    with np.errstate(divide="ignore"):
        g = -np.log(-np.log(u))
    return max(keep, key=lambda v: z[v] + g[v])


@st.composite
def cases(draw):
    V = draw(st.integers(2, 12))
    grid = st.sampled_from([-30.0, -3.5, -1.0, -0.25, 0.0, 0.0, 0.5, 1.0, 2.0, 7.0])
    logits = draw(st.lists(st.one_of(grid, st.floats(-40, 40, width=32)), min_size=V,
                           max_size=V))
    position = draw(st.integers(0, 14))
    context = draw(st.lists(st.integers(0, V - 1), min_size=position, max_size=position))
    kw = dict(
        start=draw(st.integers(0, position)),
        temperature=draw(st.one_of(st.just(0.0), st.floats(0.05, 3.0))),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0))),
        top_k=draw(st.one_of(st.just(0), st.just(-1), st.integers(1, V + 2))),
        min_p=draw(st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 1.0))),
        repetition_penalty=draw(st.one_of(st.just(1.0), st.floats(0.2, 3.0))),
        presence_penalty=draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0))),
        frequency_penalty=draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0))),
        seed=draw(st.integers(0, 2**64 - 1)))
    return np.array(logits, np.float32), position, context, kw


@settings(max_examples=400, deadline=None)
@given(case=cases())
def test_sampler_matches_the_brute_force_oracle(case):
    """Catches a penalty applied to the wrong tokens (presence and frequency over the
    prompt, repetition over the output only), in the wrong order or sign (a negative logit
    divided by the repetition penalty, which raises it), top-k or min-p computed before
    the penalties or the temperature, top-p taken over the whole vocabulary instead of
    what top-k and min-p kept, or top_k = -1 not meaning "off": every pick equals the
    oracle's, greedy and sampled."""
    logits, position, context, kw = case
    start, seed = kw.pop("start"), kw.pop("seed")
    temperature, top_p = kw.pop("temperature"), kw.pop("top_p")
    s = Sampler(temperature, top_p, seed, start=start, **kw)
    want = oracle(logits, position, context, start=start, temperature=temperature,
                  top_p=top_p, top_k=max(kw["top_k"], 0), seed=seed,
                  **{k: v for k, v in kw.items() if k != "top_k"})
    assert s(logits, position, context) == want
    cut = max(1, position // 2)             # the context split between fed and pending
    assert s(logits, position, context[:cut], context[cut:]) == want


@st.composite
def biased_cases(draw):
    """``cases`` with a logit bias of up to 4 distinct ids of the row: a value from the
    ends of the range, zero or anywhere in [-100, 100]."""
    logits, position, context, kw = draw(cases())
    ids = draw(st.lists(st.integers(0, len(logits) - 1), max_size=4, unique=True))
    value = st.one_of(st.sampled_from([-100.0, -100, 100.0, 100, 0.0, -2.5, 3]),
                      st.floats(-100, 100))
    return logits, position, context, kw, [(v, draw(value)) for v in ids]


@settings(max_examples=400, deadline=None)
@given(case=biased_cases())
def test_sampler_with_a_logit_bias_matches_the_brute_force_oracle(case):
    """Catches a logit bias added after the penalties or the temperature, to the wrong
    ids, only on the greedy (or only on the sampled) path, lost on a verify's pending
    ids, or pairs taken unsorted: every pick equals the oracle's, greedy and sampled,
    with and without penalties and truncation."""
    logits, position, context, kw, bias = case
    start, seed = kw.pop("start"), kw.pop("seed")
    temperature, top_p = kw.pop("temperature"), kw.pop("top_p")
    s = Sampler(temperature, top_p, seed, start=start, logit_bias=bias, **kw)
    want = oracle(logits, position, context, start=start, temperature=temperature,
                  top_p=top_p, top_k=max(kw["top_k"], 0), seed=seed, logit_bias=bias,
                  **{k: v for k, v in kw.items() if k != "top_k"})
    assert s(logits, position, context) == want
    cut = max(1, position // 2)
    assert s(logits, position, context[:cut], context[cut:]) == want


def test_sampler_applies_the_bias_before_the_repetition_penalty():
    """Catches the bias added after the repetition penalty (or not at all): token 0 was
    seen, r = 2. Biased first, 2 + 1 = 3 is halved to 1.5 < 1.6 and token 1 wins; after
    the penalty 1 + 1 = 2 would win for token 0. Biased first, 1 - 2 = -1 is doubled to
    -2 < -1.8; after, 0.5 - 2 = -1.5 would win (as token 0 wins unbiased)."""
    def after(row, bias, r):            # the wrong order, for the controls
        x = [row[0] / r if row[0] > 0 else row[0] * r, row[1]]
        return int(np.argmax([x[0] + bias, x[1]]))
    for row, bias in (([2.0, 1.6], 1.0), ([1.0, -1.8], -2.0)):
        logits = np.array(row, np.float32)
        want = oracle(logits, 1, [0], repetition_penalty=2.0, logit_bias=[(0, bias)])
        assert want == 1 and after(logits.astype(np.float64), bias, 2.0) == 0
        for T in (0.0, 1e-3):           # greedy, and sampled as cold as greedy
            s = Sampler(T, seed=3, repetition_penalty=2.0, logit_bias=((0, bias),))
            assert s(logits, 1, [0]) == want == oracle(
                logits, 1, [0], temperature=T, seed=3, repetition_penalty=2.0,
                logit_bias=[(0, bias)]), (row, T)
    plain = Sampler(0.0, repetition_penalty=2.0)(np.array([1.0, -1.8], np.float32), 1, [0])
    assert plain == 0                   # control: the bias is what moves the pick


def test_sampler_bias_of_minus_100_bans_and_100_forces_a_token():
    """Catches a -100 bias that leaves the greedy choice (or a draw) on the banned token,
    or a 100 bias that does not force its token: on rows of standard-normal logits the
    banned argmax is never picked, greedy or sampled, and a +100 token always is."""
    rng = np.random.default_rng(7)
    for pos in range(40):
        logits = rng.standard_normal(64).astype(np.float32)
        top = int(np.argmax(logits))
        second = int(np.argsort(-logits.astype(np.float64), kind="stable")[1])
        assert Sampler(0.0, logit_bias=((top, -100),))(logits, pos) == second
        forced = int(rng.integers(0, 64))
        for T in (0.0, 0.7, 1.5):
            s = Sampler(T, 1.0, pos, logit_bias=((top, -100.0),))
            assert s(logits, pos) != top, (pos, T)
            assert Sampler(T, 1.0, pos, top_k=5, logit_bias=((forced, 100.0),))(
                logits, pos) == forced


def test_sampler_without_a_bias_picks_as_before_and_leaves_the_row_alone():
    """Catches the bias step disturbing the pick when off (no entries, or entries of 0),
    or adding the bias in place to the caller's row (a float64 row is not copied by
    ``asarray``; the generator keeps rows for --logits-out and the logprobs): picks
    equal the unbiased oracle's on random rows, and every row's bytes are unchanged."""
    rng = np.random.default_rng(11)
    for pos in range(30):
        row32 = rng.standard_normal(50).astype(np.float32)
        ctx = rng.integers(0, 50, pos).tolist()
        for T, extra in ((0.0, {}), (0.9, dict(top_k=7)), (1.2, PENALISED)):
            want = oracle(row32, pos, ctx, temperature=T, seed=5, **extra)
            zero = tuple((int(v), 0.0) for v in np.unique(rng.integers(0, 50, 5)))
            for bias in ((), zero):
                for row in (row32, row32.astype(np.float64)):
                    before = row.tobytes()
                    assert Sampler(T, 1.0, 5, logit_bias=bias, **extra)(row, pos, ctx) == want
                    assert row.tobytes() == before
            moved = Sampler(T, 1.0, 5, logit_bias=((int(np.argmax(row32)), -50.0),),
                            **extra)
            row = row32.astype(np.float64)
            before = row.tobytes()
            moved(row, pos, ctx)
            assert row.tobytes() == before


@pytest.mark.parametrize("bias,says", [
    (((1, 101.0),), "[-100, 100]"), (((1, float("nan")),), "[-100, 100]"),
    (((1, 2.0), (1, 3.0)), "twice"), (((-1, 2.0),), "outside"),
    (tuple((i, 1.0) for i in range(301)), "at most 300"), ({"x": 1}, "decimal digits"),
])
def test_sampler_refuses_a_bad_logit_bias(bias, says):
    """Catches a bias out of range, an id twice or negative, or more than 300 ids reaching
    the pick (a NaN logit, a wrapped index): refused when the sampler is made."""
    with pytest.raises(ValueError, match=re.escape(says)):
        Sampler(0.0, logit_bias=bias)


def test_sampler_neutral_settings_pick_as_before():
    """Catches the new settings disturbing the old rule when off: with penalties 1, 0, 0
    and top-k, min-p off, the pick is the temperature/top-p pick, whatever the context."""
    rng = np.random.default_rng(3)
    for pos in range(30):
        logits = rng.standard_normal(40).astype(np.float32)
        for T, p in ((0.0, 1.0), (0.8, 1.0), (1.1, 0.6)):
            plain = Sampler(T, p, 9)(logits, pos)
            assert Sampler(T, p, 9, top_k=0, min_p=0.0, repetition_penalty=1.0)(
                logits, pos, rng.integers(0, 40, pos).tolist()) == plain


def test_sampler_penalty_needs_the_ids_before_its_position():
    """Catches a caller (a verify row, a draft) handing the penalties a context that is
    not the tokens before the position: refused, not silently misapplied (control: the
    right length is accepted)."""
    s = Sampler(0.0, repetition_penalty=1.3)
    logits = np.arange(6, dtype=np.float32)
    with pytest.raises(ValueError, match="position"):
        s(logits, 4, [1, 2, 3])
    assert s(logits, 3, [5, 5, 5]) == 4


@pytest.mark.parametrize("top_k,min_p", [(3, 0.0), (0, 0.3), (4, 0.05)])
def test_sampler_draws_the_truncated_distribution(top_k, min_p):
    """Catches a top-k or min-p set that is not the documented one, or a draw that is
    not exact over it: chi-square of 6,000 draws against the renormalised softmax of
    logits / T over the survivors."""
    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
    T = 0.8
    p = np.exp(logits / T - np.max(logits / T))
    p /= p.sum()
    keep = np.argsort(-p, kind="stable")
    if min_p:
        keep = keep[p[keep] >= min_p * p.max()]
    if top_k:
        keep = keep[:top_k]
    want = np.zeros_like(p)
    want[keep] = p[keep] / p[keep].sum()
    assert_draws_follow(want, logits,
                        lambda seed: Sampler(T, 1.0, seed, top_k=top_k, min_p=min_p))


# ---- the engine with the new settings --------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_dir):
    s = open_session(tiny_dir)
    yield s
    s.weights.close()


def test_generate_greedy_with_penalties_is_the_argmax_of_the_adjusted_rows(tiny):
    """Catches penalties that read the wrong context in the loop (the prompt left out of
    the repetition penalty, the output counted from the wrong place, a token counted
    before it is generated): each greedy token is the oracle's argmax of its own logits
    row with the tokens before it; control: the penalties change the output here."""
    settings = GenSettings(gen=14, **PENALISED)
    res = generate(tiny.forward, tiny.new_state(), REPETITIVE, settings, keep_logits=True)
    plain = generate(tiny.forward, tiny.new_state(), REPETITIVE, GenSettings(gen=14))
    assert res.generated_ids != plain.generated_ids
    seq = REPETITIVE + res.generated_ids
    for i, tok in enumerate(res.generated_ids):
        at = len(REPETITIVE) + i
        row = res.logits[at - 1]
        assert tok == oracle(row, at, seq[:at], start=len(REPETITIVE), **PENALISED), i


def _settings_list():
    return [GenSettings(gen=10, seed=4, **PENALISED),
            GenSettings(gen=10, temperature=0.9, top_k=5, min_p=0.05, seed=4, **PENALISED),
            GenSettings(gen=10, temperature=1.2, top_p=0.9, top_k=3, seed=8,
                        repetition_penalty=0.7, presence_penalty=-0.5)]


@pytest.mark.parametrize("which", range(3))
def test_generate_with_new_settings_is_bit_identical_at_1_and_2_threads(tiny, which):
    """Catches a sampler whose pick depends on the kernels' thread count (a reduction
    order, a shared buffer): ids and logits bytes equal at 1 and 2 threads."""
    s = _settings_list()[which]
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = generate(tiny.forward, tiny.new_state(), REPETITIVE, s, keep_logits=True)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = generate(tiny.forward, tiny.new_state(), REPETITIVE, s, keep_logits=True)
    finally:
        numba.set_num_threads(before)
    assert one.generated_ids == two.generated_ids
    assert np.array_equal(one.logits.view(np.uint32), two.logits.view(np.uint32))


class _Oracle:
    """Proposes the true continuation with every third token spoiled (partial
    acceptance: a verify that keeps a rejected token shows)."""

    taps = None

    def __init__(self, truths, vocab):
        self.truths, self.vocab = truths, vocab

    def propose(self, state, anchor, n, pick):
        for t in self.truths:
            if t[:state.pos] == state.ids and len(t) > state.pos:
                out = t[state.pos + 1:state.pos + 1 + n]
                from libk3.speculate.speculative import Proposal
                return Proposal([(x + 1) % self.vocab if (state.pos + j) % 3 == 0 else x
                                 for j, x in enumerate(out)])
        from libk3.speculate.speculative import Proposal
        return Proposal([])

    def observe(self, state, taps):
        pass


@pytest.mark.parametrize("which", range(3))
def test_drafting_with_new_settings_gives_plain_tokens(tiny, which):
    """Catches a verify that picks every proposal with the anchor's context (penalties
    depend on the tokens before each position, so row i must see the anchor and the
    proposals before it): drafting with penalties, top-k and min-p gives plain decoding's
    ids and logits bytes, from the true continuation (partly spoiled) and from prompt
    lookup."""
    from libk3.speculate.proposers import PromptLookup
    from libk3.speculate.speculative import Drafting, Width

    class Every(Width):
        def choose(self, confidence, others=0):
            return len(confidence), 2.0
    s = _settings_list()[which]
    plain = generate(tiny.forward, tiny.new_state(), REPETITIVE, s, keep_logits=True)
    for proposer in (_Oracle([REPETITIVE + plain.generated_ids], tiny.cfg.vocab_size),
                     PromptLookup()):
        drafting = Drafting(proposer, 4)
        drafting.width = Every(4)
        fast = generate(tiny.forward, tiny.new_state(), REPETITIVE, s, keep_logits=True,
                        drafting=drafting)
        assert fast.generated_ids == plain.generated_ids, type(proposer).__name__
        assert np.array_equal(fast.logits.view(np.uint32), plain.logits.view(np.uint32))
        if isinstance(proposer, _Oracle):
            assert 0 < drafting.stats.accepted < drafting.stats.drafted


def test_dspark_draft_with_penalties_gives_plain_tokens(tiny_dir):
    """Catches the DSpark draft picking proposals without the context its block adds
    (and a verify that would accept them): with penalties, drafting by the bundled draft
    gives plain decoding's ids and logits bytes."""
    from libk3.draft.checkpoint import load_draft
    from libk3.draft.forward import DraftForward
    from libk3.speculate.proposers import DSpark
    from libk3.speculate.speculative import Drafting

    s = open_session(tiny_dir)
    try:
        draft = load_draft(tiny_dir / "draft", s.cfg)
        w = s.weights
        proposer = DSpark(DraftForward(draft.cfg, draft.weights, w.embed, w.model()["lm_head"]))
        s.forward.capture(proposer.taps)
        settings = GenSettings(gen=12, temperature=0.7, seed=2, top_k=6, **PENALISED)
        plain = generate(s.forward, s.new_state(), REPETITIVE, settings, keep_logits=True)
        fast = generate(s.forward, s.new_state(), REPETITIVE, settings, keep_logits=True,
                        drafting=Drafting(proposer, 4))
    finally:
        s.weights.close()
    assert fast.generated_ids == plain.generated_ids
    assert np.array_equal(fast.logits.view(np.uint32), plain.logits.view(np.uint32))


def _biased(tiny):
    """Settings whose bias bans the two tokens plain greedy decoding of REPETITIVE makes
    most and lifts another: greedy with penalties, and sampled."""
    plain = generate(tiny.forward, tiny.new_state(), REPETITIVE, GenSettings(gen=12))
    common = [t for t, _ in collections.Counter(plain.generated_ids).most_common(2)]
    lift = next(v for v in (10, 20, 30) if v not in common)
    bias = tuple(sorted([(v, -100.0) for v in common] + [(lift, 4.5)]))
    return [GenSettings(gen=12, logit_bias=bias, **PENALISED),
            GenSettings(gen=12, temperature=0.8, top_k=6, seed=4, logit_bias=bias)]


def test_generate_with_a_logit_bias_is_the_oracle_and_drafts_give_plain_tokens(tiny):
    """Catches a bias lost between the settings and the sampler, applied to the wrong
    row, or written into the rows the generator keeps (--logits-out and the logprobs are
    the model's own): each greedy token is the oracle's pick of its raw row with the bias
    and penalties, never a banned id, and the prompt's rows equal the unbiased run's;
    drafting (the true continuation partly spoiled, prompt lookup) gives the same ids and
    logits bytes (the verify rows themselves: ``test_verify_rows_pick_with_the_bias``);
    control: the bias changes the output."""
    from libk3.speculate.proposers import PromptLookup
    from libk3.speculate.speculative import Drafting, Width

    class Every(Width):
        def choose(self, confidence, others=0):
            return len(confidence), 2.0
    for s in _biased(tiny):
        res = generate(tiny.forward, tiny.new_state(), REPETITIVE, s, keep_logits=True)
        unbiased = dataclasses.replace(s, logit_bias=())
        free = generate(tiny.forward, tiny.new_state(), REPETITIVE, unbiased,
                        keep_logits=True)
        assert res.generated_ids != free.generated_ids
        banned = {v for v, b in s.logit_bias if b == -100.0}
        assert not banned & set(res.generated_ids)
        n = len(REPETITIVE)
        assert np.array_equal(res.logits[:n].view(np.uint32), free.logits[:n].view(np.uint32))
        if s.temperature == 0:
            seq = REPETITIVE + res.generated_ids
            for i, tok in enumerate(res.generated_ids):
                at = n + i
                assert tok == oracle(res.logits[at - 1], at, seq[:at], start=n,
                                     logit_bias=s.logit_bias, **PENALISED), i
        for proposer in (_Oracle([REPETITIVE + res.generated_ids], tiny.cfg.vocab_size),
                         PromptLookup()):
            drafting = Drafting(proposer, 4)
            drafting.width = Every(4)
            fast = generate(tiny.forward, tiny.new_state(), REPETITIVE, s, keep_logits=True,
                            drafting=drafting)
            assert fast.generated_ids == res.generated_ids, type(proposer).__name__
            assert np.array_equal(fast.logits.view(np.uint32), res.logits.view(np.uint32))
            if isinstance(proposer, _Oracle):
                assert 0 < drafting.stats.accepted < drafting.stats.drafted


def test_verify_rows_pick_with_the_bias():
    """Catches a verify row (the pending path: the anchor and proposals not in the state
    yet) picked without the bias: a proposal that is its row's raw argmax but banned is
    rejected, and the one the bias lifts is accepted; control: without the bias the
    banned proposal is accepted."""
    from types import SimpleNamespace
    from libk3.speculate.proposers import PromptLookup
    from libk3.speculate.speculative import SpecStats, Speculator, Width

    rows = np.zeros((3, 8), np.float32)
    rows[0, 5], rows[0, 2] = 3.0, 1.0            # raw pick 5; banned, 2 wins
    state = SimpleNamespace(pos=4, ids=[1, 2, 3, 4])

    def accepted(sampler, drafts):
        spec = Speculator(PromptLookup(), 4, Width(4), SpecStats(4))
        spec.drafts = drafts
        seg = SimpleNamespace(state=state, ids=[6] + drafts, taps=None)
        return spec.accept(seg, rows, sampler)
    for extra in ({}, dict(repetition_penalty=1.3, presence_penalty=0.5)):
        biased = Sampler(0.0, logit_bias=((5, -100.0),), start=4, **extra)
        assert accepted(biased, [5, 0]) == []
        assert accepted(biased, [2, 0]) == [2, 0]
        assert accepted(Sampler(0.0, start=4, **extra), [5, 0]) == [5, 0]


@pytest.mark.parametrize("width", [1, 3])
def test_lockstep_with_new_settings_equals_alone(tiny, width):
    """Catches a lane whose sampler reads another lane's context, or counts its output
    from the wrong position (a lane continuing a state): each job's ids and logits equal
    it run alone, at widths 1 and 3."""
    rng = np.random.default_rng(5)
    jobs = []
    for i, s in enumerate(_settings_list() * 2):
        s = dataclasses.replace(s, gen=5 + i, prefill_chunk=4)
        jobs.append(Request(i, REPETITIVE[:3 + i] + rng.integers(0, 400, i).tolist(), s,
                            logits=True))
    alone = [generate(tiny.forward, tiny.new_state(), j.prompt_ids, j.settings,
                      keep_logits=True) for j in jobs]
    done, _ = run_requests(tiny.forward, lambda n: State(tiny.cfg, capacity=n), jobs, width,
                           chunk=4)
    for job, want in zip(jobs, alone):
        got = done[job.tag]
        assert got.generated_ids == want.generated_ids, job.tag
        n = got.logits.shape[0]
        assert np.array_equal(got.logits.view(np.uint32), want.logits[:n].view(np.uint32))
