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
