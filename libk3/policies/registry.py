"""The expert-cache policies by name: the table every policy module declares itself into.

Owns: ``PolicyInfo`` (what a policy declares: name, whether it is online, whether k3-run
can run it live, its summary, footnote, column rank, the shared data its replay needs,
the policies it replays as shadows, its relative replay cost, whether it is the default),
``POLICIES`` (every declared policy, in column order), ``ONLINE_OBJECT_POLICIES`` (those
k3-run can run), ``DEFAULT_POLICY``, name validation and ``load`` (a policy's module).
Does not own: the policies (one module each here in ``libk3.policies``), replaying them
(``libk3.trace.replay``) or the live cache (``libk3.policies.online``).

Adding a policy is adding one module here with a top-level ``POLICY = PolicyInfo(...)``
(keyword arguments, literals only) and the functions of the protocol below; replay,
k3-run's cache and k3-trace find it through this table. Why the declarations are read
from the modules' source (that statement only) rather than imported: the modules import
numba, and the click front ends build their choices from this table at start-up without
it.

The protocol of a policy module (``load(name)``):
  ``replay(rk, slots) -> (hits, extra)``  hits over ``rk.keys`` (a ``ReplayKeys``) with
      1 <= slots <= rk.n_keys; ``extra`` the row's additional fields (may be empty).
  ``live_state(n_layers, n_experts, slots)`` and ``resident(state, slots)``  for a
      policy declared ``live``: the state ``libk3.policies.drive.access`` steps.
  ``leader``, ``switches``, ``shadow_misses`` (state -> value)  for a policy declaring
      ``shadows``.
  ``lookup`` and ``admit`` (numba)  for a policy declaring ``state_parts``, the length
      of its state tuple, by which ``libk3.policies.drive`` picks its steps.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

from ..errors import UsageError


@dataclasses.dataclass(frozen=True)
class PolicyInfo:
    name: str
    online: bool            # False: uses future knowledge, a bound rather than a policy
    summary: str
    rank: int               # column order in k3-trace's tables, smallest first
    live: bool = False      # k3-run can drive its expert cache with it
    default: bool = False   # k3-run's and k3-trace's default (exactly one policy)
    note: str = ""          # the replay table's footnote after "NAME "
    needs: tuple = ()       # ReplayKeys properties its replay reads (computed once)
    shadows: tuple = ()     # policies it replays exactly as shadows (their rows come free)
    state_parts: int = 0    # the length of its state tuple if it steps through drive
    cost: int = 1           # rough relative replay cost, only to schedule long jobs first
    module: str = ""        # filled in: its module in libk3.policies


_HERE = Path(__file__).resolve().parent
_MARK = "POLICY = PolicyInfo("


def _declarations(folder: Path = _HERE) -> dict:
    """name -> PolicyInfo of every module in ``folder`` (this package) declaring ``POLICY``."""
    found = []
    for path in sorted(folder.glob("*.py")):
        node = _declaration(path.read_text(encoding="utf-8"))
        if node is not None:
            kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            found.append(PolicyInfo(**kw, module=path.stem))
    names = [p.name for p in found]
    if len(set(names)) != len(names) or sum(p.default for p in found) != 1:
        raise RuntimeError(f"libk3.policies: policy names must be unique and exactly one "
                           f"the default: {names}")
    return {p.name: p for p in sorted(found, key=lambda p: (p.rank, p.name))}


def _declaration(text: str):
    """The ``PolicyInfo(...)`` call of a module's top-level ``POLICY = PolicyInfo(...)``, or
    None. Only that statement is parsed (its first lines that parse), not the module."""
    if text.startswith(_MARK):
        start = 0
    else:
        start = text.find("\n" + _MARK) + 1
        if start == 0:
            return None
    end = start
    while True:
        end = text.find("\n", end + 1)
        chunk = text[start:] if end < 0 else text[start:end]
        try:
            tree = ast.parse(chunk)
        except SyntaxError:
            if end < 0:
                raise
            continue
        return tree.body[0].value


POLICIES = _declarations()
ONLINE_OBJECT_POLICIES = tuple(sorted(p.name for p in POLICIES.values() if p.live))
DEFAULT_POLICY = next(p.name for p in POLICIES.values() if p.default)


def policy_module(name: str) -> str:
    """The module path of policy ``name`` (without importing it)."""
    return f"libk3.policies.{POLICIES[name].module}"


def load(name: str):
    """The module of policy ``name`` (imports it, and numba)."""
    return importlib.import_module(policy_module(name))


def stepping(state_parts: int):
    """The module whose policy steps through drive with a state of ``state_parts`` parts."""
    for p in POLICIES.values():
        if p.state_parts == state_parts:
            return load(p.name)
    raise KeyError(f"no policy has a {state_parts}-part state")


def check_policy_names(names) -> list:
    """The names, validated against POLICIES (UsageError listing the known ones)."""
    names = list(names)
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise UsageError(f"unknown cache policy {', '.join(unknown) or '(none given)'}",
                         expected=", ".join(POLICIES), found=", ".join(names))
    return names
