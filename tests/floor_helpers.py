"""The floor's one-slot streamer under test: built to read in small pieces, its reads of
one file at or past an offset held until released (or failed), so a test can look at
what a layer hands out while its later bytes are still on their way."""

from __future__ import annotations

import threading


def floor_streamer(cfg, runs, budget: int, monkeypatch, piece: int):
    """(a one-slot trunk streamer over ``runs`` reading in ``piece``-byte pieces, 3 in
    flight, its FileSet)."""
    from libk3.io.direct import FileSet
    from libk3.stream import piece_reader
    from libk3.stream.trunk_modes import open_trunk

    monkeypatch.setattr(piece_reader, "FOREGROUND", (piece, 3))
    files = FileSet()
    ts = open_trunk(cfg, runs, budget, files)
    assert ts.n_slots == 1
    return ts, files


class HeldReads:
    """Reads of ``path`` through ``files`` (a FileSet) that start at or past file offset
    ``at`` wait for ``release()`` (30 s at most), or raise ``error`` if given."""

    def __init__(self, files, path, at: int, error: BaseException | None = None):
        self.go = threading.Event()
        self.held = 0                      # reads that waited or failed
        f = files.get(path)
        read_window = f.read_window

        def held(offset, nbytes, buf, **kw):
            if offset >= at:
                self.held += 1
                if error is not None:
                    raise error
                self.go.wait(30)
            return read_window(offset, nbytes, buf, **kw)
        f.read_window = held

    def release(self) -> None:
        self.go.set()


def within(fn, seconds: float = 10.0):
    """fn()'s result if it returns within ``seconds`` on another thread, else
    AssertionError (the thread is left to finish once whatever holds it is released)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:              # re-raised on the caller's thread
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise AssertionError(f"still waiting after {seconds} s")
    if "error" in out:
        raise out["error"]
    return out["value"]
