"""Speculative decoding keeps exactly plain decoding's result (tokens and logits bytes),
greedy or sampled, whatever is proposed; the width rule and the sampler it rests on."""

from __future__ import annotations

import numpy as np
import pytest

from libk3.engine.generate import GenSettings, generate
from libk3.speculate.proposers import PromptLookup, lookup_drafts
from libk3.engine.sampler import Sampler
from libk3.engine.session import open_session
from libk3.speculate.speculative import MAX_PAUSE, Drafting, Proposal, Width

REPETITIVE = [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12, 13]


def test_lookup_drafts_follow_the_latest_longest_match():
    """Catches drafts taken from the wrong occurrence or a too-short n-gram."""
    assert lookup_drafts([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]
    assert lookup_drafts([5, 6, 7], 3) == []
    assert lookup_drafts([4, 4], 3) == [4]


class Scripted:
    """A proposer that offers the true continuation, optionally spoiled: every third
    token ("corrupted") or every token ("wrong") replaced by its successor id."""

    taps = None

    def __init__(self, truth, how, vocab):
        self.truth, self.how, self.vocab = truth, how, vocab

    def propose(self, state, anchor, n, pick):
        at = state.pos + 1
        out = self.truth[at:at + n]
        if self.how == "corrupted":
            out = [(t + 1) % self.vocab if (at + j) % 3 == 0 else t for j, t in enumerate(out)]
        elif self.how == "wrong":
            out = [(t + 1) % self.vocab for t in out]
        return Proposal(list(out))

    def observe(self, state, taps):
        pass


class FixedCost(Width):
    """Passes cost 1 + 0.2 per token fed, whatever the clock says: the widths chosen, and
    so the counts a test checks, do not depend on the machine's load."""

    def cost(self, tokens):
        return 1.0 + 0.2 * tokens


@pytest.mark.parametrize("which", ["tiny", "small"])
@pytest.mark.parametrize("drafts", ["lookup", "oracle", "corrupted", "wrong"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_spec_tokens_and_logits_identical_to_plain(which, drafts, temperature, tiny_dir,
                                                   small_dir):
    """Catches accepting a proposal the model would not have produced, or a commit that
    leaves a rejected token in the state (later logits would differ), greedy and
    sampled. Proposals come from prompt lookup, from the true continuation (all
    accepted), from it with every third token spoiled (partial acceptance), or with
    every token wrong (nothing accepted: drafting must pause, and never a second pass)."""
    s = open_session(tiny_dir if which == "tiny" else small_dir)
    settings = GenSettings(gen=24, temperature=temperature, seed=5)
    plain = generate(s.forward, s.new_state(), REPETITIVE, settings, keep_logits=True)
    truth = REPETITIVE + plain.generated_ids
    if drafts == "lookup":
        drafting = Drafting(PromptLookup(), 4)
    else:
        drafting = Drafting(Scripted(truth, drafts, s.cfg.vocab_size), 4)
    drafting.width = FixedCost(4)
    passes = s.forward.passes
    fast = generate(s.forward, s.new_state(), REPETITIVE, settings, keep_logits=True,
                    drafting=drafting)
    assert fast.generated_ids == plain.generated_ids
    assert np.array_equal(fast.logits.view(np.uint32), plain.logits.view(np.uint32))
    st = fast.spec
    decode_passes = s.forward.passes - passes - 1          # one prefill pass
    assert st["passes"] == decode_passes                   # never a second pass
    if drafts == "oracle":
        assert st["accepted"] == st["drafted"] > 0 and decode_passes < 24 / 2
    if drafts == "corrupted":
        assert 0 < st["accepted"] < st["drafted"]
    if drafts == "wrong":        # the width shrinks, then drafting pauses and probes
        assert st["accepted"] == 0 and 0 < st["verify_passes"] < decode_passes - 4
        assert st["drafted"] < 4 * st["verify_passes"]


def test_spec_stops_exactly_at_a_stop_id(tiny_dir):
    """Catches feeding proposals past a stop token."""
    s = open_session(tiny_dir)
    plain = generate(s.forward, s.new_state(), REPETITIVE, GenSettings(gen=30))
    stop = plain.generated_ids[7]
    a = generate(s.forward, s.new_state(), REPETITIVE, GenSettings(gen=30, stop_ids=(stop,)),
                 keep_logits=True)
    truth = REPETITIVE + plain.generated_ids
    b = generate(s.forward, s.new_state(), REPETITIVE, GenSettings(gen=30, stop_ids=(stop,)),
                 keep_logits=True, drafting=Drafting(Scripted(truth, "oracle", 0), 6))
    assert a.generated_ids == b.generated_ids and b.generated_ids[-1] == stop
    assert np.array_equal(a.logits.view(np.uint32), b.logits.view(np.uint32))


def test_width_verifies_what_pays_and_pauses_when_nothing_does():
    """Catches a width that ignores the confidence or the cost of wider passes, drafting
    that never pauses when it does not pay, and a pause that grows without bound."""
    w = Width(7)
    assert w.measuring_plain()                    # plain's cost is measured first
    for _ in range(3):                       # passes cost 1 s + 0.1 s per token
        for n in (1, 4, 8):
            w.record(n, 1.0 + 0.1 * n, n == 1)
    assert not w.measuring_plain()
    assert abs(w.cost(5) - 1.5) < 1e-9 and w.cost(4) == 1.4
    sure, unsure = np.full(7, 0.99), np.full(7, 0.05)
    assert w.choose(sure)[0] == 7 and w.choose(unsure)[0] == 0
    L, gain = w.choose(np.full(7, 0.6))
    e = np.cumsum(np.concatenate([[1.0], np.cumprod(np.full(7, 0.6))]))
    assert L == int(np.argmax(e / (1.1 + 0.1 * np.arange(8)))) and gain > 1
    mid = np.full(7, 0.45)                   # riding in a wide lockstep pass, a proposal's
    assert w.choose(mid, others=0)[0] < w.choose(mid, others=30)[0]   # share is cheaper
    w.record_draft(20.0)                     # a draft dearer than the tokens it saves
    assert w.choose(sure)[1] < 1
    seen = []
    for _ in range(60):
        ok = w.allowed()
        seen.append(ok)
        if ok:
            w.judge(0.5)
    drafting = [k for k, ok in enumerate(seen) if ok]
    gaps = [j - i - 1 for i, j in zip(drafting, drafting[1:])]
    assert gaps[:4] == [1, 2, 4, 8] and set(gaps[4:]) == {MAX_PAUSE}
    w.judge(2.0)
    assert w.backoff == 1


def assert_draws_follow(want, logits, make) -> None:
    """6,000 draws (60 seeds of ``make(seed)``, 100 positions each) from ``logits`` follow
    the distribution ``want``: never a token of probability 0, chi-square within the
    99.9th percentile (up to 7 degrees of freedom)."""
    n = 6000
    counts = np.zeros(want.size)
    for seed in range(60):
        s = make(seed)
        for pos in range(n // 60):
            counts[s(logits, pos)] += 1
    assert counts[want == 0].sum() == 0
    exp = want[want > 0] * n
    chi2 = float(((counts[want > 0] - exp) ** 2 / exp).sum())
    assert chi2 < 24.3, (chi2, counts)



def test_sampler_is_keyed_by_position_and_seed():
    """Catches a pick that depends on how many picks came before (a verify block would
    then not reproduce plain decoding), or on nothing but the seed."""
    logits = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    a, b = Sampler(1.0, 1.0, 7), Sampler(1.0, 1.0, 7)
    first = [a(logits, p) for p in range(40)]
    assert [b(logits, p) for p in reversed(range(40))] == first[::-1]
    assert len(set(first)) > 5
    assert [Sampler(1.0, 1.0, 8)(logits, p) for p in range(40)] != first
    assert Sampler(0.0)(logits, 3) == int(np.argmax(logits))


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_sampler_draws_the_tempered_top_p_distribution(top_p):
    """Catches a Gumbel-max rule that is not exact (wrong noise, temperature applied
    twice, top-p set off by one): chi-square of 6,000 draws over seeds and positions
    against the renormalised softmax of logits / T over the top-p candidates."""
    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
    T = 0.8
    p = np.exp(logits / T - np.max(logits / T))
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = order[:int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]
    want = np.zeros_like(p)
    want[keep] = p[keep] / p[keep].sum()
    assert_draws_follow(want, logits, lambda seed: Sampler(T, top_p, seed))
