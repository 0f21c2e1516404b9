"""The state store (libk3/store/): RAM first, then the prefix cache on disk, one lookup,
states with image rows never kept, counted once by the budget; and the three ways states
are kept (a batch's shared prefixes, one-prompt runs, a server's turns) meet in it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from libk3.engine.generate import GenSettings, Reuse, generate
from libk3.engine.prefix_cache import PrefixCache, list_entries
from libk3.io.checkpoint import Checkpoint
from libk3.run.runner import RunOptions, resolve_run_budget
from libk3.store import StateStore
from .scripts import k3, k3_here
from .test_prefix_cache import PROMPT, _fed, session  # noqa: F401 (a fixture)

OTHER = [400, 401, 402, 403, 404, 405]


def _disk(session, d):
    return PrefixCache(d, 10 ** 9, session.cfg, session.weights_identity, "shards")


def _same(a, b) -> bool:
    """Whether two states hold the same ids and the same bytes in every array."""
    return a.ids == b.ids and all(np.array_equal(x, y) for x, y in
                                  zip(a.kda_S.values(), b.kda_S.values())) and \
        np.array_equal(a.logits, b.logits)


def test_store_ram_hit_hands_out_a_copy_and_reads_no_disk(session, tmp_path):
    """Catches a hit that hands out the kept state itself (a lane's decoding would write
    into it), a disk read where RAM holds as long a prefix, and a hit on the whole
    prompt (its last id must be fed)."""
    store = StateStore(session.cfg, 10 ** 9, _disk(session, tmp_path))
    kept = _fed(session, PROMPT[:8])
    store.offer(kept)
    st, n = store.take(PROMPT)
    assert n == 8 and _same(st, kept) and st is not store.held()
    st.ids.append(0)
    assert store.take(PROMPT)[0].ids == PROMPT[:8]           # the kept copy unchanged
    assert store.summary()["disk_hits"] == 0 and list_entries(tmp_path) == []
    assert store.take(PROMPT[:8]) == (None, 0)                # strict
    assert store.summary()["hits"] == 2 and store.summary()["lookups"] == 3


def test_store_evicted_state_is_found_on_disk_then_held_in_ram(session, tmp_path):
    """Catches RAM that lets a state go without writing it to the disk tier (lost), a
    disk hit whose contents differ from the state kept, and a disk hit not held in RAM
    (the next prompt sharing it would read the disk again); control: a store without a
    disk tier loses what RAM lets go."""
    a, b = _fed(session, PROMPT[:8]), _fed(session, OTHER)
    store = StateStore(session.cfg, None, _disk(session, tmp_path), ram_states=1)
    store.offer(a)
    store.offer(b)                                           # a goes to disk
    assert [e.tokens for e in list_entries(tmp_path)] == [8]
    st, n = store.take(PROMPT)
    assert n == 8 and _same(st, a) and store.summary()["disk_hits"] == 1
    assert store.take(PROMPT + [1])[1] == 8 and store.summary()["disk_hits"] == 1
    ram_only = StateStore(session.cfg, None, ram_states=1)
    ram_only.offer(a)
    ram_only.offer(b)
    assert ram_only.take(PROMPT) == (None, 0) and ram_only.take(OTHER + [1])[1] == 6


_OTHER_PROCESS = """
import sys
from libk3.engine.generate import prefill
from libk3.engine.prefix_cache import PrefixCache
from libk3.engine.session import open_session
from libk3.store import StateStore
s = open_session(sys.argv[1])
store = StateStore(s.cfg, 0, PrefixCache(sys.argv[2], 10 ** 9, s.cfg, s.weights_identity,
                                         "shards"), background=True)
st = s.new_state()
prefill(s.forward, st, [int(t) for t in sys.argv[3].split(",")], 8, keep_logits=False)
store.keep(st)
store.close()
"""


def test_store_disk_tier_is_shared_between_processes(session, tiny_dir, tmp_path):
    """Catches a disk tier private to its process (or a writer thread that dies with
    its queue unwritten): a state kept by another process's store, through its writer,
    is resumed here and gives the tokens and logits bytes a whole prefill gives."""
    p = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(tiny_dir), str(tmp_path),
                        ",".join(map(str, PROMPT[:12]))], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    store = StateStore(session.cfg, 10 ** 9, _disk(session, tmp_path))
    settings = GenSettings(gen=4, temperature=0.8, seed=5, prefill_chunk=8)
    resumed = generate(session.forward, None, PROMPT, settings, keep_logits=True,
                       reuse=Reuse(store))
    assert resumed.reused_tokens == 0            # every row wanted: the store not asked
    res = generate(session.forward, None, PROMPT, settings, reuse=Reuse(store))
    whole = generate(session.forward, session.new_state(), PROMPT, settings, keep_logits=True)
    assert res.reused_tokens == 12 and store.summary()["disk_hits"] == 1
    assert res.generated_ids == whole.generated_ids == resumed.generated_ids
    again = generate(session.forward, None, PROMPT, settings, keep_logits=False,
                     reuse=Reuse(store))
    assert again.reused_tokens == 12 and store.summary()["disk_hits"] == 1   # now in RAM
    assert resumed.logits.tobytes() == whole.logits.tobytes()


def test_store_never_keeps_a_state_holding_image_rows(session, tmp_path):
    """Catches an image state kept by its ids alone (two images of one size have the
    same ids: formats/model/vision.md §8.3), in RAM or on disk, and a prompt with an
    image resumed past the text before it; control: the same state without rows is
    kept."""
    store = StateStore(session.cfg, 10 ** 9, _disk(session, tmp_path))
    st = _fed(session, PROMPT[:8])
    st.media = [(2, np.zeros((3, session.cfg.hidden_size), np.float32), "d" * 64)]
    store.offer(st)
    store.keep(st)
    assert store.take(PROMPT) == (None, 0) and list_entries(tmp_path) == []
    assert store.summary()["image_states_refused"] == 2
    st.media = []
    store.keep(st)
    store.keep(_fed(session, PROMPT[:4]))
    assert store.take(PROMPT)[1] == 8 and len(list_entries(tmp_path)) == 2
    assert store.take(PROMPT, limit=6)[1] == 4                # an image at 6: text before


def _store_lines(reasons) -> list:
    return [r for r in reasons if r.startswith("state store:")]


@pytest.mark.parametrize("extra, states", [({"batch_width": "auto"}, 1),
                                           ({"batch_width": "auto", "serve": True,
                                             "prefix_cache": "auto"}, 3)])
def test_budget_counts_the_store_once_in_one_line(tiny_dir, extra, states):
    """Catches the store's states counted twice (or not at all) beside the lanes, or a
    budget that does not say so: one "state store" line, naming the states the width
    set aside; control: a one-prompt run without --prefix-cache has no store."""
    def resolve(**kw):
        opts = RunOptions(model=str(tiny_dir), memory_override=2 * 10 ** 9, **kw)
        with Checkpoint.open(tiny_dir) as ckpt:
            return resolve_run_budget(opts, ckpt)
    budget, _, width_reasons, *_ = resolve(**extra)
    (line,) = _store_lines(budget.reasons)
    assert f"{states} sequence" in line
    noun = "snapshot" if states == 1 else "snapshots"
    assert f"and {states} {noun}" in width_reasons[0]
    assert _store_lines(resolve()[0].reasons) == []


CHUNK = 8
SHARED = [(i * 37) % 480 + 5 for i in range(27)]       # 27 shared ids: 24 in whole chunks


def _batch(tiny_dir, tmp_path, cache):
    """A batch of three greedy lines sharing SHARED, run with the disk tier ``cache``;
    its results by id and the run's summary."""
    lines = [{"id": f"p{i}", "ids": SHARED + [100 + i, 200 + i, 300 + i], "gen": 3}
             for i in range(3)]
    batch = tmp_path / "b.jsonl"
    batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    res = k3_here(tiny_dir, "--batch", batch, "--out", out, "--prefill-chunk", CHUNK,
                  "--prefix-cache", cache, "--json", "-q")
    assert res.returncode == 0, res.stderr
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}, \
        json.loads(res.stdout)


def test_a_batch_s_shared_prefix_is_resumed_by_a_later_one_prompt_run(tiny_dir, tmp_path):
    """Catches a batch's shared prefix kept apart from the store a one-prompt run reads
    (another mechanism, another key), a report without its one store line, or a resumed
    run whose tokens differ from the batch line's whole answer."""
    cache = tmp_path / "cache"
    results, summary = _batch(tiny_dir, tmp_path, cache)
    assert summary["prefixes"]["prefixes_built"] == 1
    assert [r["reused_tokens"] for r in results.values()] == [24, 24, 24]
    assert len(_store_lines(results["p1"]["budget"]["reasons"])) == 1
    ids = results["p1"]["prompt_ids"]
    p = k3(tiny_dir, "--ids", ",".join(map(str, ids)), "--gen", 3, "--prefill-chunk", CHUNK,
           "--prefix-cache", cache, "--json", "-q")
    assert p.returncode == 0, p.stderr
    alone = json.loads(p.stdout)
    assert alone["reused_tokens"] == 24 and alone["prompt_ids"] == ids
    assert alone["generated_ids"] == results["p1"]["generated_ids"]
    fresh = json.loads(k3_here(tiny_dir, "--ids", ",".join(map(str, ids)), "--gen", 3,
                               "--json", "-q").stdout)
    assert fresh["reused_tokens"] == 0 and fresh["generated_ids"] == alone["generated_ids"]


def test_a_server_request_resumes_a_state_the_batch_left_on_disk(tiny_dir, tmp_path):
    """Catches a server whose store does not read the disk tier a batch run wrote (its
    turn cache a mechanism of its own): a completion extending the batch's shared prefix
    resumes it from disk and answers as a fresh run of its ids."""
    pytest.importorskip("aiohttp")
    from .test_serve import _post, _health, _start, _stop
    cache = tmp_path / "cache"
    _batch(tiny_dir, tmp_path, cache)
    ids = SHARED + [9, 10, 11, 12]
    srv = _start(tiny_dir, tmp_path / "serve.log", "--prefix-cache", cache,
                 "--prefill-chunk", CHUNK, "--gen", 3)
    try:
        status, body = _post(srv, "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": ids, "max_tokens": 3}).encode())
        reuse = _health(srv)["turn_reuse"]
    finally:
        _stop(srv)
    assert status == 200, body
    assert body["k3"]["reused_tokens"] == 24 and reuse["disk_hits"] == 1
    fresh = json.loads(k3_here(tiny_dir, "--ids", ",".join(map(str, ids)), "--gen", 3,
                               "--json", "-q").stdout)
    assert body["k3"]["generated_ids"] == fresh["generated_ids"]
