"""Hostile files: config.json, state files, traces and batch lines, mutated at random and
by name. Every damaged or implausible file is refused with exit 3 and one line naming it,
in bounded time, never a traceback; every bad batch line is that line's error only
(README "Exit codes", formats/state.md, formats/trace.md; tests/hostile.py).

Random cases call the library through the front ends' error wrapper (fast); the named
end-to-end cases with peak RSS are in tests/test_hostile_e2e.py.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libk3.trace import format as tr
from libk3.config import load_config
from libk3.run import batch as batchfile
from libk3.io.checkpoint import Checkpoint
from libk3.model.state import SavedDraft, State
from libk3.trace.report import replay_report, trace_stats

from .conftest import TINY
from .hostile import call, check_clean, check_refused, fail
from .hostile_inputs import (HUGE_INT, NESTED, TRACE_HEADER, craft_state, damaged,
                             model_with_config, rewrite_trace_header, small_trace,
                             state_header)

HYP = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                 HealthCheck.too_slow])
MIN_TEMPERATURE = 2.0 ** -126
MAX_GEN = 1 << 20


# ---- config.json -------------------------------------------------------------------------

def _tiny_config(tiny_dir):
    return json.loads((tiny_dir / "config.json").read_text())


CONFIG_KEYS = [("text_config", k) for k in (
    "hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "num_attention_heads",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "num_experts", "num_experts_per_token", "num_shared_experts",
    "routed_expert_hidden_size", "moe_intermediate_size", "first_k_dense_replace",
    "intermediate_size", "attn_res_block_size", "activation_situ_beta")] + [
    ("linear_attn_config", k) for k in ("num_heads", "head_dim", "short_conv_kernel_size",
                                        "full_attn_layers", "kda_layers")]

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
              st.sampled_from([10**9, 10**12, 2**63, -(2**63), 65535, 65536, 0, -1]),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                               max_size=3),
    max_leaves=8)


def _set(doc, where, key, value):
    scope = doc["text_config"] if where == "text_config" else \
        doc["text_config"]["linear_attn_config"]
    if value is _DELETE:
        scope.pop(key, None)
    else:
        scope[key] = value


_DELETE = object()


@settings(max_examples=50, **HYP)
@given(edits=st.lists(st.tuples(st.sampled_from(CONFIG_KEYS),
                                st.one_of(json_values, st.just(_DELETE))),
                      min_size=1, max_size=3))
def test_config_random_mutations_open_or_are_refused_cleanly(tiny_dir, tmp_path_factory, edits):
    """Property: any edit of config.json either opens (the shards agree) or is refused
    with exit 3 and one line naming a file of the model, quickly (catches tracebacks on
    ill-typed values and loops sized by a number in the config)."""
    doc = _tiny_config(tiny_dir)
    for (where, key), value in edits:
        _set(doc, where, key, value)
    d = model_with_config(tiny_dir, tmp_path_factory.mktemp("cfg") / "m",
                           json.dumps(doc, allow_nan=True))

    def open_and_close():
        Checkpoint.open(d).close()

    out = call(open_and_close, seconds=10)
    check_clean(out, codes=(0, 3))
    if out.code:
        assert str(d) in out.stderr


@pytest.mark.parametrize("name,edit", [
    ("layers 1e9", lambda d: d["text_config"].update(num_hidden_layers=10**9)),
    ("experts 1e9", lambda d: d["text_config"].update(num_experts=10**9)),
    ("experts 65535", lambda d: d["text_config"].update(num_experts=65535)),
    ("layers 65535", lambda d: d["text_config"].update(num_hidden_layers=65535)),
    ("hidden 1e12", lambda d: d["text_config"].update(hidden_size=10**12)),
    ("vocab 2^63", lambda d: d["text_config"].update(vocab_size=2**63)),
    ("heads 1e9", lambda d: d["text_config"]["linear_attn_config"].update(num_heads=10**9)),
    ("eps NaN", lambda d: d["text_config"].update(rms_norm_eps=float("nan"))),
    ("beta inf", lambda d: d["text_config"].update(activation_situ_beta=float("inf"))),
])
def test_config_implausible_sizes_are_refused_quickly(tiny_dir, tmp_path, name, edit):
    """Catches validation that loops or allocates per layer or expert a config claims
    before comparing the claim with the shards."""
    doc = _tiny_config(tiny_dir)
    edit(doc)
    d = model_with_config(tiny_dir, tmp_path / "m", json.dumps(doc, allow_nan=True))
    check_refused(call(lambda: Checkpoint.open(d).close(), seconds=10), 3, str(d))


@pytest.mark.parametrize("text", ["", " ", NESTED, '{"text_config": ' + HUGE_INT + "}",
                                  "[1, 2]", "\xff\xfe", '{"text_config": ' + NESTED + "}"],
                         ids=["empty", "blank", "nested", "huge-int", "array", "latin1",
                              "nested-inside"])
def test_config_unparseable_is_refused_naming_the_file(tiny_dir, tmp_path, text):
    """Catches json's RecursionError and its int-digits ValueError escaping the config
    reader (only JSONDecodeError was caught)."""
    d = model_with_config(tiny_dir, tmp_path / "m", "")
    (d / "config.json").write_bytes(text.encode("latin-1"))
    check_refused(call(load_config, d), 3, "config.json")


# ---- state files ---------------------------------------------------------------------------

# The weights identity these crafted states claim (any the loader is told to expect).
WEIGHTS = "5e" * 32


# The draft these crafted states' draft context claims, and its rows' shapes.
DRAFT = "d7" * 32


def _random_state(cfg, draft: bool = True) -> State:
    """A state after 5 tokens, with every array non-zero, and (``draft``) a draft
    context of two layers covering the 5 positions."""
    st_ = State(cfg)
    rng = np.random.default_rng(0)
    for store in (st_.kda_S, st_.kda_conv, st_.mla_latent, st_.mla_rope):
        for a in store.values():
            a[...] = rng.standard_normal(a.shape)
    st_.pos, st_.ids = 5, [1, 2, 3, 4, 5]
    st_.logits = rng.standard_normal(cfg.vocab_size).astype(np.float32)
    if draft:
        st_.draft = SavedDraft(DRAFT, rng.standard_normal((2, 5, 8)).astype(np.float32),
                               rng.standard_normal((2, 5, 4)).astype(np.float32))
    return st_


@pytest.fixture(scope="module")
def saved_state(tiny_dir, tmp_path_factory):
    """(config, path, bytes) of ``_random_state`` saved."""
    cfg = load_config(tiny_dir)
    path = tmp_path_factory.mktemp("state") / "good.k3state"
    _random_state(cfg).save(path, WEIGHTS)
    return cfg, path, path.read_bytes()


def test_state_control_loads_identically(saved_state):
    """Control for every state case: the untouched file loads to the same arrays."""
    cfg, path, _ = saved_state
    st_ = State.load(cfg, path, WEIGHTS)
    again = State.load(cfg, path, WEIGHTS)
    assert st_.pos == 5 and st_.ids == [1, 2, 3, 4, 5]
    for L in st_.kda_S:
        assert np.array_equal(st_.kda_S[L], again.kda_S[L]) and st_.kda_S[L].any()
    assert np.array_equal(st_.logits, _random_state(cfg).logits)
    saved = _random_state(cfg).draft
    assert st_.draft.identity == DRAFT and np.array_equal(st_.draft.latent, saved.latent)
    assert np.array_equal(st_.draft.k_pe, saved.k_pe)


def test_state_v4_loads_without_a_draft_context(saved_state, tmp_path):
    """Catches the format's version 5 refusing the version 4 files (every saved state and
    prefix-cache snapshot before it), which hold the same but for a draft context."""
    cfg, _, _ = saved_state
    plain = tmp_path / "plain.k3state"
    _random_state(cfg, draft=False).save(plain, WEIGHTS)
    v4 = tmp_path / "v4.k3state"
    v4.write_bytes(craft_state(plain.read_bytes(), edit=lambda h: h.pop("draft"), version=4))
    got, want = State.load(cfg, v4, WEIGHTS), State.load(cfg, plain, WEIGHTS)
    assert got.draft is None and got.ids == want.ids
    assert np.array_equal(got.mla_latent[3][:5], want.mla_latent[3][:5])
    v4.write_bytes(craft_state(v4.read_bytes(), edit=lambda h: h.update(draft=None)))
    check_refused(call(State.load, cfg, v4, WEIGHTS), 3, str(v4))     # not a v4 key


@settings(max_examples=60, **HYP)
@given(data=st.data())
def test_state_any_damage_is_refused_naming_the_file(saved_state, tmp_path_factory, data):
    """Property: truncating, flipping any one byte or appending to a state file is refused
    with exit 3 naming it (catches loading damaged arrays as numbers: v1 had no checksum)."""
    cfg, _, blob = saved_state
    bad = damaged(data, blob)
    p = tmp_path_factory.mktemp("st") / "bad.k3state"
    p.write_bytes(bad)
    check_refused(call(State.load, cfg, p, WEIGHTS), 3, str(p))


def _header_edits(cfg):
    lay = sorted(set(range(cfg.num_hidden_layers)) - {L - 1 for L in cfg.full_attn_layers})
    k0, m0 = lay[0], cfg.full_attn_layers[0] - 1
    return {
        "pos 1e12": lambda h: h.update(pos=10**12),
        "pos -1": lambda h: h.update(pos=-1),
        "pos float": lambda h: h.update(pos=5.0),
        "pos past ids": lambda h: h.update(pos=6),
        "ids short": lambda h: h.update(ids=[1, 2]),
        "id outside vocab": lambda h: h.update(ids=[1, 2, 3, 4, cfg.vocab_size]),
        "id negative": lambda h: h.update(ids=[1, 2, 3, 4, -1]),
        "ids not a list": lambda h: h.update(ids="12345"),
        "fingerprint": lambda h: h.update(fingerprint="0" * 64),
        "weights": lambda h: h.update(weights="0" * 64),
        "weights not a string": lambda h: h.update(weights=[WEIGHTS]),
        "missing weights": lambda h: h.pop("weights"),
        "unknown key": lambda h: h.update(colour="red"),
        "missing arrays": lambda h: h.pop("arrays"),
        "array renamed": lambda h: h["arrays"][0].__setitem__(0, "kda_S.999"),
        "array dropped": lambda h: h["arrays"].pop(),
        "array duplicated": lambda h: h["arrays"].append(h["arrays"][0]),
        "negative shape": lambda h: h["arrays"][0].__setitem__(-1, [-1] + h["arrays"][0][-1][1:]),
        "huge shape": lambda h: h["arrays"][0].__setitem__(-1, [2**40, 2**40]),
        "shape not ints": lambda h: h["arrays"][0].__setitem__(-1, "big"),
        "array not a list": lambda h: h["arrays"].__setitem__(0, 7),
        f"layer {k0} as MLA": lambda h: h["arrays"][0].__setitem__(0, f"mla_latent.{k0}"),
        f"layer {m0} as KDA": lambda h: [a.__setitem__(0, f"kda_S.{m0}") for a in h["arrays"]
                                         if a[0] == f"mla_latent.{m0}"],
        "header array": lambda h: h.clear(),
        "draft missing": lambda h: h.pop("draft"),
        "draft not an object": lambda h: h.update(draft=[DRAFT]),
        "draft identity short": lambda h: h["draft"].update(identity="d7"),
        "draft identity not hex": lambda h: h["draft"].update(identity="zz" * 32),
        "draft layers 0": lambda h: h["draft"].update(layers=0),
        "draft layers huge": lambda h: h["draft"].update(layers=2 ** 40),
        "draft latent float": lambda h: h["draft"].update(latent=8.0),
        "draft unknown key": lambda h: h["draft"].update(colour="red"),
        "draft rows not listed": lambda h: h.update(draft=None),
        "draft shape disagrees": lambda h: h["draft"].update(rope=5),
    }


@pytest.mark.parametrize("name", list(_header_edits(load_config(TINY))))
def test_state_header_field_errors_are_refused(saved_state, tmp_path, name):
    """Catches a loader that trusts the header's positions, ids, names or shapes (each
    edit keeps the framing and checksum right, so only that field is wrong)."""
    cfg, _, blob = saved_state
    p = tmp_path / "crafted.k3state"
    p.write_bytes(craft_state(blob, edit=_header_edits(cfg)[name]))
    check_refused(call(State.load, cfg, p, WEIGHTS, seconds=10), 3, str(p))


@pytest.mark.parametrize("name,make", [
    ("empty", lambda blob: b""),
    ("magic only", lambda blob: blob[:8]),
    ("prefix only", lambda blob: blob[:16]),
    ("header length past end", lambda blob: blob[:12] + struct.pack("<I", 1 << 30) + blob[16:]),
    ("nested header", lambda blob: craft_state(blob, header=NESTED.encode())),
    ("huge int header", lambda blob: craft_state(blob, header=json.dumps(
        state_header(blob)).replace('"pos": 5', '"pos": ' + HUGE_INT).encode())),
    ("version 1", lambda blob: craft_state(blob, version=1)),
    ("version 2", lambda blob: craft_state(blob, version=2)),
    ("version 3", lambda blob: craft_state(blob, version=3)),
    ("version 99", lambda blob: craft_state(blob, version=99)),
])
def test_state_named_damage_is_refused(saved_state, tmp_path, name, make):
    """Catches an empty, partial, nested or old-version state slipping past the loader
    (a version 2 file records no weights identity, a version 3 file no last logits: it
    must be re-created)."""
    cfg, _, blob = saved_state
    p = tmp_path / "bad.k3state"
    p.write_bytes(make(blob))
    line = check_refused(call(State.load, cfg, p, WEIGHTS, seconds=10), 3, str(p))
    if name.startswith("version"):
        assert "version" in line
    if name in ("version 1", "version 2", "version 3"):
        assert "older k3" in line and "re-create" in line, line


@pytest.mark.parametrize("array,value", [("kda_S.0", np.nan), ("kda_conv.1", -np.inf),
                                         ("mla_latent.3", np.inf), ("mla_rope.3", np.nan),
                                         ("logits", np.inf), ("draft_latent", np.nan),
                                         ("draft_rope", np.inf)])
def test_state_holding_nan_or_inf_is_refused_naming_the_array(saved_state, tmp_path, array,
                                                              value):
    """Catches a loader that accepts NaN or Inf in a state's arrays (framing and checksum
    right: a state saved from damaged weights, or rewritten), which then generates from
    garbage; the refusal names the file and the array (control:
    test_state_control_loads_identically)."""
    cfg, _, _ = saved_state
    st_ = _random_state(cfg)
    if array == "logits":
        st_.logits[3] = value
    elif array.startswith("draft"):
        (st_.draft.latent if array == "draft_latent" else st_.draft.k_pe).reshape(-1)[3] = value
    else:
        kind, L = array.rsplit(".", 1)
        getattr(st_, kind)[int(L)].reshape(-1)[3] = value
    p = tmp_path / "nan.k3state"
    st_.save(p, WEIGHTS)
    line = check_refused(call(State.load, cfg, p, WEIGHTS, seconds=10), 3, str(p), array)
    assert "NaN or Inf" in line


def test_state_of_other_weights_is_refused_naming_the_file(saved_state):
    """Catches a loader that checks only the configuration's fingerprint: a state computed
    with other weights of the same configuration is refused, naming the file (control:
    the same file loads when the expected identity is its own)."""
    cfg, path, _ = saved_state
    line = check_refused(call(State.load, cfg, path, "0" * 64, seconds=10), 3, str(path))
    assert "other weights" in line
    assert State.load(cfg, path, WEIGHTS).ids == [1, 2, 3, 4, 5]


def test_state_save_is_atomic_and_leaves_no_temporary(saved_state, tmp_path):
    """Catches a save that writes in place (a crash leaves half a state under the final
    name) or leaves its temporary behind."""
    cfg, path, blob = saved_state
    st_ = State.load(cfg, path, WEIGHTS)
    target = tmp_path / "s.k3state"
    target.write_bytes(b"previous")
    st_.save(target, WEIGHTS)
    assert target.read_bytes() == blob
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.k3state"]


# ---- traces --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_trace(tmp_path_factory):
    p = small_trace(tmp_path_factory.mktemp("tr") / "good.k3trace")
    trace_stats(tr.TraceReader(p))                                       # control
    return p.read_bytes()


@settings(max_examples=60, **HYP)
@given(data=st.data())
def test_trace_any_damage_is_refused_naming_the_file(good_trace, tmp_path_factory, data):
    """Property: truncating, flipping a byte of or appending to a complete trace is refused
    by stats and replay with exit 3 naming it; none reads as a complete trace, except a
    flip inside zstd's own framing that decodes to the very same records (the format's
    CRCs cover the records, formats/trace.md; zstd ignores a few frame bits), which must
    read exactly as the undamaged trace."""
    bad = damaged(data, good_trace)
    p = tmp_path_factory.mktemp("trd") / "bad.k3trace"
    p.write_bytes(bad)
    if len(bad) == len(good_trace) and call(lambda: trace_stats(tr.TraceReader(p))).code == 0:
        good = p.with_name("good.k3trace")
        good.write_bytes(good_trace)
        assert tr.TraceReader(p).read_all().tobytes() == tr.TraceReader(good).read_all().tobytes()
        assert tr.TraceReader(p).header == tr.TraceReader(good).header
        return
    check_refused(call(lambda: trace_stats(tr.TraceReader(p))), 3, str(p))
    check_refused(call(lambda: replay_report(tr.TraceReader(p), policies=["lru"],
                                             slots=[5])), 3, str(p))


def test_trace_frame_declaring_a_huge_size_is_refused_naming_the_file(good_trace, tmp_path):
    """Catches a damaged frame whose zstd header declares hundreds of TB: zstd allocated
    that before max_output_size applied (MemoryError, exit 4 instead of 3)."""
    m = good_trace.find(b"\x28\xb5\x2f\xfd")                # the first frame's zstd magic
    bad = good_trace[:m + 4] + bytes([good_trace[m + 4] ^ 0x80]) + good_trace[m + 5:]
    p = tmp_path / "bad.k3trace"
    p.write_bytes(bad)
    for fn in (lambda: trace_stats(tr.TraceReader(p)),
               lambda: replay_report(tr.TraceReader(p), policies=["lru"], slots=[5])):
        check_refused(call(fn), 3, str(p))
    p.write_bytes(good_trace)                                             # control
    assert call(lambda: trace_stats(tr.TraceReader(p))).code == 0


@pytest.mark.parametrize("name,text", [
    ("nested", NESTED.encode()),
    ("huge int", b'{"n_layers": ' + HUGE_INT.encode() + b"}"),
    ("not utf-8", b'{"created_by": "\xff"}'),
    ("array", b"[]"),
])
def test_trace_unparseable_header_is_refused_naming_the_file(good_trace, tmp_path, name, text):
    """Catches json's RecursionError or int-digits ValueError escaping the trace reader
    (the header checksum is right, so only its JSON is wrong)."""
    p = tmp_path / "h.k3trace"
    p.write_bytes(rewrite_trace_header(good_trace, text))
    check_refused(call(lambda: tr.TraceReader(p)), 3, str(p))


def test_trace_crashed_run_never_leaves_a_complete_trace(tmp_path, monkeypatch):
    """Catches a run that, failing after the trace was opened, closes the trace normally:
    the end marker and the rename make a failed run's trace read as complete."""
    from libk3.run import runner

    final = tmp_path / "run.k3trace"

    class FakeRun:
        def __init__(self, opts):
            self.trace = tr.TraceWriter(final, TRACE_HEADER)
            self.trace.append(0, tr.PHASE_DECODE, 1, [3, 4])
            self.session = None
            self.drafting = None

        close = runner.Run.close

    class Closed:
        def close(self):
            pass

    monkeypatch.setattr(runner, "Run", FakeRun)
    with pytest.raises(RuntimeError):
        with runner.open_run(runner.RunOptions(model="m", trace_path=str(final))) as run:
            run.session = type("S", (), {"weights": Closed(), "ckpt": Closed()})()
            raise RuntimeError("the run failed")
    if final.exists():
        fail("exit0", f"a failed run published {final} as a complete trace")
    partial = final.with_name(final.name + tr.PARTIAL_SUFFIX)
    with pytest.raises(Exception, match="end marker"):
        tr.TraceReader(partial).read_all()
    r = tr.TraceReader(partial, tolerate_truncated_tail=True)
    assert r.read_all().size == 2 and r.tail_error is not None

    with runner.open_run(runner.RunOptions(model="m", trace_path=str(final))) as run:
        run.session = type("S", (), {"weights": Closed(), "ckpt": Closed()})()
    assert tr.TraceReader(final).read_all().size == 2                    # control


# ---- replay and sizing bounds ---------------------------------------------------------------

def test_replay_capacity_of_1e12_slots_is_exact_and_small(tmp_path):
    """Catches a replay that allocates per slot: 10^12 slots must give the hit-rate
    ceiling (nothing is ever evicted) without allocating for them."""
    p = small_trace(tmp_path / "t.k3trace")
    out = call(lambda: replay_report(tr.TraceReader(p), policies=list(
        __import__("libk3.policies.registry", fromlist=["POLICIES"]).POLICIES),
        slots=[10**12], capacities_gb=[1e6]), seconds=300)     # the first run compiles
    check_clean(out)
    rep = replay_report(tr.TraceReader(p), policies=["lru", "belady", "pin+lru", "s3fifo",
                                                     "layer-lfu"], slots=[10**12, 4096])
    for row in rep["capacities"]:
        for cell in row["policies"].values():
            assert cell["misses"] == rep["compulsory_misses"]


# ---- batch lines ---------------------------------------------------------------------------

VOCAB = 512
setting_values = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70),
    st.sampled_from([0, 1, -1, 2**64 - 1, 2**64, MAX_GEN, MAX_GEN + 1, 10**18]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-320, 5e-324, MIN_TEMPERATURE, 1e-39, 0.5, 1.0, 1.0000001]),
    st.text(max_size=4), st.lists(st.integers(-3, VOCAB + 3), max_size=3),
    st.lists(st.text(max_size=3), max_size=2))


def _documented(job) -> bool:
    """The README's batch-line rules, independently of the implementation."""
    def num(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    t, p = job.get("temperature", 0), job.get("top_p", 1)
    ok = (isinstance(job.get("gen", 0), int) and not isinstance(job.get("gen", 0), bool)
          and -1 <= job.get("gen", 0) <= MAX_GEN             # -1: until the end
          and num(t) and math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE)
          and num(p) and math.isfinite(p) and 0 < p <= 1
          and isinstance(job.get("seed", 0), int) and not isinstance(job.get("seed", 0), bool)
          and 0 <= job.get("seed", 0) < 2**64)
    stop_ids = job.get("stop_ids", [])
    return ok and isinstance(stop_ids, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < VOCAB for i in stop_ids)


@settings(max_examples=200, **HYP)
@given(fields=st.dictionaries(st.sampled_from(["gen", "temperature", "top_p", "seed", "stop",
                                               "stop_ids"]), setting_values, max_size=4))
def test_batch_line_settings_are_checked_exactly(fields):
    """Property: a batch line is accepted iff its settings meet the README's rules; a bad
    one is a BatchLineError (that line's error), never another exception (catches NaN
    temperature accepted, a negative seed reaching numpy, stop_ids never checked)."""
    line = json.dumps({"id": 1, "ids": [1, 2], **fields}, allow_nan=True)
    want = _documented(fields) and (
        "stop" not in fields or (isinstance(fields["stop"], str) and fields["stop"] != "")
        or (isinstance(fields["stop"], list)
            and all(isinstance(s, str) and s != "" for s in fields["stop"])))
    try:
        batchfile.parse_line(line.encode(), VOCAB)      # a line as read: bytes
    except batchfile.BatchLineError:
        assert not want, f"refused a good line {line}"
        return
    except Exception as e:                       # noqa: BLE001
        pytest.fail(f"HOSTILE[traceback] {type(e).__name__} on {line[:200]}", pytrace=False)
    assert want, f"HOSTILE[exit0] accepted {line[:200]}"


@pytest.mark.parametrize("line", [
    NESTED, '{"id": ' + HUGE_INT + ', "ids": [1]}', '{"id": 1, "ids": [' + HUGE_INT + "]}",
    '{"id": 1, "ids": [1], "stop_ids": 5}', '{"id": 1, "ids": [1], "stop_ids": "abc"}',
    '{"id": 1, "ids": [1], "gen": 1e400}', '{"id": 1, "ids": [1], "gen": 10000000000000000000}',
    '{"id": 1, "ids": [1], "seed": -1}', '{"id": 1, "ids": [1], "temperature": NaN}',
    '{"id": 1, "ids": [1], "top_p": Infinity}', '{"id": [1], "ids": [1]}',
], ids=["nested", "huge-id", "huge-token", "stop_ids-int", "stop_ids-str", "gen-inf",
        "gen-huge", "seed-neg", "temp-nan", "top_p-inf", "id-list"])
def test_batch_named_bad_lines_are_line_errors(line):
    """Catches a bad line raising past parse_line (aborting the batch) or being run."""
    try:
        batchfile.parse_line(line.encode(), VOCAB)      # a line as read: bytes
    except batchfile.BatchLineError:
        return
    except Exception as e:                       # noqa: BLE001
        pytest.fail(f"HOSTILE[traceback] {type(e).__name__}: {str(e)[:200]}", pytrace=False)
    pytest.fail(f"HOSTILE[exit0] accepted {line[:100]}", pytrace=False)
