"""Speculative decoding keeps exactly the greedy result (tokens and logits bytes)."""

from __future__ import annotations

import numpy as np
import pytest

from libk3.engine.generate import GenSettings, generate
from libk3.engine.session import open_session
from libk3.engine.speculative import MAX_PAUSE, DraftBudget, lookup_drafts

REPETITIVE = [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12, 13]


def test_lookup_drafts_follow_the_latest_longest_match():
    """Catches drafts taken from the wrong occurrence or a too-short n-gram."""
    assert lookup_drafts([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]
    assert lookup_drafts([5, 6, 7], 3) == []
    assert lookup_drafts([4, 4], 3) == [4]


@pytest.mark.parametrize("which", ["tiny", "small"])
@pytest.mark.parametrize("drafts", ["lookup", "oracle", "corrupted", "wrong"])
def test_spec_tokens_and_logits_identical_to_plain_greedy(which, drafts, tiny_dir, small_dir,
                                                          monkeypatch):
    """Catches accepting a draft the model would not have produced, or a rollback that
    leaves a rejected token in the state (later logits would differ). Drafts come from
    prompt lookup, from the true greedy continuation (every draft accepted), or from it
    with every third token corrupted (partial acceptance and rollback), or with every
    token wrong (drafting must back off: few verifies, none accepted)."""
    from libk3.engine import generate as gen_mod
    s = open_session(tiny_dir if which == "tiny" else small_dir)
    plain = generate(s.forward, s.new_state(), REPETITIVE, GenSettings(gen=24), keep_logits=True)
    truth = REPETITIVE + plain.generated_ids
    if drafts != "lookup":
        def fake(context, n, max_ngram=3):
            out = truth[len(context):len(context) + n]
            if drafts == "corrupted":
                out = [(t + 1) % s.cfg.vocab_size if (len(context) + j) % 3 == 0 else t
                       for j, t in enumerate(out)]
            if drafts == "wrong":
                out = [(t + 1) % s.cfg.vocab_size for t in out]
            return out
        import libk3.engine.speculative as spec_mod
        monkeypatch.setattr(spec_mod, "lookup_drafts", fake)
    fast = generate(s.forward, s.new_state(), REPETITIVE, GenSettings(gen=24, spec=4),
                    keep_logits=True)
    assert fast.generated_ids == plain.generated_ids
    assert np.array_equal(fast.logits.view(np.uint32), plain.logits.view(np.uint32))
    if drafts == "oracle":
        assert fast.spec["accepted"] == fast.spec["drafted"] > 0 and fast.spec["rollbacks"] == 0
    if drafts == "corrupted":
        assert 0 < fast.spec["accepted"] < fast.spec["drafted"] and fast.spec["rollbacks"] > 0
    if drafts == "wrong":             # verifies at steps 1, 3, 6, 11, 20 of 24 (pauses 1, 2, 4, 8)
        assert fast.spec["accepted"] == 0 and fast.spec["verify_calls"] == 5
        assert fast.spec["drafted"] == 4 + 1 + 1 + 1 + 1
    del gen_mod


def test_spec_stops_exactly_at_a_stop_id(tiny_dir):
    """Catches feeding drafts past a stop token."""
    s = open_session(tiny_dir)
    plain = generate(s.forward, s.new_state(), REPETITIVE, GenSettings(gen=30))
    stop = plain.generated_ids[7]
    a = generate(s.forward, s.new_state(), REPETITIVE, GenSettings(gen=30, stop_ids=(stop,)),
                 keep_logits=True)
    b = generate(s.forward, s.new_state(), REPETITIVE,
                 GenSettings(gen=30, stop_ids=(stop,), spec=4), keep_logits=True)
    assert a.generated_ids == b.generated_ids and b.generated_ids[-1] == stop
    assert np.array_equal(a.logits.view(np.uint32), b.logits.view(np.uint32))


def test_draft_budget_backs_off_on_failure_and_recovers_on_acceptance():
    """Catches drafting that never pauses after rejected verifies (each costs ~2 plain
    steps), a pause that grows without bound, and a cap that never grows back."""
    b = DraftBudget(4)
    seen = []
    for _ in range(60):
        n = b.allowed()
        seen.append(n)
        if n:
            b.update(n, 0)
    drafting = [k for k, n in enumerate(seen) if n]
    gaps = [j - i - 1 for i, j in zip(drafting, drafting[1:])]
    assert seen[0] == 4 and all(seen[k] == 1 for k in drafting[1:])
    assert gaps[:4] == [1, 2, 4, 8] and set(gaps[4:]) == {MAX_PAUSE}
    b = DraftBudget(4)
    b.update(4, 0)                     # pause 1, then one draft
    assert (b.allowed(), b.allowed()) == (0, 1)
    b.update(1, 1)                     # accepted: the cap doubles back to N
    assert b.allowed() == 2
    b.update(2, 2)
    assert b.allowed() == 4
    b.update(4, 2)                     # partial: at most accepted + 1
    assert b.allowed() == 3
    b.update(3, 0)                     # the acceptances reset the backoff to 1
    assert (b.allowed(), b.allowed()) == (0, 1)
