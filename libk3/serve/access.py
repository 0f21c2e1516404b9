"""The server's access log and its request figures for operators (docs/serve.md
"Logs and metrics").

Owns: one line per finished request (ISO time, request id, method and route, status,
prompt and generated tokens, time to first token, total seconds), as text or as one JSON
object per line (``--log-format json``), and the figures ``/metrics`` exposes from them:
histograms of the time to first token, the time per output token and the request
duration, and responses counted by status class. Does not own: HTTP (the server's
middleware calls ``finished``), the engine's counters (``worker``), the exposition format
(``metrics``) or where a line goes (the ``log`` callable). Also aiohttp's own server
log, as one line per record (``http_logger``).

Why histograms with fixed buckets: a streamed token costs milliseconds with the model in
RAM and seconds at the floor, so the buckets span both; Prometheus sums buckets across
servers only when they are the same everywhere.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time

# seconds; +Inf is implied
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
STATUS_CLASSES = ("2xx", "3xx", "4xx", "5xx")
ROUTE_CHARS = 120            # a longer path is cut in the log (one line stays short)
USAGE = "k3_usage"           # where a generating route leaves its Usage in the request


class Histogram:
    """Counts of observed values per bucket, their sum and count (Prometheus' shape)."""

    def __init__(self, bounds):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)       # the last: above every bound
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        i = next((k for k, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list:
        """[(upper bound text, observations at or below it)], ending with "+Inf"."""
        out, running = [], 0
        for bound, count in zip(self.bounds + (float("inf"),), self.counts):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


@dataclasses.dataclass
class Usage:
    """What a generating request did: its tokens and when its first and last generated
    token reached the server's loop (time.monotonic; None: none came)."""

    prompt_tokens: int
    generated_tokens: int
    first_token: float | None
    last_token: float | None


def _route_text(route: str) -> str:
    """The route as one printable field: escapes for control characters and spaces, cut
    at ROUTE_CHARS."""
    text = json.dumps(route)[1:-1].replace(" ", "%20")
    return text if len(text) <= ROUTE_CHARS else text[:ROUTE_CHARS] + "..."


class Access:
    """The access log and request figures of one server. ``log(line)`` writes a line;
    ``json_lines``: JSON objects instead of text; ``clock`` (monotonic) and ``wall``
    (UTC now) are replaceable in tests."""

    def __init__(self, log, json_lines: bool = False, clock=time.monotonic, wall=None):
        self.log, self.json_lines, self.clock = log, json_lines, clock
        self.wall = wall or (lambda: datetime.datetime.now(datetime.timezone.utc))
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.duration = Histogram(DURATION_BUCKETS)
        self.by_class = dict.fromkeys(STATUS_CLASSES, 0)

    def finished(self, rid: str, method: str, route: str, status: int, started: float,
                 usage: Usage | None = None) -> dict:
        """Record one request that ``started`` (clock) and ended now with ``status``;
        its line is logged; returns the line's fields."""
        seconds = self.clock() - started
        self.duration.observe(seconds)
        cls = f"{status // 100}xx"
        if cls in self.by_class:
            self.by_class[cls] += 1
        ttft = tpot = None
        if usage is not None and usage.first_token is not None:
            ttft = usage.first_token - started
            self.ttft.observe(ttft)
            if usage.generated_tokens > 1:
                tpot = (usage.last_token - usage.first_token) / (usage.generated_tokens - 1)
                self.tpot.observe(tpot)
        fields = {"time": self.wall().isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                  "request_id": rid, "method": method, "route": _route_text(route),
                  "status": status,
                  "prompt_tokens": None if usage is None else usage.prompt_tokens,
                  "generated_tokens": None if usage is None else usage.generated_tokens,
                  "ttft_seconds": None if ttft is None else round(ttft, 6),
                  "seconds": round(seconds, 6)}
        if self.log is not None:
            self.log(json.dumps(fields) if self.json_lines else _text(fields))
        return fields


def _text(f: dict) -> str:
    """``TIME ID METHOD ROUTE STATUS prompt=N generated=N ttft=S total=S`` (- when none)."""
    def num(v, unit=""):
        return "-" if v is None else f"{v}{unit}"
    ttft = None if f["ttft_seconds"] is None else f"{f['ttft_seconds']:.3f}"
    return (f"{f['time']} {f['request_id']} {f['method']} {f['route']} {f['status']} "
            f"prompt={num(f['prompt_tokens'])} generated={num(f['generated_tokens'])} "
            f"ttft={num(ttft, 's')} total={f['seconds']:.3f}s")


def access_middleware(access: Access, id_key: str, usage_key: str):
    """The server's outermost aiohttp middleware: every request's line and figures
    (``Access.finished``) once its answer is sent (a stream's last byte included), with
    the id and Usage the routes left in the request under ``id_key`` and ``usage_key``;
    a client that left before the end is logged as 499."""
    import asyncio
    from aiohttp import web

    @web.middleware
    async def middleware(request, handler):
        started, status = access.clock(), 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except (ConnectionError, asyncio.CancelledError):
            status = 499
            raise
        finally:
            access.finished(request.get(id_key, "-"), request.method, request.path, status,
                            started, request.get(usage_key))
    return middleware


def http_logger(log):
    """aiohttp's server logger for ``log``: one line per record, the exception's type
    and message but never its traceback (what the parser refused; a client gone while
    its reply was written)."""

    class OneLine(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            exc = record.exc_info[1] if record.exc_info else None
            if exc is not None:
                text += f": {type(exc).__name__}: {exc}"
            log("aiohttp: " + " ".join(text.split()))

    logger = logging.Logger("k3.serve.aiohttp", logging.INFO)   # not registered globally
    logger.addHandler(OneLine())
    return logger
