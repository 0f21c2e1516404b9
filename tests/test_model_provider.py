"""The weight-provider Protocol (libk3.model.provider) against the real providers and
against what ``Forward`` actually uses."""

from __future__ import annotations

import inspect

import numpy as np

from libk3.engine.session import open_session
from libk3.model.forward import Forward
from libk3.model.provider import WeightProvider
from libk3.model.weights import ResidentWeights, StreamedWeights

MEMBERS = sorted(n for n in vars(WeightProvider) if not n.startswith("_"))


def _params(f) -> list:
    return list(inspect.signature(f).parameters)


def _gaps(cls) -> list:
    """Protocol members ``cls`` lacks, or declares with other parameters or kind."""
    out = []
    for name in MEMBERS:
        want = vars(WeightProvider)[name]
        have = inspect.getattr_static(cls, name, None)
        if have is None:
            out.append(f"{name}: missing")
        elif isinstance(want, property) != isinstance(have, property):
            out.append(f"{name}: property in one, not the other")
        elif not isinstance(want, property) and _params(want) != _params(have):
            out.append(f"{name}: parameters {_params(have)}, want {_params(want)}")
    return out


def test_provider_real_classes_have_every_protocol_member():
    """Catches a provider that lacks a member Forward calls (or takes other arguments):
    it would fail only when a pass first reaches that call, perhaps on one budget only."""
    assert MEMBERS == ["embed", "experts_ahead", "experts_finish", "experts_prefetch",
                       "experts_start", "layer", "max_batch", "model", "release"]
    for cls in (ResidentWeights, StreamedWeights):
        assert _gaps(cls) == [], cls.__name__


def test_provider_gap_check_control_sees_a_missing_member():
    """Control: the check above reports a provider lacking every member, one whose
    ``experts_finish`` is a property and one whose ``layer`` takes other parameters."""
    class Missing:
        pass
    assert _gaps(Missing) == [f"{name}: missing" for name in MEMBERS]

    class Partial(ResidentWeights):
        experts_finish = property(lambda self: None)

        def layer(self, index):
            return {}
    assert _gaps(Partial) == ["experts_finish: property in one, not the other",
                              "layer: parameters ['self', 'index'], want ['self', 'L']"]


class _Recording:
    """Exposes only the Protocol's members of ``inner`` and records which were used."""

    def __init__(self, inner):
        self._inner, self.used = inner, set()

    def __getattr__(self, name):
        if name not in MEMBERS:
            raise AttributeError(f"Forward used {name!r}, which WeightProvider does not declare")
        self.used.add(name)
        return getattr(self._inner, name)


def test_provider_protocol_is_exactly_what_forward_uses(tiny_dir):
    """Catches a Protocol that declares a member Forward never calls (as ``experts(L,
    ids)`` once was) or misses one it does: a pass through a provider that has only the
    declared members uses every one of them, and gives the same logits."""
    sess = open_session(tiny_dir)
    assert isinstance(sess.weights, WeightProvider)
    rec = _Recording(sess.weights)
    got = Forward(sess.cfg, rec)([5, 17, 300, 42], sess.new_state())
    # resident weights read nothing ahead: experts_ahead says so, nothing is prefetched
    assert sorted(rec.used) == [m for m in MEMBERS if m != "experts_prefetch"]
    want = sess.forward([5, 17, 300, 42], sess.new_state())
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    streamed = open_session(tiny_dir, trunk_bytes=10 ** 9, cache_bytes=10 ** 7)
    try:
        rec = _Recording(streamed.weights)
        got = Forward(streamed.cfg, rec)([5, 17, 300, 42], streamed.new_state())
        assert sorted(rec.used) == MEMBERS
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    finally:
        streamed.weights.close()
