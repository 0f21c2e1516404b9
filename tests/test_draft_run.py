"""Decoding with the DSpark draft gives plain decoding's tokens and logits, at every budget,
thread count and width, and every k3-run path refuses what it cannot do (dspark.md §6)."""

from __future__ import annotations

import json

import numba
import numpy as np
import pytest

from libk3.budget import ModelSizes, minimum_budget
from libk3.draft.checkpoint import load_draft
from libk3.model.state import State
from libk3.draft.forward import DraftForward
from libk3.engine.generate import GenSettings, generate
from libk3.speculate.proposers import DSpark
from libk3.engine.session import open_session
from libk3.speculate.speculative import Drafting
from libk3.io.checkpoint import Checkpoint
from .scripts import k3, k3_here

PROMPT = [5, 9, 2, 77, 31, 4, 18, 250, 6, 40, 5, 9, 2]


def _session(tiny_dir, where):
    if where == "resident":
        return open_session(tiny_dir)
    with Checkpoint.open(tiny_dir) as ckpt:
        sizes = ModelSizes.from_checkpoint(ckpt)
    if where == "floor":
        floor = minimum_budget(sizes)
        return open_session(tiny_dir, trunk_bytes=floor.trunk_bytes + 1,
                            cache_bytes=floor.cache_bytes + 1)
    return open_session(tiny_dir, trunk_bytes=sizes.trunk_bytes // 2,
                        cache_bytes=sizes.cache_all_bytes // 4)


def with_draft(sess, tiny_dir, cap=7, identity=None):
    """A Drafting over the bundled tiny draft, the session's forward capturing its taps;
    ``identity``: the draft's weights identity it claims (default: its own)."""
    draft = load_draft(tiny_dir / "draft", sess.cfg)
    model = DraftForward(draft.cfg, draft.weights, sess.weights.embed,
                         sess.weights.model()["lm_head"])
    proposer = DSpark(model, identity=identity or draft.identity)
    sess.forward.capture(proposer.taps)
    return Drafting(proposer, cap)


@pytest.fixture(scope="module")
def plain(tiny_dir):
    s = open_session(tiny_dir)
    out = {}
    for temperature in (0.0, 0.8):
        out[temperature] = generate(s.forward, s.new_state(), PROMPT,
                                    GenSettings(gen=40, temperature=temperature, seed=11),
                                    keep_logits=True)
    return out


@pytest.mark.parametrize("where", ["resident", "floor", "half"])
@pytest.mark.parametrize("threads", [1, 2])
def test_draft_tokens_and_logits_equal_plain_at_every_budget(tiny_dir, plain, where, threads):
    """Catches a draft run whose tokens or logits differ from plain decoding's (greedy or
    sampled) at some budget or thread count: taps captured from the wrong rows, a commit
    that keeps a rejected proposal, a draft context fed rejected rows."""
    sess = _session(tiny_dir, where)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        drafting = with_draft(sess, tiny_dir)
        for temperature, want in plain.items():
            st = sess.new_state()
            got = generate(sess.forward, st, PROMPT,
                           GenSettings(gen=40, temperature=temperature, seed=11),
                           keep_logits=True, drafting=drafting)
            assert got.generated_ids == want.generated_ids
            assert np.array_equal(got.logits.view(np.uint32), want.logits.view(np.uint32))
            assert st.draft.length == st.pos          # context rows for committed ids only
        assert drafting.stats.verifies > 0
    finally:
        numba.set_num_threads(before)
        sess.weights.close()


def test_draft_context_holds_exactly_the_committed_positions(tiny_dir):
    """Catches context rows written for rejected proposals or skipped for accepted ones:
    after a drafted generation, the draft's cache equals ingesting the taps of one plain
    pass over the same ids."""
    sess = open_session(tiny_dir)
    drafting = with_draft(sess, tiny_dir)
    st = sess.new_state()
    generate(sess.forward, st, PROMPT, GenSettings(gen=30), drafting=drafting)
    ids = list(st.ids)
    taps = []
    sess.forward(ids, sess.new_state(), taps=taps)
    model = drafting.proposer.draft
    ref = model.new_cache()
    model.ingest(ref, taps[0])
    n = st.draft.length
    assert n == len(ids)
    assert np.array_equal(st.draft.rows().view(np.uint32), ref.rows().view(np.uint32))


def test_a_saved_state_keeps_its_draft_context_for_that_draft_only(tiny_dir, tmp_path):
    """Catches a state file that drops the draft's context (a resumed conversation or a
    prefix-cache snapshot then drafts nothing), that restores other rows than it saved
    (the continuation would propose differently from never stopping), or whose rows
    another draft adopts: the continuation from the file drafts exactly as the
    uninterrupted one, and tokens and logits equal plain decoding's either way."""
    sess = open_session(tiny_dir)
    st = sess.new_state()
    generate(sess.forward, st, PROMPT, GenSettings(gen=12), drafting=with_draft(sess, tiny_dir))
    path = tmp_path / "s.k3state"
    st.save(path, sess.weights_identity)
    runs = {}
    for how in ("uninterrupted", "loaded", "other draft"):
        drafting = with_draft(sess, tiny_dir, identity="0" * 64 if how == "other draft"
                              else None)
        notes = []
        drafting.proposer.note = notes.append
        state = st.copy() if how == "uninterrupted" else \
            State.load(sess.cfg, path, sess.weights_identity)
        got = generate(sess.forward, state, [3, 8], GenSettings(gen=16), keep_logits=True,
                       drafting=drafting)
        runs[how] = (got, (drafting.stats.drafted, drafting.stats.verifies), notes)
    plain = generate(sess.forward, st.copy(), [3, 8], GenSettings(gen=16), keep_logits=True)
    for got, _, _ in runs.values():
        assert got.generated_ids == plain.generated_ids
        assert np.array_equal(got.logits.view(np.uint32), plain.logits.view(np.uint32))
    assert runs["loaded"][1][0] > 0 and runs["uninterrupted"][1][0] > 0
    assert runs["other draft"][1][0] == 0 and any("no context" in n for n in runs[
        "other draft"][2])
    # the widths follow measured pass times; the proposals themselves must not differ
    proposer = with_draft(sess, tiny_dir).proposer

    def greedy(logits, *_):
        return int(np.argmax(logits))
    a = proposer.propose(st.copy(), 3, 7, greedy)
    b = proposer.propose(State.load(sess.cfg, path, sess.weights_identity), 3, 7, greedy)
    assert a.tokens == b.tokens and len(a.tokens) == 7
    assert np.array_equal(a.confidence, b.confidence)


def test_a_drafting_run_passes_by_a_snapshot_without_its_context(tiny_dir, tmp_path):
    """Catches a prefix-cache snapshot without the draft's context serving a drafting run
    (drafting would stay off for the whole sequence, every later run alike), and one
    with the context not replacing it: the drafting run misses, stores the prefix with its
    context, then hits and drafts from it; runs without a draft read either kind."""
    from libk3.engine.prefix_cache import PrefixCache
    from libk3.model.state import read_meta
    sess = open_session(tiny_dir)
    identity = load_draft(tiny_dir / "draft", sess.cfg).identity

    def cache(draft_identity):
        return PrefixCache(tmp_path / "pc", 1 << 30, sess.cfg, sess.weights_identity,
                           sess.pack_identity, draft_identity=draft_identity)
    fed = {}
    for how in ("plain", "draft"):
        st = sess.new_state()
        generate(sess.forward, st, PROMPT, GenSettings(gen=6),
                 drafting=with_draft(sess, tiny_dir) if how == "draft" else None)
        fed[how] = st
    ids = fed["plain"].ids
    assert fed["draft"].ids == ids
    path = cache(None).store(fed["plain"])
    assert read_meta(path)["draft"] is None
    drafting_cache = cache(identity)
    assert drafting_cache.lookup(ids + [3]) == (None, 0) and path.exists()
    assert drafting_cache.stats["without_draft"] == 1
    assert drafting_cache.store(fed["draft"]) == path
    assert read_meta(path)["draft"]["identity"] == identity
    assert cache(None).store(fed["plain"]) == path                 # a plain run keeps it
    assert read_meta(path)["draft"]["identity"] == identity
    state, n = drafting_cache.lookup(ids + [3])
    assert n == len(ids)
    drafting = with_draft(sess, tiny_dir)
    generate(sess.forward, state, [3], GenSettings(gen=8), drafting=drafting)
    assert drafting.stats.drafted > 0
    assert cache(None).lookup(ids + [3])[1] == n
    assert cache("0" * 64).lookup(ids + [3]) == (None, 0)


def test_draft_turns_off_past_its_trained_context_and_on_a_cold_state(tiny_dir):
    """Catches drafting past the draft's trained context (it accepts nothing there) or
    from a state whose earlier positions it never saw, silently."""
    import dataclasses
    sess = open_session(tiny_dir)
    drafting = with_draft(sess, tiny_dir)
    notes = []
    drafting.proposer.note = notes.append
    st = sess.new_state()
    sess.forward(PROMPT, st)                                   # fed without the draft
    generate(sess.forward, st, [3], GenSettings(gen=8), drafting=drafting)
    assert drafting.stats.drafted == 0 and any("no context" in n for n in notes)
    cfg = drafting.proposer.cfg
    drafting.proposer.cfg = dataclasses.replace(cfg, rope_original_max_positions=5)
    generate(sess.forward, sess.new_state(), PROMPT, GenSettings(gen=4), drafting=drafting)
    assert drafting.stats.drafted == 0 and any("trained context" in n for n in notes)


def test_k3_run_draft_cli_paths(tiny_dir, tmp_path):
    """Catches --draft changing a k3-run result, a dump without its arrays, a report
    without the drafting figures, and bad combinations that are not usage errors."""
    args = ("--ids", "5,9,2,77,31", "--gen", 20, "--temperature", 0.7, "--seed", 4, "--json")
    base = k3_here(tiny_dir, *args, "--logits-out", tmp_path / "a.npy")
    dump = tmp_path / "d.npz"
    run = k3(tiny_dir, *args, "--draft", tiny_dir / "draft", "--draft-max", 3,
             "--draft-dump", dump, "--logits-out", tmp_path / "b.npy", "--threads", 1)
    assert base.returncode == run.returncode == 0, run.stderr
    a, b = json.loads(base.stdout), json.loads(run.stdout)
    assert a["generated_ids"] == b["generated_ids"]
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()
    spec = b["speculative"]
    assert spec["passes"] > 0 and set(spec["committed_per_pass"]) == {"1", "2", "3", "4"}
    assert b["bytes_read_per_token"] > 0 and a["bytes_read_per_token"] > 0
    with np.load(dump) as z:
        n = int(z["passes"])
        assert n == spec["verify_passes"] > 0
        assert {"taps.0", "block.0", "draft_logits.0", "draft_base_logits.0", "confidence.0",
                "verify_logits.0", "proposed.0", "accepted.0"} <= set(z.files)
        L = z["block.0"].size - 1                         # formats/model/dspark.md §10's shapes
        assert z["verify_logits.0"].shape == (L + 1, 512) and z["taps.0"].shape[0] == L + 1
        assert z["draft_logits.0"].shape[0] == z["proposed.0"].size >= L >= 1
    for bad, needle in ((("--spec", 2, "--draft", tiny_dir / "draft"), "give one"),
                        (("--draft-dump", tmp_path / "x.npz"), "go with --draft")):
        p = k3_here(tiny_dir, "--ids", "1,2", *bad)
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr


def test_k3_run_refuses_a_damaged_or_unaffordable_draft(tiny_dir, tmp_path):
    """Catches a damaged draft that runs (exit 3 naming the file and tensor expected) and
    a draft whose weights do not fit the budget that runs anyway (exit 4 before work)."""
    import shutil
    bad = tmp_path / "draft"
    shutil.copytree(tiny_dir / "draft", bad)
    doc = json.loads((bad / "config.json").read_text())
    doc["hidden_size"] += 1
    (bad / "config.json").write_text(json.dumps(doc))
    p = k3_here(tiny_dir, "--ids", "1,2", "--draft", bad)
    assert p.returncode == 3 and "config.json" in p.stderr and "hidden_size" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    from libk3.budget import load_rules, peak_bytes, with_draft
    from libk3.run.runner import RunOptions, resolve_run_budget
    from libk3.errors import BudgetError
    with Checkpoint.open(tiny_dir) as ckpt:
        sizes = ModelSizes.from_checkpoint(ckpt)
        draft = load_draft(tiny_dir / "draft", ckpt.config, read=False)
        floor = minimum_budget(sizes)
        kv = draft.cfg.num_hidden_layers * draft.cfg.cache_width * 4

        def needs(held):            # memory at which the floor and this draft just fit
            s = with_draft(sizes, ckpt.config, held, kv, draft.cfg.block_size)
            return peak_bytes(floor, s) / load_rules().headroom_fraction

        def opts(memory):
            return RunOptions(model=str(tiny_dir), trunk_gb=floor.trunk_bytes / 1e9,
                              cache_gb=floor.cache_bytes / 1e9, memory_override=int(memory),
                              budget_order=["trunk_gb", "cache_gb"])
        assert draft.streamed_nbytes < draft.nbytes
        held, streamed = needs(draft.nbytes), needs(draft.streamed_nbytes)
        assert resolve_run_budget(opts(held + 64), ckpt, draft)[3] is False     # held whole
        assert resolve_run_budget(opts(streamed + 64), ckpt, draft)[3] is True  # streams
        assert resolve_run_budget(opts(streamed - 64), ckpt)[0] is not None     # control
        with pytest.raises(BudgetError, match="even streamed"):
            resolve_run_budget(opts(streamed - 64), ckpt, draft)


def test_a_streamed_draft_proposes_as_a_held_one(tiny_dir, plain):
    """Catches a streamed draft that reads other bytes than the held one, or keeps what it
    read (it must hold only its vectors and Markov head between passes)."""
    from libk3.draft.checkpoint import StreamedWeights
    sess = open_session(tiny_dir)
    draft = load_draft(tiny_dir / "draft", sess.cfg, stream=True)
    assert isinstance(draft.weights, StreamedWeights)
    held = sum(a.nbytes for a in dict.values(draft.weights))
    model = DraftForward(draft.cfg, draft.weights, sess.weights.embed,
                         sess.weights.model()["lm_head"])
    proposer = DSpark(model)
    sess.forward.capture(proposer.taps)
    drafting = Drafting(proposer, 7)
    got = generate(sess.forward, sess.new_state(), PROMPT, GenSettings(gen=40),
                   keep_logits=True, drafting=drafting)
    assert got.generated_ids == plain[0.0].generated_ids
    assert drafting.stats.verifies > 0
    assert sum(a.nbytes for a in dict.values(model.w)) <= held < draft.nbytes
    ref = with_draft(open_session(tiny_dir), tiny_dir)
    c1, c2 = model.new_cache(), ref.proposer.draft.new_cache()
    taps = np.random.default_rng(1).standard_normal(
        (5, draft.cfg.n_taps * draft.cfg.target_hidden_size)).astype(np.float32)
    model.ingest(c1, taps)
    ref.proposer.draft.ingest(c2, taps)
    a, b = model.propose(c1, 7, 7), ref.proposer.draft.propose(c2, 7, 7)
    assert np.array_equal(a.logits.view(np.uint32), b.logits.view(np.uint32))
