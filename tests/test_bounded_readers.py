"""Every file an option names (-f, --system @FILE, --response-format @FILE) is read in
bounded time and memory: a FIFO, /dev/zero or a huge file is refused at once, one line,
non-zero exit (``libk3.io.bounded``)."""

from __future__ import annotations

import json
import os
import time

import pytest

from .scripts import k3_here


@pytest.fixture
def hostile(tmp_path):
    """A FIFO nobody writes to, /dev/zero, and a sparse 4 GiB file."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(4 * 2 ** 30)
    return {"fifo": fifo, "zero": "/dev/zero", "huge": huge}


@pytest.mark.parametrize("kind", ["fifo", "zero", "huge"])
def test_option_files_that_never_end_are_refused_at_once(tiny_dir, tmp_path, hostile, kind):
    """Catches an @FILE or -f read whole (@/dev/zero reached 3 GB in 2.5 s, then a
    MemoryError traceback) or a FIFO's open blocking forever: each is one line, exit
    2 or 3, within seconds; a regular small file is read (control)."""
    path = hostile[kind]
    for args, code in ((("-f", path), 3), (("-p", "hi", "--response-format", f"@{path}"), 2),
                       (("--chat", "--system", f"@{path}"), 2)):
        t0 = time.monotonic()
        r = k3_here(tiny_dir, *args, "-n", "1", input="")
        assert r.returncode == code, (args, r.stderr)
        assert str(path) in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert time.monotonic() - t0 < 30
    ok = tmp_path / "s.json"
    ok.write_text(json.dumps({"type": "object"}))
    r = k3_here(tiny_dir, "-p", "hi", "-n", "1", "--response-format", f"@{ok}", "-q")
    assert r.returncode == 0, r.stderr


def test_bounded_lines_drops_a_long_line_without_holding_it(tmp_path):
    """Catches a line reader that reads a line whole before measuring it (a 32 MB line
    then takes 32 MB): the long line is its size only, its neighbours and a line exactly
    at the bound are read as they are (control), and Python's peak stays near the chunk."""
    import tracemalloc
    from libk3.io.bounded import Oversize, bounded_lines
    p = tmp_path / "lines"
    big = 32 * 2 ** 20
    with open(p, "wb") as f:
        f.write(b"first\n" + b"x" * 1000 + b"\n")
        f.write(b"y" * big + b"\n")
        f.write(b"z" * 1001 + b"\nlast")
    tracemalloc.start()
    with open(p, "rb") as f:
        got = [(n, ln if isinstance(ln, Oversize) else len(ln))
               for n, ln in bounded_lines(f, 1000, chunk=2 ** 16)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got == [(1, 5), (2, 1000), (3, Oversize(big, 1000)), (4, Oversize(1001, 1000)), (5, 4)]
    assert peak < 4 * 2 ** 20, peak


def test_batch_line_of_many_mb_is_skipped_by_its_size_and_the_rest_runs(tiny_dir, tmp_path):
    """Catches a batch file read whole (a huge line or file in memory at once): a 24 MB
    line is skipped with its number and size, the good lines beside it run (control),
    and a rerun resumes (the good ones found done, the long one skipped again)."""
    batch, out = tmp_path / "b.jsonl", tmp_path / "r.jsonl"
    big = b'{"id": 2, "prompt": "' + b"a" * (24 * 2 ** 20) + b'", "gen": 2}'
    with open(batch, "wb") as f:
        f.write(b'{"id": 1, "prompt": "Hello", "gen": 2}\n' + big + b"\n")
        f.write(b'{"id": 3, "prompt": "Bye", "gen": 2}\n')
    r = k3_here(tiny_dir, "--batch", batch, "--out", out, "--ctx-size", "256")
    assert r.returncode == 0, r.stderr
    assert f"{batch}:2: skipped: the line is {len(big):,} bytes, more than the" in r.stderr, r.stderr
    assert sorted(json.loads(ln)["id"] for ln in out.read_text().splitlines()) == [1, 3]
    again = k3_here(tiny_dir, "--batch", batch, "--out", out, "--ctx-size", "256",
                    "--json")
    assert again.returncode == 0, again.stderr
    summary = json.loads(again.stdout)
    assert summary["skipped"] == 2 and summary["malformed"] == 1 and summary["done"] == 0
