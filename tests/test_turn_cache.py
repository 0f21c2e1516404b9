"""Reuse of earlier turns: a kept state resumed for a prompt that extends it gives the
same tokens and logits as a fresh prefill; the cache keeps its RAM and disk budgets."""

from __future__ import annotations

import numpy as np
import pytest

from libk3.engine.generate import GenSettings, Hooks, generate
from libk3.engine.session import open_session
from libk3.engine.prefix_cache import PrefixCache
from libk3.serve.turn_cache import TurnCache

P1 = [5, 17, 300, 42, 7, 99, 128, 3, 250, 11]
P2 = P1 + [64, 200, 9, 31, 8]


@pytest.fixture(scope="module")
def session(tiny_dir):
    return open_session(tiny_dir)


def test_turn_cache_resumed_prompt_equals_fresh_prefill(session):
    """Catches a resumed state that differs from prefilling the whole prompt (a stale or
    shared copy, a wrong position): same generated ids, same logits bytes."""
    cache = TurnCache(session.cfg, ram_bytes=10 ** 9)
    first = generate(session.forward, session.new_state(), P1, GenSettings(gen=3),
                     hooks=Hooks(after_prefill=cache.offer))
    state, n = cache.take(P2)
    assert n == len(P1) and state.ids == P1
    resumed = generate(session.forward, state, P2[n:], GenSettings(gen=4), keep_logits=True)
    fresh = generate(session.forward, session.new_state(), P2, GenSettings(gen=4),
                     keep_logits=True)
    assert resumed.generated_ids == fresh.generated_ids
    assert resumed.logits.tobytes() == fresh.logits[n:].tobytes()
    again, m = cache.take(P2)                          # the kept copy was not mutated
    assert m == n and again.ids == P1
    assert first.generated_ids                                              # control


def test_turn_cache_takes_longest_strict_prefix_only(session):
    """Catches a hit on a state that is not a prefix, or on the whole prompt (the last
    prompt token must still be fed to give logits)."""
    cache = TurnCache(session.cfg, ram_bytes=10 ** 9)
    for ids in (P1[:3], P1[:6], [9, 9, 9]):
        st = session.new_state()
        st.ids = list(ids)
        cache.offer(st)
    assert cache.take(P1)[1] == 6
    assert cache.take(P1[:6])[1] == 3
    assert cache.take([9, 9])[1] == 0
    assert cache.take([1] + P1)[1] == 0
    assert cache.summary()["hits"] == 2 and cache.summary()["lookups"] == 4


def _state(session, ids):
    """A state holding ``ids`` (its arrays and last logits marked with len(ids), not
    computed)."""
    st = session.new_state()
    st.ids = list(ids)
    st.pos = len(ids)
    for a in st.kda_S.values():
        a[...] = np.float32(len(ids))
    st.logits = np.full(session.cfg.vocab_size, len(ids), np.float32)
    return st


def _disk(session, d):
    return PrefixCache(d, 10 ** 9, session.cfg, session.weights_identity, "shards")


def test_turn_cache_spills_lru_to_the_prefix_cache(session, tmp_path):
    """Catches a cache that grows past its RAM budget, evicts the most recently used, or
    loses a spilled state's contents; and one without a disk tier keeping what RAM let
    go."""
    size = _state(session, [1]).copy().nbytes()
    cache = TurnCache(session.cfg, ram_bytes=size, prefix_cache=_disk(session, tmp_path))
    cache.offer(_state(session, [1]))
    cache.offer(_state(session, [2]))
    cache.flush()
    assert cache.summary()["ram_entries"] == 1 and cache.summary()["prefix_cache"]["entries"] == 1
    back, n = cache.take([1, 5])                       # from disk
    assert n == 1 and all((a == 1).all() for a in back.kda_S.values())
    assert cache.summary()["disk_hits"] == 1
    tight = TurnCache(session.cfg, ram_bytes=size)
    for k in (1, 2, 3):
        tight.offer(_state(session, [k]))
    assert tight.summary()["ram_entries"] == 1 and tight.summary()["prefix_cache"] is None
    assert tight.take([3, 0])[1] == 1 and tight.take([1, 0])[1] == 0       # LRU went first
    assert tight.summary()["ram_bytes"] <= size


def test_turn_cache_keep_survives_a_new_cache_and_ram_wins_ties(session, tmp_path):
    """Catches a preamble kept only in RAM (lost at a restart), and a disk read where
    RAM holds as long a prefix (a needless load of a GB-sized snapshot)."""
    cache = TurnCache(session.cfg, ram_bytes=10 ** 9, prefix_cache=_disk(session, tmp_path))
    cache.keep(_state(session, [4, 5, 6]))
    cache.close()                                    # a server's end: queued writes done
    assert cache.summary()["prefix_cache"]["writes"] == 1
    restarted = TurnCache(session.cfg, ram_bytes=10 ** 9, prefix_cache=_disk(session, tmp_path))
    restarted.keep(_state(session, [4, 5]))
    assert restarted.take([4, 5, 9])[1] == 2 and restarted.summary()["disk_hits"] == 0
    st, n = restarted.take([4, 5, 6, 7])
    assert n == 3 and st.ids == [4, 5, 6] and restarted.summary()["disk_hits"] == 1
