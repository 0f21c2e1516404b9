"""An exclusive lock on one file, held by the process for as long as it runs.

Owns: taking, waiting for and naming the holder of a BSD ``flock`` on a file (a batch's
results file: one run per results file). Does not own: what the locked file contains.

Why flock on the file itself: the kernel drops the lock when its process dies, even by
kill -9, so there is never a stale lock to clean up, and no lock file is left beside the
user's results. Why not POSIX ``fcntl`` record locks: closing *any* descriptor of the file
drops them, and the results file is opened again for every appended line.
Locks like these may not hold across machines on network filesystems (formats/batch.md).
"""

from __future__ import annotations

import fcntl
import os
import time

from ..errors import BusyError


def holder_pid(fd: int) -> int | None:
    """The pid holding a flock on ``fd``'s file, from /proc/locks (Linux); else None."""
    st = os.fstat(fd)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; blocked waiters say "->"
                if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
                    continue
                if parts[5].lower() == dev:
                    return int(parts[4])
    except (OSError, ValueError):
        return None
    return None


class FileLock:
    """``FileLock(path).acquire(wait=..., until=..., notice=...)``; released by ``release()``
    or by the process ending. Creates ``path`` (empty) if it does not exist."""

    def __init__(self, path):
        self.path = str(path)
        self.fd: int | None = None

    @staticmethod
    def _holder(fd) -> str:
        pid = holder_pid(fd)
        return f"pid {pid}" if pid is not None else "another process"

    def acquire(self, *, wait: bool = False, until: float | None = None, notice=None,
                poll: float = 0.25, clock=time.monotonic) -> bool:
        """Take the lock. Without ``wait`` a held lock raises BusyError at once. With
        ``wait``, ``notice(text)`` is called once, then it polls until the lock is free
        (True) or ``clock()`` passes ``until`` (False, lock not taken)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            told = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    self.fd = fd
                    return True
                except BlockingIOError:
                    if not wait:
                        raise BusyError(f"locked by {self._holder(fd)}: one run per "
                                        "results file", path=self.path,
                                        hint="add --wait to queue behind it") from None
                if not told and notice is not None:
                    notice(f"{self.path}: locked by {self._holder(fd)}; waiting for it")
                    told = True
                if until is not None and clock() >= until:
                    os.close(fd)
                    return False
                time.sleep(poll)
        except BaseException:
            if self.fd is None:
                os.close(fd)
            raise

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)            # closing the only descriptor drops the flock
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
