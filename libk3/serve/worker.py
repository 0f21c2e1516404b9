"""The server's driver of the engine core: queued requests decoded together, on one thread.

Owns: the request queue, the engine thread that keeps up to ``width`` requests in the
lanes of one ``EngineCore`` (continuous batching: a request queued while others decode
joins at the next pass; one that finishes, or whose client went away, leaves at once and
frees its lane), asking the core to start each request from the server's state store
and offer states back to it (reuse of earlier turns; a conversation's preamble kept),
handing each lane's tokens back to the event loop as they are sampled, and the counters
``/health`` reports. Does not own: HTTP (``app``), the wire format (``protocol``), the
loop, admission from the store, n-way forks, sampling, log-probabilities and its
same-tokens-as-alone rule (``libk3.engine.core``), the kept states (``turn_cache``,
``libk3.store``), or the width (``libk3.budget.batch_width``, through ``Run.width``).

Why one thread: the model's weights, caches and scratch buffers belong to one pass at a
time; the lanes' States are their own, so a pass serves every request in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
import time

from ..engine.core import EngineCore, Request
from ..engine.defaults import PREFILL_CHUNK

_RUN_FIGURES = ("cache_hit_rate", "expert_requests", "trunk_bytes_read", "expert_bytes_read",
                "peak_rss_bytes")


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
    preamble: int = 0             # prompt tokens worth keeping on their own (0: none)
    logprobs: int | None = None   # alternatives per token to report (None: no logprobs)
    echo: bool = False            # also the prompt's logprobs (a completion's echo)
    images: tuple = ()            # ``forward.ImageRows`` at the prompt's pads
    # TokenLogprob of each generated token, appended on the engine thread before the
    # token is sent (so the loop finds a token's entry once it has the token), and of
    # each prompt token after the first (with echo and logprobs)
    token_logprobs: list = dataclasses.field(default_factory=list)
    prompt_logprobs: list = dataclasses.field(default_factory=list)
    # n > 1: the other choices of this request (the core forks them off this job's lane:
    # ``core.Request.n``), each told on its own Job
    followers: list = dataclasses.field(default_factory=list)
    started: float = 0.0          # when it took a lane (time.monotonic)
    generated: int = 0
    # when its first and latest token reached the server's loop (time.monotonic; the
    # access log's time to first token and time per output token)
    first_token_at: float | None = None
    last_token_at: float | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def _send(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:          # the server's loop is closed: nobody is waiting
            pass


class Worker:
    """Decodes submitted jobs, up to ``width`` at once, on its own thread; ``log(line)``
    gets one line per finished request (tokens, s/token, cache hits: ``Run.report``)."""

    def __init__(self, run, width: int = 1, log=None, turns=None,
                 chunk: int = PREFILL_CHUNK):
        self.run, self.width, self.log = run, width, log
        self.turns = turns              # a TurnCache (reuse of earlier turns), or None
        self.queue: queue.Queue = queue.Queue()
        self.counts = {"served": 0, "cancelled": 0, "failed": 0, "generated_tokens": 0}
        # sums over served requests (``/metrics``): prompt tokens (and those resumed from
        # a kept state), seconds prefilling and decoding
        self.totals = {"prompt_tokens": 0, "reused_tokens": 0, "prefill_seconds": 0.0,
                       "decode_seconds": 0.0}
        self.jobs: dict = {}            # (tag, choice) -> Job, for the jobs in the core
        self._tags = itertools.count()
        self.last = dict.fromkeys(_RUN_FIGURES)     # Run.report's, at the last request
        self.core = EngineCore(run.session.forward, lambda n: run.session.new_state(), width,
                               chunk=chunk, tokenizer=run.session.tokenizer,
                               drafting=run.drafting, store=turns)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.queue.put(job)

    def queued(self) -> int:
        return self.queue.qsize()

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    def close(self) -> None:
        """Cancel the jobs in flight and every queued one, then join the thread."""
        self._closing.set()
        self.queue.put(None)            # wakes the thread if it waits for work
        self._thread.join()

    def _loop(self) -> None:
        while not self._closing.is_set():
            self._admit(wait=not self.jobs)
            for req in self.core.abort(lambda req: self._job(req).cancelled.is_set()):
                self._cancelled(self.jobs.pop((req.tag, req.choice)))
            if self.jobs:
                self._step()
        for req in self.core.abort(lambda req: True):
            self.jobs.pop((req.tag, req.choice))._send(("cancelled", None))
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job._send(("cancelled", None))
                self._drop_followers(job, ("cancelled", None))

    def _admit(self, wait: bool) -> None:
        """Give each free lane a queued job (waiting for one when no lane is busy)."""
        while not self.core.full and not self._closing.is_set():
            try:
                job = self.queue.get(block=wait)
            except queue.Empty:
                return
            wait = False
            if job is not None:
                self._start(job)

    def _start(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._cancelled(job)
            self._drop_followers(job, ("cancelled", None))
            return
        job.started = time.monotonic()
        tag = next(self._tags)
        kept = self.turns is not None       # the core resumes, offers and keeps its states
        req = Request(tag, list(job.prompt_ids), job.settings, logprobs=job.logprobs,
                      echo=job.echo, n=1 + len(job.followers), images=tuple(job.images),
                      reuse=kept, offer=kept,
                      store_at=(job.preamble,) if kept and job.preamble else ())
        try:
            self.core.add(req)
            job.reused = req.reused
        except Exception as e:            # a bad request must not stop the server
            self._failed(job, e)
            self._drop_followers(job, ("error", e))
            return
        for i, one in enumerate([job, *job.followers]):
            one.started = job.started
            self.jobs[(tag, i)] = one

    def _job(self, req) -> Job:
        return self.jobs[(req.tag, req.choice)]

    def _step(self) -> None:
        try:
            events = self.core.step()
        except Exception as e:            # the pass failed for every lane in it
            self.core.abort(lambda req: True)
            jobs, self.jobs = list(self.jobs.values()), {}
            for job in jobs:
                self._failed(job, e)
            return
        for ev in events:
            req = ev.request
            if ev.kind == "token":
                tok, lp = ev.data
                if lp is not None:        # before the token: the loop finds its entry
                    self._job(req).token_logprobs.append(lp)
                self._token(req, tok)
            elif ev.kind == "prompt_logprobs":
                self._job(req).prompt_logprobs.extend(ev.data)
            elif ev.kind == "kept":
                self._keep(req, *ev.data)
            elif ev.kind == "done":
                self._done(req, ev.data)
            elif ev.kind == "failed":
                self._lane_failed(req, ev.data)

    def _keep(self, req, state, fed: int) -> None:
        """A lane's prompt reached the point its other choices fork off
        (``core.Request.n``)."""
        job = self._job(req)
        if req.choice == 0 and job.followers and fed == len(req.prompt_ids) - 1:
            for f in job.followers:    # the prompt's logprobs so far: all of them
                f.prompt_logprobs = list(job.prompt_logprobs)

    def _drop_followers(self, job: Job, item) -> None:
        """The other choices of a job that never reached the core share its end."""
        for f in job.followers:
            f._send(item)

    def _token(self, req, tok) -> None:
        job = self._job(req)
        job.generated += 1
        job._send(tok)

    def _done(self, req, res) -> None:
        job = self.jobs.pop((req.tag, req.choice))
        job.reused = len(job.prompt_ids) - len(req.prompt_ids)   # a choice forked: all but one
        res.prompt_ids = list(job.prompt_ids)        # what the client sent, reused or not
        self.counts["served"] += 1
        self.counts["generated_tokens"] += len(res.generated_ids)
        self.totals["prompt_tokens"] += len(res.prompt_ids)
        self.totals["reused_tokens"] += job.reused
        self.totals["prefill_seconds"] += res.prefill_seconds
        self.totals["decode_seconds"] += res.decode_seconds
        rep = self.run.report(res)
        self.last = {k: rep[k] for k in _RUN_FIGURES}
        if self.log:
            from ..run.report import short_text
            rep["startup_seconds"] = None          # said once, when the server started
            self.log(f"request: {len(res.prompt_ids)} prompt tokens ({job.reused} reused), "
                     f"{len(self.jobs) + 1} in flight; {short_text(rep)}")
        # last: a client holding its response finds its log line and /health figures
        job._send(("done", res))

    def _cancelled(self, job: Job) -> None:
        self.counts["cancelled"] += 1
        job._send(("cancelled", None))
        if self.log and job.started:
            self.log(f"request cancelled by its client after "
                     f"{time.monotonic() - job.started:.2f} s")

    def _lane_failed(self, req, e: Exception) -> None:
        """One lane failed on its own (its grammar gave up): that request alone ends."""
        self._failed(self.jobs.pop((req.tag, req.choice)), e)

    def _failed(self, job: Job, e: Exception) -> None:
        """Counted here; logged once, with the request's id, where its answer is made."""
        self.counts["failed"] += 1
        job._send(("error", e))

    def figures(self) -> dict:
        """What ``/health`` reports of the engine: the core's width, passes, tokens and
        most requests in flight, seconds in passes per generated token, and the run's
        figures as of the last finished request (expert cache hits, bytes, peak RSS); with
        drafting, its counters (``speculative.SpecStats``)."""
        st = self.core.stats
        n = st.generated_tokens
        drafting = self.run.drafting
        return {"width": self.width, "in_flight": len(self.jobs), "passes": st.passes,
                "prompt_tokens": st.prompt_tokens, "generated_tokens": n,
                "max_in_flight": st.max_active, "seconds": round(st.seconds, 6),
                "seconds_per_token": round(st.seconds / n, 6) if n else None, **self.last,
                "speculative": None if drafting is None else drafting.stats.to_json()}
