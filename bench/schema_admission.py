"""Schema admission (libk3/constrain/schema_check.py): how long the checks a schema passes
before it is admitted take, for ordinary schemas, schemas no value satisfies, and large
ones near and past SCHEMA_MAX_BYTES. Prints one row per schema: its JSON size, seconds,
and the verdict. Run: python bench/schema_admission.py"""

from __future__ import annotations

import json
import time

from libk3.constrain.grammar import JSON_OPTIONS
from libk3.constrain.schema_check import schema_problem


def _props(n: int) -> dict:
    return {"type": "object", "required": [f"p{i}" for i in range(min(300, n))],
            "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]{3,9}$"}
                           for i in range(n)}}


CASES = {
    "object": {"type": "object"},
    "person": {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150}}},
    "email": {"type": "string", "format": "email"},
    "list-of-200": {"type": "array", "minItems": 200, "items": {
        "type": "object", "required": ["a"], "properties": {"a": {"type": "string",
                                                                   "minLength": 20}}}},
    "self-ref": {"$ref": "#"},
    "required-recursion": {"type": "object", "required": ["a"],
                           "properties": {"a": {"$ref": "#"}}},
    "string-8000": {"type": "string", "minLength": 8000},
    "props-1000": _props(1000),
    "props-5000": _props(5000),
}


def main() -> None:
    print(f"{'schema':20s} {'bytes':>8s} {'seconds':>8s}  verdict")
    for name, schema in CASES.items():
        size = len(json.dumps(schema, separators=(",", ":")))
        t0 = time.perf_counter()
        why = schema_problem(schema, JSON_OPTIONS)
        dt = time.perf_counter() - t0
        print(f"{name:20s} {size:>8,} {dt:8.3f}  {'admitted' if why is None else why[:70]}")


if __name__ == "__main__":
    main()
