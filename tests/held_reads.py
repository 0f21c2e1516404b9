"""Holding a streamer's reads: reads of one file at or past an offset wait until released
(or fail), so a test can look at what a layer hands out while its later bytes are still
on their way."""

from __future__ import annotations

import threading


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
