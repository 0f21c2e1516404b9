"""Progress of long work, shown the way the place it goes to reads best.

Owns: ``bar``, the one way k3 shows progress: a redrawn bar (tqdm) on a terminal; in a
pipe or a log file, where a redrawn bar becomes a run of carriage returns, one plain line
every ``LOG_EVERY`` seconds (none at all for work that ends sooner); nothing when the
caller says not to (``--quiet``). Does not own: the summary line a tool prints at the end
(always printed, by the tool).
"""

from __future__ import annotations

import sys
import time

LOG_EVERY = 30.0              # seconds between progress lines in a log


def bar(*, desc: str, total=None, unit: str = "it", unit_scale: bool = False,
        initial: int = 0, show: bool = True, stream=None, clock=time.monotonic,
        eta: bool = False):
    """A progress object with tqdm's ``update``, ``set_description``, ``set_postfix``,
    ``set_postfix_str`` and ``close`` (and a context manager). ``eta``: a log line reads
    ``desc: done/total unit, postfix, elapsed s, ETA s`` (the time left at the pace so
    far), for counts of whole items such as a batch's prompts."""
    stream = sys.stderr if stream is None else stream
    if not show:
        return _Silent()
    if _is_terminal(stream):
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, initial=initial,
                    file=stream, leave=False)
    lines = _Lines(desc, total, unit, unit_scale, initial, stream, clock)
    lines.eta = eta
    return lines


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _Silent:
    n = 0

    def update(self, n=1):
        pass

    def set_description(self, desc, refresh=True):
        pass

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        pass

    def set_postfix_str(self, s="", refresh=True):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _amount(n: float, unit: str, scale: bool) -> str:
    if not scale:
        return f"{n:,.0f} {unit}"
    for size, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= size:
            return f"{n / size:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


class _Lines(_Silent):
    """One line per LOG_EVERY seconds: ``desc: done / total (pct), elapsed, postfix``."""

    def __init__(self, desc, total, unit, unit_scale, initial, stream, clock):
        self.desc, self.total, self.unit, self.scale = desc, total, unit, unit_scale
        self.n, self.stream, self.clock = initial, stream, clock
        self.start = self.last = clock()
        self.postfix = ""

    def update(self, n=1):
        self.n += n
        self._due()

    def _due(self) -> None:
        now = self.clock()
        if now - self.last >= LOG_EVERY:
            self.last = now
            self.stream.write(self.line(now) + "\n")
            self.stream.flush()

    eta = False

    def line(self, now) -> str:
        elapsed = now - self.start
        if self.eta and self.total:
            left = "?" if not self.n else f"{elapsed * (self.total - self.n) / self.n:.0f} s"
            tail = f", {self.postfix}" if self.postfix else ""
            return (f"{self.desc}: {self.n:,}/{self.total:,} {self.unit}{tail}, "
                    f"{elapsed:.0f} s, ETA {left}")
        done = _amount(self.n, self.unit, self.scale)
        if self.total:
            done += (f" of {_amount(self.total, self.unit, self.scale)}"
                     f" ({100 * self.n / self.total:.0f}%)")
        tail = f", {self.postfix}" if self.postfix else ""
        return f"{self.desc}: {done}, {now - self.start:.0f} s{tail}"

    def set_description(self, desc, refresh=True):
        self.desc = desc

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        items = dict(ordered_dict or {}, **kwargs)
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())
        self._due()                 # work that reports only its postfix (tokens) still shows

    def set_postfix_str(self, s="", refresh=True):
        self.postfix = s
        self._due()
