"""The size bars of the house (docs/architecture.md "The stages"): no libk3 module above
500 lines, no function above 12 parameters, no libk3 room other than kernels/ above 12
modules, and every room named in docs/architecture.md.

Each allow-list below holds today's offenders with their size now: an entry may only
shrink, a new offender fails, and an entry whose offender is fixed fails until it is
removed, so the lists only ever get shorter.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500
MAX_PARAMETERS = 12
MAX_MODULES = 12

# module -> its lines today; each to be split by what it owns
LONG_MODULES = {
}
# "module:function" -> its parameters today (self and cls not counted)
MANY_PARAMETERS = {}
# room -> its modules today (kernels/ is exempt: one numba kernel family per module)
BIG_ROOMS = {}
EXEMPT_ROOMS = {"libk3/kernels"}


def module_lines(root: Path = ROOT) -> dict:
    return {p.relative_to(root).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
            for p in sorted((root / "libk3").rglob("*.py"))}


def parameter_counts(root: Path = ROOT) -> dict:
    """"module:Class.function" -> its parameters (``*args``/``**kw`` count one each; a
    method's self or cls does not)."""
    out = {}
    for p in sorted((root / "libk3").rglob("*.py")):
        rel = p.relative_to(root).as_posix()

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = child.args
                    names = [x.arg for x in (*a.posonlyargs, *a.args)]
                    n = len(names) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                    if prefix and names[:1] in (["self"], ["cls"]):
                        n -= 1
                    out[f"{rel}:{prefix}{child.name}"] = n
                    visit(child, f"{prefix}{child.name}.")
                else:
                    visit(child, prefix)

        visit(ast.parse(p.read_text(encoding="utf-8")), "")
    return out


def rooms(root: Path = ROOT) -> dict:
    """libk3 folder -> its modules (``__init__.py`` not counted)."""
    return {d.relative_to(root).as_posix(): len([f for f in d.glob("*.py")
                                                  if f.name != "__init__.py"])
            for d in sorted((root / "libk3").rglob("*"))
            if d.is_dir() and (d / "__init__.py").is_file()}


def over(found: dict, limit: int, allowed: dict, exempt=()) -> list:
    """The bar's failures: a new offender, an allowed one that grew, or an allowed one
    now within the bar (its entry must go)."""
    out = []
    for name, n in sorted(found.items()):
        if name in exempt or n <= limit:
            continue
        if name not in allowed:
            out.append(f"{name}: {n} > {limit}")
        elif n > allowed[name]:
            out.append(f"{name}: {n}, grew past its allow-list entry {allowed[name]}")
    for name, was in sorted(allowed.items()):
        if found.get(name, 0) <= limit:
            out.append(f"{name}: within the bar now ({found.get(name, 0)}), remove its "
                       f"allow-list entry ({was})")
    return out


def test_house_no_module_above_500_lines():
    assert over(module_lines(), MAX_LINES, LONG_MODULES) == []


def test_house_no_function_above_12_parameters():
    assert over(parameter_counts(), MAX_PARAMETERS, MANY_PARAMETERS) == []


def test_house_no_room_above_12_modules():
    assert over(rooms(), MAX_MODULES, BIG_ROOMS, EXEMPT_ROOMS) == []


def test_house_architecture_names_every_room():
    """Catches a new room (or a renamed one) the contributors' map does not show."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [r for r in rooms() if f"`{r}/`" not in text]
    assert missing == []


def test_house_checkers_see_each_kind_of_offence(tmp_path):
    """Control: a long module, a 13-parameter method, a 13-module room, a grown and a
    fixed allow-list entry are each reported; self does not count."""
    pkg = tmp_path / "libk3" / "big"
    pkg.mkdir(parents=True)
    (tmp_path / "libk3" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    for i in range(13):
        (pkg / f"m{i}.py").write_text("")
    args = ", ".join(f"a{i}" for i in range(12))
    (pkg / "m0.py").write_text(f"class C:\n    def f(self, {args}):\n        pass\n"
                               f"    def g(self, {args}, *more):\n        pass\n"
                               + "x = 1\n" * 501)
    assert rooms(tmp_path)["libk3/big"] == 13
    params = parameter_counts(tmp_path)
    assert params["libk3/big/m0.py:C.f"] == 12 and params["libk3/big/m0.py:C.g"] == 13
    assert over(params, 12, {}) == ["libk3/big/m0.py:C.g: 13 > 12"]
    lines = module_lines(tmp_path)
    assert over(lines, 500, {"libk3/big/m0.py": 504}) == [
        "libk3/big/m0.py: 506, grew past its allow-list entry 504"]
    assert over(lines, 500, {"libk3/big/m1.py": 600}) == [
        "libk3/big/m0.py: 506 > 500",
        "libk3/big/m1.py: within the bar now (0), remove its allow-list entry (600)"]
    assert over(rooms(tmp_path), 12, {}) == ["libk3/big: 13 > 12"]
    assert over(rooms(tmp_path), 12, {}, {"libk3/big"}) == []
