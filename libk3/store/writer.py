"""The store's writer: states put on the disk tier by a thread of their own.

Owns: the queue of states to write, its bound, the thread, and waiting for what is
queued (``flush``). Does not own: the snapshot files (``libk3.engine.prefix_cache``) or
which states are written (``tiers``).

Why a thread: a snapshot of a long K3 prefix is GBs, seconds to write (bench/README.md
"Prefix cache"); written on the engine thread it would stall every request in flight.
At most ``WRITES_QUEUED`` wait (each holds a state's memory, counted by the budget as
``SERVER_SNAPSHOTS`` with the one being written); one more is dropped, which costs only
a later prefill.
"""

from __future__ import annotations

import queue
import threading

from ..budget import SERVER_SNAPSHOTS

WRITES_QUEUED = SERVER_SNAPSHOTS - 1     # and the one being written: what admission counts


class Writer:
    """Writes each state ``put`` to ``disk`` (a PrefixCache) on its own thread."""

    def __init__(self, disk):
        self.disk = disk
        self._writes: queue.Queue = queue.Queue(WRITES_QUEUED)
        self._thread = threading.Thread(target=self._loop, name="k3-snapshots", daemon=True)
        self._thread.start()

    def put(self, state) -> bool:
        """Queue ``state`` (not changed after this); False when the queue is full (it is
        dropped)."""
        try:
            self._writes.put_nowait(state)
            return True
        except queue.Full:
            return False

    def _loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            if isinstance(item, threading.Event):     # ``flush``: all before it written
                item.set()
                continue
            self.disk.store(item)

    def flush(self) -> None:
        """Wait until every state queued so far is written."""
        done = threading.Event()
        self._writes.put(done)
        done.wait()

    def close(self) -> None:
        """Finish the queued writes and end the thread."""
        self._writes.put(None)
        self._thread.join()
