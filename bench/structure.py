"""The shape of libk3 and the front ends, in numbers: modules per room, imports that run
back up the layers, import circles, the longest function and the most parameters.

    python bench/structure.py [--root TREE]

``--root`` measures another checkout (a worktree of an earlier commit) by today's rules:
the layers of this checkout's tests/test_layers.py."""

from __future__ import annotations

import argparse
import ast
import collections
import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def load_layers(root: Path):
    spec = importlib.util.spec_from_file_location("_layers", root / "tests" / "test_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def package_of(mod: str) -> str:
    """A module's room: libk3.<room> for a package's modules, the module itself if flat."""
    parts = mod.split(".")
    return ".".join(parts[:2])


def functions(root: Path):
    """(lines, parameters, where) of every function in libk3/ and tools/."""
    for folder in ("libk3", "tools"):
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
                    n -= 1 if a.args and a.args[0].arg in ("self", "cls") else 0
                    lines = node.end_lineno - node.lineno + 1
                    yield lines, n, f"{path.relative_to(root)}:{node.lineno} {node.name}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=HERE)
    root = ap.parse_args().root.resolve()
    layers = load_layers(HERE)
    g = layers.import_graph(root)
    rooms = collections.Counter(package_of(m) for m in g)
    print("modules per room:", ", ".join(f"{r.removeprefix('libk3.')} {n}"
                                        for r, n in sorted(rooms.items())))
    back = [v for v in layers.violations(root) if "a later layer" in v]
    print(f"imports back up the layers: {len(back)}", *back, sep="\n  ")
    room_graph = collections.defaultdict(set)
    for m, ts in g.items():
        for t in ts:
            if package_of(t) != package_of(m):
                room_graph[package_of(m)].add(package_of(t))
    mc, rc = layers.circles(g), layers.circles(dict(room_graph))
    print(f"circles: {len(mc)} between modules {mc}, {len(rc)} between rooms {rc}")
    fns = list(functions(root))
    longest = max(fns)
    most = max(fns, key=lambda f: (f[1], f[0]))
    print(f"longest function: {longest[0]} lines ({longest[2]})")
    print(f"most parameters: {most[1]} ({most[2]})")


if __name__ == "__main__":
    main()
