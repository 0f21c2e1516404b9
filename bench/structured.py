"""Structured output: validity over schemas and seeds, and what the token mask costs.

1. `small` (resident): a batch of 5 JSON schemas x 20 seeds at temperature 1, each line
   constrained by its schema (`response_format`); every reply that ends (not cut by
   `gen`) must parse and validate (jsonschema). Prints valid / ended and the mask's
   milliseconds per generated token (`grammar_mask_seconds`).
2. `medium` at the floor budget: one prompt with `--response-format json_object` and the
   same without, side by side: seconds per token of each and the mask's share of a token.

    python bench/structured.py [--seeds 20] [--gen 48] [--medium-gen 4] [--skip-medium]

Models are made in scratch/ (ignored) as the other benches make them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from batch_throughput import floor_flags  # noqa: E402

SCRATCH = HERE.parent / "scratch"
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name"],
     "properties": {"name": {"type": "string", "maxLength": 16}}},
    {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
     "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                    "ok": {"type": "boolean"}}},
    {"type": "object", "additionalProperties": False, "required": ["kind"],
     "properties": {"kind": {"enum": ["ship", "boat", "raft"]}}},
    {"type": "object", "additionalProperties": False, "required": ["tags"],
     "properties": {"tags": {"type": "array", "maxItems": 3,
                             "items": {"type": "string", "maxLength": 6}}}},
    {"type": "object", "additionalProperties": False, "required": ["at"],
     "properties": {"at": {"type": "object", "additionalProperties": False,
                           "required": ["x", "y"],
                           "properties": {"x": {"type": "integer", "maximum": 9, "minimum": 0},
                                          "y": {"type": "integer", "maximum": 9,
                                                "minimum": 0}}}}},
]


def model(preset: str) -> Path:
    d = SCRATCH / preset
    if not (d / "config.json").exists():
        subprocess.run(["k3-pack", "synth", preset, str(d)], check=True)
    return d


def validity(seeds: int, gen: int) -> None:
    import jsonschema
    from libk3.text.tokenizer import K3Tokenizer
    d = model("small")
    tok = K3Tokenizer.from_dir(d)
    with tempfile.TemporaryDirectory() as tmp:
        batch, out = Path(tmp) / "b.jsonl", Path(tmp) / "r.jsonl"
        lines = [{"id": f"s{i}-{seed}", "prompt": "Describe it as JSON:", "gen": gen,
                  "temperature": 1.0, "seed": seed,
                  "response_format": {"type": "json_schema",
                                      "json_schema": {"name": f"s{i}", "schema": schema}}}
                 for i, schema in enumerate(SCHEMAS) for seed in range(seeds)]
        batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
        p = subprocess.run(["k3-run", str(d), "--resident", "--batch", str(batch), "--out",
                            str(out), "--json", "-q"], capture_output=True, text=True)
        if p.returncode:
            sys.exit(p.stderr)
        rows = [json.loads(x) for x in out.read_text().splitlines()]
    ended = valid = 0
    mask = tokens = 0.0
    for r in rows:
        mask += r.get("grammar_mask_seconds") or 0.0
        tokens += len(r["generated_ids"])
        if r["stop_reason"] == "length":
            continue
        ended += 1
        schema = SCHEMAS[int(r["id"][1:].split("-")[0])]
        # the reply is what comes before the end token (generated_text keeps its text)
        text = tok.decode(r["generated_ids"][:-1])
        try:
            jsonschema.validate(json.loads(text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            print(f"INVALID {r['id']}: {text!r}: {e}")
    print(f"small: {len(rows)} lines ({len(SCHEMAS)} schemas x {seeds} seeds), {ended} ended "
          f"before gen {gen}, {valid} of them valid ({100 * valid / max(ended, 1):.1f} %); "
          f"mask {1e3 * mask / max(tokens, 1):.3f} ms per generated token")


def share(gen: int) -> None:
    d = model("medium")
    pack = SCRATCH / "medium.pack"
    where = ["--pack", str(pack)] if pack.exists() else []
    base = ["k3-run", str(d), *where, *floor_flags(d), "--ids", "5,6,7,8", "--gen", str(gen),
            "--temperature", "1", "--json", "-q"]
    reports = {}
    for name, extra in (("plain", []), ("json_object", ["--response-format", "json_object"]),
                        ("plain again", [])):
        p = subprocess.run(base + extra, capture_output=True, text=True)
        if p.returncode:
            sys.exit(p.stderr)
        reports[name] = json.loads(p.stdout)
    for name, r in reports.items():
        n = len(r["generated_ids"])
        mask = r.get("grammar_mask_seconds") or 0.0
        print(f"medium at the floor, {name:12s}: {r['seconds_per_token']:.3f} s/token, mask "
              f"{1e3 * mask / max(n, 1):.3f} ms/token = "
              f"{100 * mask / max(n, 1) / r['seconds_per_token']:.4f} % of a token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--medium-gen", type=int, default=4)
    ap.add_argument("--skip-medium", action="store_true")
    a = ap.parse_args()
    validity(a.seeds, a.gen)
    if not a.skip_medium:
        share(a.medium_gen)


if __name__ == "__main__":
    main()
