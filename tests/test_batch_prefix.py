"""A batch file's shared prefix, prefilled once (libk3/run/prefixes.py) and kept in the
prefix cache across runs and shards: the same results as every line prefilled whole,
at every lockstep width, with the reuse reported."""

from __future__ import annotations

import json
import random

import pytest

from .scripts import k3, k3_here

CHUNK = 8


def _lines(n=6, shared=27, seed=1):
    """Lines whose ids share ``shared`` leading ids (then 3..8 of their own), plus one
    that shares nothing."""
    r = random.Random(seed)
    pre = [r.randrange(5, 500) for _ in range(shared)]
    lines = [{"id": f"p{i}", "ids": pre + [r.randrange(5, 500) for _ in range(3 + i)],
              "gen": 3, "temperature": 0.7, "seed": i} for i in range(n)]
    lines.append({"id": "alone", "ids": [7, 8, 9, 10, 11], "gen": 3})
    return lines


def _write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _results(path) -> dict:
    return {r["id"]: (r["generated_ids"], r["reused_tokens"], len(r["prompt_ids"]))
            for r in map(json.loads, path.read_text().splitlines())}


def _run(tiny_dir, batch, out, *args):
    res = k3_here(tiny_dir, "--batch", batch, "--out", out, "--prefill-chunk", CHUNK,
                  "--json", "-q", *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def whole(tiny_dir, tmp_path_factory):
    """Every line prefilled whole: the answers to match."""
    d = tmp_path_factory.mktemp("whole")
    batch = _write(d / "b.jsonl", _lines())
    summary = _run(tiny_dir, batch, d / "out.jsonl", "--no-prefix-sharing")
    assert summary["prefixes"]["prompts_resumed"] == 0
    return batch, _results(d / "out.jsonl")


@pytest.mark.parametrize("width", [1, 3])
def test_shared_prefix_prefilled_once_same_results(tiny_dir, tmp_path, whole, width):
    """Catches a shared prefix prefilled per line (no saving), a resumed line whose
    tokens differ from its whole prefill (a shared state mutated by a lane, a wrong
    position), results that report the tail as the prompt, and a line sharing nothing
    resumed from a snapshot of others."""
    batch, want = whole
    summary = _run(tiny_dir, batch, tmp_path / "out.jsonl", "--batch-width", width)
    got = _results(tmp_path / "out.jsonl")
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    assert {k: v[2] for k, v in got.items()} == {k: v[2] for k, v in want.items()}
    assert {k: v[1] for k, v in got.items()} == {**{f"p{i}": 24 for i in range(6)},
                                                 "alone": 0}
    p = summary["prefixes"]
    assert p["prefixes_built"] == 1 and p["prefix_tokens_built"] == 24
    assert p["tokens_reused"] == 6 * 24 and summary["width"] == width


def test_prefix_cache_across_shards_and_runs(tiny_dir, tmp_path, whole):
    """Catches shards that do not meet on one snapshot (each prefix computed per shard
    run), a next run that prefills the preamble again, or any answer that changes."""
    batch, want = whole
    cache = tmp_path / "cache"
    first = _run(tiny_dir, batch, tmp_path / "out.jsonl", "--prefix-cache", cache,
                 "--shard", "1/2")
    second = _run(tiny_dir, batch, tmp_path / "out.jsonl", "--prefix-cache", cache,
                  "--shard", "2/2", "--batch-width", 2)
    assert first["prefixes"]["prefixes_built"] == 1 and first["prefixes"]["cache"]["writes"] == 1
    # read from disk once, then held for every line sharing it (a snapshot is GBs at K3)
    assert second["prefixes"]["prefixes_built"] == 0 and second["prefixes"]["cache"]["hits"] == 1
    assert second["prefixes"]["prompts_resumed"] >= 2
    got = _results(tmp_path / "out.jsonl")
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    names = [p.name for p in cache.iterdir()]
    assert len(names) == 1 and names[0].startswith("0000024-")


def test_chat_lines_share_their_system_prompt(tiny_dir, tmp_path):
    """Catches messages lines (the common case: one long system prompt) whose rendered
    ids are not found to share it."""
    system = "You answer in the style of a terse ship's log. " * 4
    lines = [{"id": i, "messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": q}], "gen": 2}
             for i, q in enumerate(["Hello", "What time is it?", "Where are we?"])]
    batch = _write(tmp_path / "b.jsonl", lines)
    shared = _run(tiny_dir, batch, tmp_path / "a.jsonl")
    whole = _run(tiny_dir, batch, tmp_path / "w.jsonl", "--no-prefix-sharing")
    assert shared["prefixes"]["tokens_reused"] >= 3 * 2 * CHUNK
    a, w = _results(tmp_path / "a.jsonl"), _results(tmp_path / "w.jsonl")
    assert {k: v[0] for k, v in a.items()} == {k: v[0] for k, v in w.items()}
    assert whole["prefixes"]["tokens_reused"] == 0


def test_save_prefix_then_a_prompt_that_extends_it(tiny_dir, tmp_path):
    """Catches --save-prefix that keeps nothing, a later run through the console script
    that does not resume from it, or a resumed run whose tokens differ."""
    cache = tmp_path / "cache"
    pre = ",".join(str(i) for i in range(20, 60))
    full = pre + ",3,4,5"
    saved = k3(tiny_dir, "--ids", pre, "--prefix-cache", cache, "--save-prefix", "--gen", 1,
               "--json", "-q")
    assert saved.returncode == 0, saved.stderr
    assert [p.name[:7] for p in cache.iterdir()] == ["0000040"]
    resumed = k3_here(tiny_dir, "--ids", full, "--prefix-cache", cache, "--gen", 4, "--json",
                      "-q")
    plain = k3_here(tiny_dir, "--ids", full, "--gen", 4, "--json", "-q")
    r, p = json.loads(resumed.stdout), json.loads(plain.stdout)
    assert r["reused_tokens"] == 40 and p["reused_tokens"] == 0
    assert r["generated_ids"] == p["generated_ids"] and r["prompt_ids"] == p["prompt_ids"]


def test_prefix_options_are_checked(tiny_dir, tmp_path):
    """Catches options that go nowhere accepted silently."""
    for args in (["--ids", "1,2", "--save-prefix"],
                 ["--ids", "1,2", "--prefix-cache-gb", "2"],
                 ["--ids", "1,2", "--no-prefix-sharing"],
                 ["--chat", "--prefix-cache", tmp_path]):
        res = k3_here(tiny_dir, *args)
        assert res.returncode == 2 and "prefix" in res.stderr, (args, res.stderr)
