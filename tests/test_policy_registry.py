"""The cache-policy table: each policy one module declaring itself, nothing chosen by name
outside it (libk3/policies/registry.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from libk3.policies import registry
from libk3.policies.registry import POLICIES, PolicyInfo, _declarations

ROOT = Path(__file__).resolve().parents[1]


def test_policy_table_order_names_and_default_are_todays():
    """Catches a declaration change that would reorder k3-trace's columns or k3-run's
    --cache-policy choices (both printed, both pinned by scripts)."""
    assert list(POLICIES) == ["lru", "belady", "pin+lru", "s3fifo", "lfu", "layer-lfu",
                              "adaptive"]
    assert registry.ONLINE_OBJECT_POLICIES == ("adaptive", "layer-lfu", "lru")
    assert registry.DEFAULT_POLICY == "adaptive"
    assert [p for p in POLICIES if not POLICIES[p].online] == ["belady", "pin+lru"]


@pytest.mark.parametrize("name", list(POLICIES))
def test_policy_declaration_read_from_source_is_the_imported_one(name):
    """Catches a declaration the source scan reads differently from what the module
    builds, or a module missing a function of the protocol its declaration promises."""
    info = POLICIES[name]
    mod = registry.load(name)
    assert mod.POLICY == PolicyInfo(**{**vars(info), "module": ""})
    assert callable(mod.replay)
    assert info.live == hasattr(mod, "live_state") == hasattr(mod, "resident")
    for f in ("leader", "switches", "shadow_misses"):
        assert hasattr(mod, f) == bool(info.shadows)
    assert set(info.shadows) <= set(POLICIES) - {name}
    if info.state_parts:
        assert registry.stepping(info.state_parts) is mod
        assert hasattr(mod, "lookup") and hasattr(mod, "admit")
    if info.live:
        assert len(mod.live_state(2, 4, 3)) == info.state_parts


def test_policy_pin_note_says_the_fractions_it_tries():
    from libk3.policies import pin_lru
    assert POLICIES["pin+lru"].note == (
        f"pins the best of {', '.join(f'{f:g}' for f in pin_lru.PIN_FRACTIONS)} of the slots")


def test_policy_a_new_module_is_found_and_duplicates_refused(tmp_path):
    """Adding a policy is adding one module: the scan finds it, in rank order; two
    modules declaring one name (or no default) are refused."""
    decl = 'from .registry import PolicyInfo\n\nPOLICY = PolicyInfo(name="{n}", online=True, ' \
           'summary="s", rank={r}{d})\n'
    (tmp_path / "b.py").write_text(decl.format(n="fifo", r=5, d=""))
    (tmp_path / "a.py").write_text(decl.format(n="clock", r=7, d=", default=True"))
    (tmp_path / "c.py").write_text("POLICY = 3\n")                  # no declaration
    found = _declarations(tmp_path)
    assert list(found) == ["fifo", "clock"] and found["fifo"].module == "b"
    (tmp_path / "d.py").write_text(decl.format(n="fifo", r=9, d=""))
    with pytest.raises(RuntimeError, match="unique"):
        _declarations(tmp_path)


def test_policy_names_are_chosen_nowhere_outside_their_modules():
    """Catches a name chain creeping back (``if policy == "lru"``, a dict keyed by policy
    names) in libk3 or the front ends: only a policy's own module, the registry and the
    precompile table (which names each policy's numba signatures) may spell a name."""
    names = set(POLICIES)
    allowed = {"libk3/engine/precompile.py"}
    found = []
    for path in sorted([*(ROOT / "libk3").rglob("*.py"), *(ROOT / "tools").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("libk3/policies/") or rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{rel}:{node.lineno} {node.value!r}")
    assert found == []


def test_policy_online_object_runs_each_live_policy_through_its_module():
    from libk3.policies.online import OnlinePolicy
    for name in registry.ONLINE_OBJECT_POLICIES:
        pol = OnlinePolicy(name, 3, n_layers=2, n_experts=4)
        out = pol.access([0, 1, 0])
        assert out[:, 2].tolist() == [0, 0, 1]
        assert sorted(k for k in pol.resident().tolist() if k >= 0) == [0, 1]
        assert (pol.leader is None) == (not POLICIES[name].shadows)
    assert np.all(out[:, 0] >= 0)
