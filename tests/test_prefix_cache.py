"""The prefix cache (formats/prefix-cache.md): snapshots found by exact ids, weights and
pack; refused when damaged; kept within the budget, least recently used out; shared by
processes; and resuming from one gives the bytes a whole prefill gives, at any budget."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from libk3.budget import ModelSizes, minimum_budget
from libk3.engine.generate import GenSettings, generate, prefill
from libk3.engine.prefix_cache import PrefixCache, list_entries, state_file_bytes
from libk3.engine.session import open_session
from libk3.io.checkpoint import Checkpoint
from libk3.run.prefixes import PrefixStarts, shared_lengths

PROMPT = [5, 17, 300, 42, 7, 99, 128, 3, 250, 11, 64, 200, 9, 31, 8, 77, 41, 2, 19, 23]


@pytest.fixture(scope="module")
def session(tiny_dir):
    return open_session(tiny_dir)


def _fed(session, ids):
    st = session.new_state()
    prefill(session.forward, st, list(ids), 8, keep_logits=False)
    return st


def _cache(session, d, budget=10 ** 9, pack="shards", warn=None, weights=None):
    return PrefixCache(d, budget, session.cfg, weights or session.weights_identity, pack,
                       warn=warn)


def test_lookup_finds_longest_strict_prefix_and_nothing_else(session, tmp_path):
    """Catches a hit on a snapshot that is not a prefix, on the whole prompt (its last id
    must still be fed), or a shorter one when a longer is there."""
    c = _cache(session, tmp_path)
    for n in (4, 8, 12):
        c.store(_fed(session, PROMPT[:n]))
    assert [e.tokens for e in list_entries(tmp_path)] == [4, 8, 12]
    st, n = c.lookup(PROMPT)
    assert n == 12 and st.ids == PROMPT[:12] and st.pos == 12
    assert c.lookup(PROMPT[:12])[1] == 8                     # strict: 12 would be whole
    assert c.lookup(PROMPT[:10] + [1, 2, 3])[1] == 8          # diverges inside 8..12
    assert c.lookup([1] + PROMPT)[1] == 0
    assert c.lookup(PROMPT, above=12)[1] == 0 and c.lookup(PROMPT, above=8)[1] == 12
    assert c.stats["hits"] == 4


def test_snapshots_of_other_weights_or_pack_are_never_found(session, tmp_path):
    """Catches a key that leaves out the weights or the pack: a snapshot computed by
    another checkpoint (same configuration) or streamed from another pack resumed."""
    _cache(session, tmp_path).store(_fed(session, PROMPT[:8]))
    assert _cache(session, tmp_path).lookup(PROMPT)[1] == 8                  # control
    assert _cache(session, tmp_path, pack="ab" * 32).lookup(PROMPT) == (None, 0)
    other = _cache(session, tmp_path, weights="cd" * 32)
    assert other.lookup(PROMPT) == (None, 0)
    assert len(list_entries(tmp_path)) == 1            # not taken for damaged either


@pytest.mark.parametrize("damage", ["flip", "truncate", "rename"])
def test_damaged_snapshot_is_refused_removed_and_the_next_one_used(session, tmp_path,
                                                                   damage):
    """Catches a damaged, truncated or misnamed snapshot being used (garbage state) or
    left behind to fail again, and a refusal that is silent."""
    warned = []
    c = _cache(session, tmp_path, warn=warned.append)
    c.store(_fed(session, PROMPT[:4]))
    path = c.store(_fed(session, PROMPT[:8]))
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        os.truncate(path, path.stat().st_size - 100)
    else:                      # a valid snapshot of other ids under this prefix's name
        wrong = _fed(session, [1] * 8)
        wrong.save(path, session.weights_identity)
    st, n = c.lookup(PROMPT)
    assert n == 4 and st.ids == PROMPT[:4]
    assert not path.exists() and len(warned) == 1 and path.name in warned[0]
    assert "refused" in warned[0] and "\n" not in warned[0]


def test_budget_keeps_the_most_recently_used(session, tmp_path):
    """Catches a cache that grows past its budget, evicts a snapshot just used instead
    of the least recently used, or writes one larger than the whole budget."""
    one = state_file_bytes(_fed(session, PROMPT[:4]))
    c = _cache(session, tmp_path, budget=int(2.5 * (one + 4096)))
    paths = [c.store(_fed(session, PROMPT[:n])) for n in (4, 5)]
    os.utime(paths[0], (1, 1))
    os.utime(paths[1], (2, 2))
    assert c.lookup(PROMPT[:5])[1] == 4                 # a hit marks 4 as just used
    c.store(_fed(session, PROMPT[:6]))                  # over budget: 5 is the oldest
    assert sorted(e.tokens for e in list_entries(tmp_path)) == [4, 6]
    assert sum(e.size for e in list_entries(tmp_path)) <= c.budget_bytes
    tiny = _cache(session, tmp_path / "t", budget=one // 2)
    assert tiny.store(_fed(session, PROMPT[:4])) is None and not list_entries(tmp_path / "t")


def test_unwritable_folder_warns_once_and_the_run_goes_on(session, tmp_path):
    """Catches a cache failure that ends the run, or one warning per prompt."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    warned = []
    c = _cache(session, blocker / "sub", warn=warned.append)
    assert c.store(_fed(session, PROMPT[:4])) is None
    assert c.store(_fed(session, PROMPT[:5])) is None
    assert len(warned) == 1 and "going on" in warned[0]
    assert c.lookup(PROMPT) == (None, 0)


_WRITER = """
import sys
from libk3.engine.session import open_session
from libk3.io.checkpoint import Checkpoint
from libk3.budget import ModelSizes, minimum_budget
from libk3.engine.generate import prefill
from libk3.engine.prefix_cache import PrefixCache
s = open_session(sys.argv[1])
c = PrefixCache(sys.argv[2], int(sys.argv[3]), s.cfg, s.weights_identity, "shards")
ids = [int(t) for t in sys.argv[4].split(",")]
for r in range(int(sys.argv[5])):
    for n in range(4, len(ids)):
        st = s.new_state()
        prefill(s.forward, st, ids[:n], 8, keep_logits=False)
        c.store(st)
        got, m = c.lookup(ids)
        assert got is None or got.ids == ids[:m], (m, got.ids)
print("ok", c.stats["refused"])
"""


def test_two_processes_share_one_folder(session, tmp_path, tiny_dir):
    """Catches processes that read each other's half-written snapshots, fail on one
    evicted under them, or refuse good ones: two writers with a budget that forces
    eviction all the time, each looking up as it goes."""
    one = state_file_bytes(_fed(session, PROMPT[:10]))
    args = [sys.executable, "-c", _WRITER, str(tiny_dir), str(tmp_path), str(3 * one),
            ",".join(map(str, PROMPT)), "3"]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.split() == ["ok", "0"], err[-2000:]
    assert sum(e.size for e in list_entries(tmp_path)) <= 3 * one + 2 * 65536
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    st, n = _cache(session, tmp_path).lookup(PROMPT)
    assert n and st.ids == PROMPT[:n]


def test_resumed_equals_whole_prefill_across_budgets(session, tiny_dir, tmp_path):
    """Catches a snapshot that changes the answer: one written by a resident run and
    resumed by a streamed run at a tight budget gives the same tokens and the same logits
    bytes as that streamed run prefilling the whole prompt."""
    _cache(session, tmp_path).store(_fed(session, PROMPT[:12]))
    ckpt = Checkpoint.open(tiny_dir)
    floor = minimum_budget(ModelSizes.from_checkpoint(ckpt))
    streamed = open_session(tiny_dir, ckpt=ckpt, trunk_bytes=floor.trunk_bytes,
                            cache_bytes=floor.cache_bytes)
    try:
        assert streamed.weights_identity == session.weights_identity
        settings = GenSettings(gen=5, temperature=0.8, seed=3, prefill_chunk=8)
        st, n = _cache(streamed, tmp_path).lookup(PROMPT)
        assert n == 12
        resumed = generate(streamed.forward, st, PROMPT[n:], settings, keep_logits=True)
        whole = generate(streamed.forward, streamed.new_state(), PROMPT, settings,
                         keep_logits=True)
        assert resumed.generated_ids == whole.generated_ids
        assert resumed.logits.tobytes() == whole.logits[n:].tobytes()
        assert not np.array_equal(whole.logits[0], whole.logits[-1])          # control
    finally:
        streamed.weights.close()
        ckpt.close()


def test_shared_lengths_whole_chunks_short_of_each_prompt():
    """Catches a shared part that is not whole chunks, reaches a prompt's last id, is
    shared with nobody, or misses the neighbour that shares most."""
    base = list(range(100, 140))
    prompts = [base + [1, 2], base[:20] + [7] * 5, base + [3], [9] * 50, base[:33]]
    assert shared_lengths(prompts, 8) == [40, 16, 40, 0, 32]
    assert shared_lengths([base[:17], base[:17]], 8) == [16, 16]          # not the whole
    assert shared_lengths([base], 8) == [0]
    assert shared_lengths([[1] * 7, [1] * 7], 8) == [0, 0]                # under a chunk


def test_prefix_starts_builds_each_prefix_once_nested_ones_on_the_way(session, tmp_path):
    """Catches a shared prefix prefilled again per prompt, a nested shorter prefix that
    another prompt needs not kept, and a started state that is the held one itself
    (a lane's decoding would write into the shared snapshot)."""
    a = PROMPT[:16] + [1, 2]
    b = PROMPT[:8] + [3, 4]
    c = PROMPT + [5]
    plan = [(a, 16), (b, 8), (c, 16)]
    starts = PrefixStarts(session, 8, plan, _cache(session, tmp_path))

    def start(ids, shared):             # what a lane's admission takes once prepared
        starts.prepare(ids, shared)
        return starts.store.take(ids)
    st, n = start(a, 16)
    assert n == 16 and st.ids == a[:16] and st is not starts.store.held()
    st.ids.append(0)                                      # a lane's use of its copy
    st2, n2 = start(c, 16)
    assert n2 == 16 and st2.ids == c[:16]
    assert starts.stats["prefixes_built"] == 1
    st3, n3 = start(b, 8)                                 # nested, kept on disk on the way
    assert n3 == 8 and starts.stats["prefixes_built"] == 1
    assert sorted(e.tokens for e in list_entries(tmp_path)) == [8, 16]
