"""The server's one engine: queued requests decoded on one thread through one ``Run``.

Owns: the request queue, the engine thread, handing each job's tokens back to the event
loop as they are produced, cancelling a job whose client went away, and the counters
``/health`` reports. Does not own: HTTP (``app``), the wire format (``protocol``) or
generation itself (``libk3.engine.runner.run_one``).

Why one thread: the model's state, caches and scratch buffers belong to one forward at
a time. The loop takes a *list* of jobs (``_take``) and hands it to ``_decode``, which
today runs them one after another; a lockstep scheduler can take several and decode them
together without changing the queue or the handlers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time

from ..engine.runner import Abandoned, run_one
from ..errors import K3Error

WIDTH = 1                 # jobs decoded together (lockstep batch decoding: later)


@dataclasses.dataclass
class Job:
    """One request's generation. ``events`` (an asyncio.Queue on the server's loop)
    receives each token id, then ("done", GenResult), ("cancelled", None) or
    ("error", K3Error or exception)."""
    prompt_ids: list
    settings: object
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    reused: int = 0               # prompt tokens resumed from a kept state, not prefilled

    def cancel(self) -> None:
        self.cancelled.set()

    def _send(self, item) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Worker:
    """Decodes submitted jobs in arrival order on its own thread; ``log(line)`` gets one
    line per finished request (tokens, s/token, cache hits: ``Run.report``)."""

    def __init__(self, run, log=None, turns=None):
        self.run = run
        self.log = log
        self.turns = turns              # a TurnCache (reuse of earlier turns), or None
        self.queue: queue.Queue = queue.Queue()
        self.counts = {"served": 0, "cancelled": 0, "failed": 0, "generated_tokens": 0}
        self.busy = False
        self.current = None             # the job being decoded
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.queue.put(job)

    def queued(self) -> int:
        return self.queue.qsize()

    def close(self) -> None:
        """Cancel the job in hand and every queued one, then join the thread."""
        if self.current is not None:
            self.current.cancel()
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job._send(("cancelled", None))
        self.queue.put(None)
        self._thread.join()

    def _take(self, width: int) -> list:
        """The next jobs: wait for one, then take up to ``width`` - 1 more already queued."""
        jobs = [self.queue.get()]
        while len(jobs) < width and jobs[-1] is not None:
            try:
                jobs.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return jobs

    def _loop(self) -> None:
        while True:
            jobs = self._take(WIDTH)
            live = [j for j in jobs if j is not None]
            self._decode(live)
            if len(live) < len(jobs):
                return

    def _decode(self, jobs: list) -> None:
        for job in jobs:
            self._run(job)

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            self.counts["cancelled"] += 1
            job._send(("cancelled", None))
            return
        self.busy, self.current = True, job
        started = time.monotonic()
        state, reused = self.turns.take(job.prompt_ids) if self.turns else (None, 0)
        state = state if state is not None else self.run.session.new_state()
        job.reused = reused
        try:
            res = run_one(self.run, job.prompt_ids[reused:], job.settings, on_token=job._send,
                          should_stop=job.cancelled.is_set, state=state,
                          after_prefill=self.turns.offer if self.turns else None)
        except Abandoned:
            self.counts["cancelled"] += 1
            job._send(("cancelled", None))
            if self.log:
                self.log(f"request cancelled by its client after {time.monotonic() - started:.2f} s")
            return
        except Exception as e:            # a bad request must not stop the server
            self.counts["failed"] += 1
            job._send(("error", e))
            if self.log:
                self.log(f"request failed: {e.one_line() if isinstance(e, K3Error) else repr(e)}")
            return
        finally:
            self.busy, self.current = False, None
        res.prompt_ids = list(job.prompt_ids)        # what the client sent, reused or not
        if self.turns:
            self.turns.offer(state)                  # the conversation with this reply
        self.counts["served"] += 1
        self.counts["generated_tokens"] += len(res.generated_ids)
        job._send(("done", res))
        if self.log:
            from ..engine.report import short_text
            rep = self.run.report(res)
            rep["startup_seconds"] = None          # said once, when the server started
            self.log(f"request: {len(res.prompt_ids)} prompt tokens ({reused} reused); "
                     f"{short_text(rep)}")
