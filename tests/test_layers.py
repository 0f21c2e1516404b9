"""Imports run one way (docs/architecture.md "The stages"): every libk3 module imports only its own
layer and the layers below it, and nothing in libk3 imports click (the front ends' job)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module belongs to the longest prefix listed; it may import modules of its
# own layer and of the layers before it, never after.
LAYERS = (
    ("libk3", "libk3.errors", "libk3.names", "libk3.config", "libk3.vision_config",
     "libk3.k3_dims", "libk3.progress", "libk3.units"),
    ("libk3.io", "libk3.machine", "libk3.text", "libk3.media", "libk3.constrain"),
    ("libk3.kernels",),
    ("libk3.policies", "libk3.budget"),
    ("libk3.pack",),
    ("libk3.model", "libk3.stream"),
    ("libk3.draft",),
    ("libk3.trace",),
    ("libk3.synth",),
    ("libk3.engine", "libk3.speculate", "libk3.store"),
    ("libk3.request",),
    ("libk3.run",),
    ("libk3.doctor", "libk3.serve"),
)
RANK = {prefix: i for i, layer in enumerate(LAYERS) for prefix in layer}


def layer_of(module: str):
    """The layer of a module: its longest listed prefix (the bare package ``libk3`` only
    for itself, so a new flat module must be placed here)."""
    if module == "libk3":
        return RANK[module]
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in RANK:
            return RANK[".".join(parts[:n])]
    return None


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path):
    """(line, imported module) for every import in the file, function-level ones too;
    ``from pkg import name`` yields pkg.name when that is a module."""
    mod = module_name(path, root)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield node.lineno, target
            for a in node.names:
                sub = root / Path(*f"{target}.{a.name}".split("."))
                if sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file():
                    yield node.lineno, f"{target}.{a.name}"


def violations(root: Path = ROOT) -> list:
    out = []
    for path in sorted((root / "libk3").rglob("*.py")):
        mod = module_name(path, root)
        mine = layer_of(mod)
        if mine is None:
            out.append(f"{mod}: in no layer of tests/test_layers.py")
            continue
        for line, target in imports(path, root):
            if target == "click" or target.startswith("click."):
                out.append(f"{mod}:{line} imports click")
            elif target.startswith("libk3"):
                theirs = layer_of(target)
                if theirs is None or theirs > mine:
                    out.append(f"{mod}:{line} imports {target} (a later layer)")
    return out


def import_graph(root: Path = ROOT) -> dict:
    """libk3 module -> the libk3 modules it imports (function-level imports too)."""
    mods = {module_name(p, root): p for p in (root / "libk3").rglob("*.py")}
    return {mod: {t for _, t in imports(path, root) if t in mods and t != mod}
            for mod, path in mods.items()}


def circles(graph: dict) -> list:
    """The import circles of ``graph``: each strongly connected set of more than one
    module, sorted (Tarjan's algorithm, iterative)."""
    index, low, on, stack, found = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_layers_no_module_imports_itself_through_others():
    """Catches an import circle inside a layer (two modules of one room importing each
    other, as the runner and the batch sink once did): a module must be readable
    without the one that uses it."""
    assert circles(import_graph()) == []


def test_layers_circles_finds_a_circle():
    """Control of the check above: a -> b -> c -> a and a lone d -> a."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(g) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_layers_imports_run_one_way_and_libk3_never_imports_click():
    """Catches a backward import (io or kernels importing model, stream importing the
    engine...) or click creeping back into libk3, lazy imports inside functions included."""
    assert violations() == []


def test_layers_checker_sees_backward_lazy_and_click_imports(tmp_path):
    """Control: the checker flags each kind of violation it exists for."""
    pkg = tmp_path / "libk3"
    for sub in ("io", "engine"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "run.py").write_text("from ..io import disk\n")
    (pkg / "io" / "disk.py").write_text("def f():\n    from ..engine import run\n")
    (pkg / "io" / "cli.py").write_text("import click\n")
    (pkg / "flat.py").write_text("")
    found = violations(tmp_path)
    assert found == ["libk3.flat: in no layer of tests/test_layers.py",
                     "libk3.io.cli:1 imports click",
                     "libk3.io.disk:2 imports libk3.engine (a later layer)",
                     "libk3.io.disk:2 imports libk3.engine.run (a later layer)"], found
