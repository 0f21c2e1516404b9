"""A verify pass and its commit leave the target exactly as feeding the accepted ids would
(dspark.md §6.3), and the taps a draft reads are the pass's own hidden states (dspark.md §4)."""

from __future__ import annotations

import numpy as np
import pytest

from libk3.engine.session import open_session
from libk3.model.forward import Forward, Segment, Taps, commit

PROMPT = [5, 9, 2, 77, 31, 4, 18, 250, 6, 40]


def _bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def assert_same_state(a, b):
    assert a.pos == b.pos and a.ids == b.ids
    for L in a.kda_S:
        assert np.array_equal(_bits(a.kda_S[L]), _bits(b.kda_S[L])), L
        assert np.array_equal(_bits(a.kda_conv[L]), _bits(b.kda_conv[L])), L
    for L in a.mla_latent:
        assert np.array_equal(_bits(a.mla_latent[L][:a.pos]), _bits(b.mla_latent[L][:b.pos]))
        assert np.array_equal(_bits(a.mla_rope[L][:a.pos]), _bits(b.mla_rope[L][:b.pos]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_commit_equals_feeding_the_accepted_ids(tiny_dir, seed):
    """Catches a commit that leaves a rejected id in the KDA state or conv history (the
    replay over too many rows, or the conv window shifted by the verify width), a verify
    that moved the state, or verify logits that differ from plain decoding's: random
    accept counts 0..L+1 over several steps, against a state fed only the accepted ids."""
    rng = np.random.default_rng(seed)
    s = open_session(tiny_dir)
    spec, plain = s.new_state(), s.new_state()
    s.forward(PROMPT, spec)
    s.forward(PROMPT, plain)
    V = s.cfg.vocab_size
    for _ in range(6):
        L = int(rng.integers(0, 6))
        block = [int(t) for t in rng.integers(0, V, L + 1)]
        seg = Segment(block, spec, all_logits=True, phase="decode", verify=True)
        before = (spec.pos, list(spec.ids))
        got = s.forward.run([seg])[0]
        assert (spec.pos, spec.ids) == before            # a verify leaves the state alone
        n = int(rng.integers(0, L + 2))
        commit(seg, n)
        if n:
            want = s.forward(block[:n], plain, all_logits=True, phase="decode")
            assert np.array_equal(_bits(got[:n]), _bits(want))
        assert_same_state(spec, plain)
    after_spec = s.forward([3], spec)
    after_plain = s.forward([3], plain)
    assert np.array_equal(_bits(after_spec), _bits(after_plain))


def test_verify_beside_plain_segments_in_one_pass(tiny_dir):
    """Catches a verify segment that disturbs another sequence of the same pass, or whose
    rows shift when it is not the first segment."""
    s = open_session(tiny_dir)
    a, b, ref = s.new_state(), s.new_state(), s.new_state()
    for st in (a, b, ref):
        s.forward(PROMPT, st)
    plain_b = s.new_state()
    s.forward(PROMPT[:4], plain_b)
    seg_b = Segment([8, 9], plain_b, all_logits=True, phase="decode")
    seg_a = Segment([1, 2, 3], a, all_logits=True, phase="decode", verify=True)
    out_b, out_a = s.forward.run([seg_b, seg_a])
    commit(seg_a, 2)
    want_a = s.forward([1, 2], ref, all_logits=True, phase="decode")
    assert np.array_equal(_bits(out_a[:2]), _bits(want_a))
    assert_same_state(a, ref)
    alone = s.new_state()
    s.forward(PROMPT[:4] + [8, 9], alone)
    assert_same_state(plain_b, alone)


def test_commit_refuses_a_plain_segment_and_a_count_past_the_block(tiny_dir):
    """Catches a commit that silently does nothing, or one past the ids verified."""
    s = open_session(tiny_dir)
    st = s.new_state()
    seg = Segment([1, 2], st)
    s.forward.run([seg])
    with pytest.raises(ValueError):
        commit(seg, 1)
    seg = Segment([1, 2], st, verify=True)
    s.forward.run([seg])
    with pytest.raises(ValueError):
        commit(seg, 3)


@pytest.mark.parametrize("form", ["prefix", "attn_res"])
def test_taps_do_not_depend_on_chunking_or_on_verify(tiny_dir, form):
    """Catches taps captured from the wrong rows of a pass (chunked prefill, a verify
    pass, or a second sequence in the pass), or in another order than the layers."""
    s = open_session(tiny_dir)
    layers = (1, 3, 6, 9, 12)
    fw = Forward(s.cfg, s.weights, taps=Taps(layers, form))
    E = s.cfg.hidden_size
    whole, parts = [], []
    fw(PROMPT, s.new_state(), taps=whole)
    st = s.new_state()
    for i in range(0, len(PROMPT), 3):
        fw(PROMPT[i:i + 3], st, taps=parts)
    assert whole[0].shape == (len(PROMPT), len(layers) * E)
    assert np.array_equal(_bits(whole[0]), _bits(np.concatenate(parts)))
    st = s.new_state()
    fw(PROMPT[:6], st)
    other = s.new_state()
    seg_o = Segment([4, 4, 4], other)
    seg = Segment(PROMPT[6:], st, verify=True)
    fw.run([seg_o, seg])
    assert np.array_equal(_bits(seg.taps), _bits(whole[0][6:]))


def test_prefix_taps_are_the_blocks_running_sum(tiny_dir):
    """Catches the wrong tap form: the default (prefix) tap of a boundary-closing layer
    differs from the mixture tap, and a tap after layer L changes when layer L's
    output does (not layer L + 1's)."""
    s = open_session(tiny_dir)
    E = s.cfg.hidden_size
    got = {}
    for form in ("prefix", "attn_res"):
        taps = []
        Forward(s.cfg, s.weights, taps=Taps((2,), form))(PROMPT, s.new_state(), taps=taps)
        got[form] = taps[0]
    assert got["prefix"].shape == got["attn_res"].shape == (len(PROMPT), E)
    assert not np.array_equal(got["prefix"], got["attn_res"])
    with pytest.raises(ValueError):
        Forward(s.cfg, s.weights, taps=Taps((3, 2)))
    with pytest.raises(ValueError):
        Forward(s.cfg, s.weights, taps=Taps((s.cfg.num_hidden_layers,)))


@pytest.mark.parametrize("form", ["prefix", "attn_res"])
def test_taps_match_the_float64_reference_in_layer_order(tiny_dir, form):
    """Catches a tap of the wrong layer (off by one), the wrong form, or taps concatenated
    in another order than ascending layers: each E-wide slice against the float64
    reference's running sum after that layer (or the next consumer's mixture)."""
    from libk3 import names
    from libk3.model import reference as ref
    s = open_session(tiny_dir)
    cfg, E, last = s.cfg, s.cfg.hidden_size, s.cfg.num_hidden_layers - 1
    layers = (0, 2, 3, last)
    got = []
    Forward(cfg, s.weights, taps=Taps(layers, form))(PROMPT, s.new_state(), taps=got)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    want = {}

    def on_layer(L, prefix, blocks):
        if L not in layers:
            return
        if form == "prefix":
            want[L] = prefix
        elif L == last:
            want[L] = ref.attn_res(blocks + [prefix], f64(s.ckpt.read(names.OUTPUT_ATTN_RES_NORM)),
                                   f64(s.ckpt.read(names.OUTPUT_ATTN_RES_PROJ)), cfg.rms_norm_eps)
        else:
            w = lambda sfx: f64(s.ckpt.read(names.layer(L + 1, sfx)))  # noqa: E731
            want[L] = ref.attn_res(blocks + [prefix], w("self_attention_res_norm.weight"),
                                   w("self_attention_res_proj.weight"), cfg.rms_norm_eps) \
                if blocks else prefix
    ref.forward(cfg, s.ckpt.read, PROMPT, on_layer=on_layer)
    for i, L in enumerate(layers):
        tap = got[0][:, i * E:(i + 1) * E]
        err = np.abs(tap - want[L]).max() / np.abs(want[L]).max()
        assert err < 1e-4, (L, err)
