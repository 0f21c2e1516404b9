"""The engine core: the one generation loop in k3. Every generation (a one-prompt run, a
chat turn, a batch file, the server's requests) is Requests added to an ``EngineCore``
and ``step()`` run until they are done; what happens is told as Events.

Owns: what a generation is asked and gives (``Request`` with its ``settings.GenSettings``,
``GenResult``, the ``Event``s of a step), admission (a request starts from the state
store's longest prefix of its prompt and keeps states there as it asks), the lanes (at
most ``width`` sequences in flight, each with its own State, Sampler, stop rules and
Speculator), a request's n choices forked from one prefill (``Request.n``), what each
lane puts into the next pass (its next prompt tokens, its one decode token, or its
token and the proposals it verifies), sampling, stop rules, log-probabilities of the
chosen tokens, and the events of a step. Does not own: the kept states
(``libk3.store``), the forward pass (``libk3.model.forward.Forward.run``: one trunk
fetch per layer and one fetch per routed expert for all the pass's sequences), where
requests come from or where their tokens go (the drivers: ``generate`` for one prompt
and a chat turn, ``libk3.run.batch_sink`` for batch files, ``libk3.serve.worker`` for
the server), the width (``libk3.budget.batch_width``), and whether a prompt is admitted
(a driver adds a Request when ``full`` is False).

Same tokens at any width: each lane has its own State and Sampler, and a pass computes
every token exactly as a pass of that sequence alone would (forward.py), so a request's
ids and logits do not depend on the width, its neighbours or when it joined.

Why prompts that enter share one chunk per pass (``chunk`` prompt tokens in all, taken
in slot order) and ride along with the decoding sequences: a pass streams the whole
trunk, so a newcomer's prefill joining the decode step costs no extra trunk read, and
the pass's activations stay at one prefill chunk's plus one token per sequence, the size
the runtime reserve already covers (formats/presets.md). Joining versus a prefill pass
of its own was measured side by side in bench/batch_throughput.py (bench/README.md).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from typing import TYPE_CHECKING

from ..errors import UsageError
from .defaults import PREFILL_CHUNK
from .logprobs import token_logprob
from .sampler import Sampler
from .settings import GenSettings
from .stops import Stops

if TYPE_CHECKING:                  # the model is not imported by option parsing (start-up)
    from ..model.forward import Segment


class Abandoned(Exception):
    """Raised inside generation when a batch's deadline passes (the prompts in flight are
    dropped, to be redone by the next run)."""


@dataclasses.dataclass
class GenResult:
    prompt_ids: list
    generated_ids: list
    stop_reason: str
    prefill_seconds: float
    decode_seconds: float
    logits: np.ndarray | None = None
    spec: dict | None = None
    stop_strings: tuple = ()       # what the text ends at (``stops.returned_text``)
    reused_tokens: int = 0         # of prompt_ids, resumed from a kept state, not prefilled
    grammar_seconds: float | None = None   # computing the grammar's masks (None: no grammar)
    logprobs: list | None = None   # a TokenLogprob per generated token (None: not asked)
    choice: int = 0                # which of its request's ``n`` choices

    @property
    def seconds_per_token(self) -> float:
        n = len(self.generated_ids)
        return self.decode_seconds / n if n else 0.0


@dataclasses.dataclass
class Request:
    """One sequence to generate. ``tag``: the driver's handle, in every Event (and in trace
    records as the sequence's tag). ``state``: the State to continue (it holds what came
    before ``prompt_ids``), else a new one. An empty ``prompt_ids`` continues ``state``
    from the logits it kept of its last position.
    ``keep_at``: counts of ``prompt_ids``, ascending; after each is fed a "kept" Event
    carries the state (a prefix worth keeping, or where other sequences fork off).
    ``logprobs``: alternatives per generated token to report (None: none); with
    ``echo`` also each prompt token's. ``logits``: keep every fed position's logits row
    in the result. ``feed_last``: feed the last generated token too, so the state holds
    the whole reply (a chat continues from it); otherwise a finished lane leaves at once.
    ``interrupted()``: asked before each sampled token joins the reply; True ends the
    request there (stop reason "interrupted"). ``images``: ``forward.ImageRows`` at pads of
    ``prompt_ids``. With the core's state store (``libk3.store``): ``reuse`` starts a
    request without ``state`` from the store's longest strict prefix of ``prompt_ids`` (not
    past its first image; never a request wanting every prompt position's logits), which
    ``add`` cuts from ``prompt_ids`` (``reused``: how many; ``keep_at`` and ``store_at``
    count from the cut); ``store_at``: counts of ``prompt_ids`` after which the state is
    kept in the store (RAM, and at once on disk; ``add`` adds them to ``keep_at``);
    ``offer``: the state is offered to the store once the prompt is in and when the
    request is done."""

    tag: object
    prompt_ids: list
    settings: GenSettings
    state: object = None
    keep_at: tuple = ()
    logprobs: int | None = None
    echo: bool = False
    logits: bool = False
    feed_last: bool = False
    interrupted: object = None
    images: tuple = ()
    n: int = 1
    choice: int = 0
    followers: list = dataclasses.field(default_factory=list)   # choices 1.. until forked
    reuse: bool = False
    store_at: tuple = ()
    offer: bool = False
    reused: int = 0

    @property
    def fork_at(self) -> int:
        """Prompt ids choice 0 feeds before the others fork off (0: they start at once)."""
        return max(len(self.prompt_ids) - 1, 0) if self.followers else 0


@dataclasses.dataclass(frozen=True)
class Event:
    """What a step did for one request. ``kind`` and ``data``:
    "token": (id, TokenLogprob or None), one per generated token, in order;
    "prompt_logprobs": [TokenLogprob] of the prompt ids this pass scored (``echo``);
    "fed": prompt tokens this pass fed (progress);
    "prefilled": the State once the whole prompt is in, before the first token;
    "kept": (State, n) once n of the prompt ids are in, for each n of ``keep_at`` (and
    choice 0's fork point, ``Request.n``);
    "done": the GenResult (the lane has left); "failed": the exception that ended this
    request alone (its grammar, sampler, stops or proposals raised; the lane has left),
    also for each choice not yet forked off it. Each choice (``Request.n``) is a Request
    of its own: its events carry its ``choice``."""
    kind: str
    request: Request
    data: object = None


class Lane:
    """A slot's sequence: where its prompt is, what it generated, when."""

    def __init__(self, req: Request, state, now: float, tokenizer=None, spec=None):
        if not req.prompt_ids and state.pos and state.logits is None:
            raise UsageError("this state does not hold its last position's logits; give a "
                             "prompt to continue it")
        self.req = req
        self.prompt = [int(i) for i in req.prompt_ids]
        self.state = state
        # tokens this lane may generate; its output starts after the state and prompt
        self.limit = req.settings.limit(state.pos + len(self.prompt))
        self.sampler = Sampler.of(req.settings, state.pos + len(self.prompt))
        self.spec = spec                # a Speculator when the run drafts
        self.fed = 0                    # prompt tokens fed so far
        self.next = None                # the sampled token the next pass feeds
        self.generated: list[int] = []
        self.stops = Stops(req.settings, tokenizer, self.sampler.grammar)
        self.reason = None              # set when finished ("error": failed alone)
        self.error = None               # then, what it raised
        self.closing = False            # finished, its last token still to be fed
        self.t_enter = now
        self.t_first = None             # prefill done: first token sampled from here
        self.rows = [] if req.logits else None
        self.logprobs = [] if req.logprobs is not None else None

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    @property
    def echoes(self) -> bool:
        """Whether the prompt's own log-probabilities are reported."""
        return self.req.echo and self.req.logprobs is not None

    def segment(self, ids, n_prompt: int, others: int) -> Segment:
        """The Segment this lane puts into the next pass: ``ids`` of its prompt, or its
        decode token (with the proposals its Speculator chooses to verify, the pass's
        ``others`` sequences riding along)."""
        from ..model.forward import Segment     # not at import: option parsing stays light
        tag = self.req.tag
        if n_prompt or self.spec is None:
            every = self.rows is not None or n_prompt == 0 or self.echoes
            return Segment(ids, self.state, all_logits=every, tag=tag,
                           phase="prefill" if n_prompt else "decode",
                           images=self.req.images if n_prompt else (), at=self.fed)
        room = 0 if self.closing else self.limit - len(self.generated)
        return self.spec.plan(self.state, self.next, room, self.stops.ids,
                              self.sampler, tag, others)

    def take(self, seg: Segment, logits, n_prompt: int, seconds: float, out: list) -> None:
        """Absorb this lane's logits from a pass that fed ``n_prompt`` prompt tokens (or,
        with 0, its decode token and any proposals: the accepted ones are committed and
        count as generated); sample the next token once the prompt is in. Events go to
        ``out``."""
        self.fed += n_prompt
        if n_prompt:
            out.append(Event("fed", self.req, n_prompt))
            if self.echoes:
                start = self.fed - n_prompt
                ids = self.prompt
                out.append(Event("prompt_logprobs", self.req, [
                    token_logprob(row, ids[start + i + 1], self.req.logprobs)
                    for i, row in enumerate(logits) if start + i + 1 < len(ids)]))
        if self.spec is not None:
            if n_prompt:
                self.spec.observe(self.state, seg.taps)
            elif not self.closing:
                kept = []
                for d in self.spec.accept(seg, logits, self.sampler):
                    kept.append(d)            # chosen from the row after the one before
                    if self._emit(d, logits[len(kept) - 1], out):
                        break
                self.spec.commit(seg, len(kept), seconds)
                logits = logits[:len(kept) + 1]
            else:
                self.spec.commit(seg, 0, seconds)
                logits = logits[:1]
        if self.rows is not None:
            self.rows.append(logits)
        if self.closing:
            self.closing = False            # its last token is in: it leaves
            return
        if self.prefilling or self.reason is not None:
            return                          # (an accepted proposal is fed as verified)
        if n_prompt:
            self._prefilled(out)
        self._sample(logits[-1], out)

    def start(self, out: list) -> None:
        """A lane with no prompt ids: its first token comes from the logits its state
        kept of its last position (none for an empty state: nothing is generated)."""
        if not self.prompt:
            self._prefilled(out)
            if self.state.logits is None:
                self.reason = "length"
            else:
                self._sample(self.state.logits, out)

    def _prefilled(self, out: list) -> None:
        self.t_first = time.perf_counter()
        out.append(Event("prefilled", self.req, self.state))

    def _sample(self, row, out: list) -> None:
        if len(self.generated) >= self.limit:
            self.reason = "length"
            return
        if self.req.interrupted is not None and self.req.interrupted():
            self.reason = "interrupted"
            return
        tok = self.sampler(row, self.state.pos, self.state.ids)
        self.next = tok
        if self._emit(tok, row, out) and self.req.feed_last:
            self.closing = True

    def _emit(self, tok: int, row, out: list) -> bool:
        """Count ``tok`` as generated; whether it ends the sequence (stop or length)."""
        lp = None if self.req.logprobs is None else token_logprob(row, tok, self.req.logprobs)
        self.generated.append(tok)
        if lp is not None:
            self.logprobs.append(lp)
        out.append(Event("token", self.req, (tok, lp)))
        self.reason = self.stops.see(tok)
        if self.reason is None and len(self.generated) >= self.limit:
            self.reason = "length"
        return self.reason is not None

    @property
    def finished(self) -> bool:
        return self.reason is not None and not self.closing

    def result(self, now: float) -> GenResult:
        logits = np.concatenate(self.rows).astype(np.float32) if self.rows else None
        if logits is None and self.rows is not None:
            logits = np.zeros((0, self.state.cfg.vocab_size), np.float32)
        t_first = self.t_first if self.t_first is not None else now
        return GenResult(self.prompt, self.generated, self.reason, t_first - self.t_enter,
                         now - t_first, logits,
                         stop_strings=tuple(self.req.settings.stop_strings),
                         grammar_seconds=None if self.sampler.grammar is None else
                         self.sampler.grammar.seconds, logprobs=self.logprobs,
                         choice=self.req.choice, reused_tokens=self.req.reused)


@dataclasses.dataclass
class CoreStats:
    width: int
    passes: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    max_active: int = 0
    seconds: float = 0.0            # inside passes


def plan_pass(lanes: list, chunk: int, join_prefill: bool = True) -> list:
    """[(lane, ids, n_prompt)] for the next pass: prefilling lanes take up to ``chunk``
    prompt tokens in all, in slot order; each decoding lane feeds its one sampled token
    (unless ``join_prefill`` is False and some lane is prefilling: then the pass is
    prefill only)."""
    plan, room = [], chunk
    for lane in lanes:
        if lane.prefilling and room > 0:
            n = min(room, len(lane.prompt) - lane.fed)
            kept = [k for k in lane.req.keep_at if k > lane.fed]
            if kept:                                # the pass ends at the next kept prefix
                n = min(n, kept[0] - lane.fed)
            plan.append((lane, lane.prompt[lane.fed:lane.fed + n], n))
            room -= n
    if join_prefill or not plan:
        plan += [(lane, [lane.next], 0) for lane in lanes if not lane.prefilling]
    return plan


class EngineCore:
    """At most ``width`` lanes in flight: ``add`` a Request when ``full`` is False,
    ``step`` runs one pass and returns its Events, ``abort`` drops requests at once.

    ``new_state(positions)`` makes a fresh State with room for ``positions``.
    ``chunk``: prompt tokens per pass. ``should_stop()``, if given, is asked before every
    pass: True raises Abandoned, and the lanes in flight stay in ``lanes`` for the caller
    to count and drop. ``on_pass(prompt tokens, decoders, seconds)``, if given, hears
    each pass's size and duration on ``clock`` (a batch's pace, ``libk3.engine.pace``).
    ``drafting`` (``speculative.Drafting``): each lane proposes tokens to verify several
    per pass; the tokens and logits are the same. ``store`` (``libk3.store.StateStore``):
    the kept states a request may start from and is kept in (``Request.reuse``,
    ``store_at``, ``offer``)."""

    def __init__(self, forward, new_state, width: int, *, chunk: int = PREFILL_CHUNK,
                 tokenizer=None, join_prefill: bool = True, should_stop=None, on_pass=None,
                 clock=time.perf_counter, drafting=None, store=None):
        if width < 1 or chunk < 1:
            raise ValueError("width and chunk must be >= 1")
        self.forward, self.new_state, self.width = forward, new_state, width
        self.chunk, self.tokenizer, self.join_prefill = chunk, tokenizer, join_prefill
        self.should_stop, self.on_pass, self.clock = should_stop, on_pass, clock
        self.drafting, self.store = drafting, store
        self.lanes: list[Lane] = []
        self.waiting: list[Request] = []    # forked choices, admitted as lanes free up
        self.pending: list[Event] = []      # events of adds, handed out by the next step
        self.stats = CoreStats(width)

    @property
    def full(self) -> bool:
        return len(self.lanes) + len(self.waiting) >= self.width

    @property
    def busy(self) -> bool:
        """Whether a request is in flight or waiting for a lane (step until it is not)."""
        return bool(self.lanes or self.waiting or self.pending)

    def add(self, req: Request) -> None:
        """Start ``req`` in a free lane, its other choices (``n``) to follow (UsageError
        when its settings cannot start, such as a grammar; ValueError when no lane is
        free)."""
        if self.full:
            raise ValueError("every lane is busy: step until one is free")
        self._resume(req)
        if req.n > 1 and not req.followers:
            req.followers = [dataclasses.replace(
                req, settings=dataclasses.replace(
                    req.settings, seed=(req.settings.seed + i) % 2 ** 64),
                choice=i, n=1, keep_at=(), store_at=(), followers=[]) for i in range(1, req.n)]
            if req.fork_at:
                req.keep_at = tuple(sorted(set(req.keep_at) | {req.fork_at}))
            else:
                self._fork(req, req.state)
        self._start(req)

    def _resume(self, req: Request) -> None:
        """Admission: start ``req`` from the store's longest strict prefix of its prompt
        when it asks (``Request.reuse``), cutting that prefix from its prompt."""
        n = 0
        if req.reuse and self.store is not None and req.state is None and not req.logits \
                and not (req.echo and req.logprobs is not None):   # (those want every row)
            limit = req.images[0].start if req.images else None
            req.state, n = self.store.take(req.prompt_ids, limit)
        if n:
            req.reused, req.prompt_ids = n, list(req.prompt_ids[n:])
            req.images = tuple(im._replace(start=im.start - n) for im in req.images)
        req.store_at = tuple(sorted({k - n for k in req.store_at if k > n}))
        req.keep_at = tuple(sorted({k - n for k in req.keep_at if k > n} | set(req.store_at)))

    def _fork(self, req: Request, state) -> None:
        """Queue ``req``'s other choices, each from its own copy of ``state`` (None: a
        new one) with the prompt ids it has not fed."""
        for f in req.followers:
            f.state = None if state is None else state.copy()
            f.prompt_ids = list(req.prompt_ids[req.fork_at:])
            f.echo = req.echo and state is None     # the prompt's logprobs: choice 0's
            self.waiting.append(f)
        req.followers = []

    def _start(self, req: Request) -> None:
        state = req.state if req.state is not None else \
            self.new_state(len(req.prompt_ids) + max(req.settings.gen, 0))  # -1: grows
        spec = self.drafting.speculator() if self.drafting is not None else None
        lane = Lane(req, state, time.perf_counter(), self.tokenizer, spec)
        req.state = state                   # the driver finds the lane's State here
        self.lanes.append(lane)
        lane.start(self.pending)

    def abort(self, which) -> list:
        """Drop at once the lanes whose Request ``which(request)`` picks (a request whose
        client went away); their Requests. The others' tokens do not change."""
        gone = [r for lane in self.lanes if which(lane.req)
                for r in (lane.req, *lane.req.followers)]     # choices not yet forked too
        self.lanes = [lane for lane in self.lanes if not which(lane.req)]
        gone += [req for req in self.waiting if which(req)]
        self.waiting = [req for req in self.waiting if not which(req)]
        return gone

    def _alone_start(self, req: Request) -> None:
        """Start a forked choice; one whose settings cannot start fails alone."""
        try:
            self._start(req)
        except Exception as e:      # noqa: BLE001 (that choice's own failure, told)
            self.pending.append(Event("failed", req, e))

    def _alone(self, lane, fn, *args):
        """``fn(*args)`` of one lane; when it raises, the lane is marked to leave with its
        error (a "failed" event), and None is returned."""
        try:
            return fn(*args)
        except Abandoned:
            raise
        except Exception as e:          # noqa: BLE001 (that lane's own failure, told)
            lane.reason, lane.error, lane.closing = "error", e, False
            return None

    def step(self) -> list:
        """One pass over every lane in flight (none when every lane is finished already);
        finished lanes leave; forked choices waiting take the lanes free. Returns the
        Events, in order."""
        while self.waiting and len(self.lanes) < self.width:
            self._alone_start(self.waiting.pop(0))
        out, self.pending = self.pending, []
        if any(not lane.finished for lane in self.lanes):
            if self.should_stop is not None and self.should_stop():
                raise Abandoned()
            self._pass(out)
        still = []
        for lane in self.lanes:
            if not lane.finished:
                still.append(lane)
            elif lane.reason == "error":
                out.append(Event("failed", lane.req, lane.error))
                out += [Event("failed", f, lane.error) for f in lane.req.followers]
            else:                           # leaves at once
                out.append(Event("done", lane.req, lane.result(time.perf_counter())))
        self.lanes = still
        if self.store is not None:
            for ev in out:                  # the prompt in; the request with its reply
                if ev.request.offer and ev.kind in ("prefilled", "done"):
                    self.store.offer(ev.request.state)
        return out

    def _pass(self, out: list) -> None:
        t0 = self.clock()
        st = self.stats
        st.max_active = max(st.max_active, len(self.lanes))
        live = [lane for lane in self.lanes if not lane.finished]
        plan = plan_pass(live, self.chunk, self.join_prefill)
        segs = [self._alone(lane, lane.segment, ids, n_prompt, len(plan) - 1)
                for lane, ids, n_prompt in plan]
        plan = [p for p, seg in zip(plan, segs) if seg is not None]
        segs = [seg for seg in segs if seg is not None]
        t_pass = time.perf_counter()
        outs = self.forward.run(segs) if segs else []
        took = time.perf_counter() - t_pass
        st.passes += bool(segs)
        for (lane, ids, n_prompt), seg, logits in zip(plan, segs, outs):
            st.prompt_tokens += n_prompt
            before = len(lane.generated)
            self._alone(lane, lane.take, seg, logits, n_prompt, took, out)
            if n_prompt and lane.fed in lane.req.store_at and lane.reason != "error" and \
                    self.store is not None:
                done = lane.fed == len(lane.prompt) and lane.limit == 0   # never changes
                self.store.keep(lane.state, copy=not done)
            if n_prompt and lane.fed in lane.req.keep_at and lane.reason != "error":
                out.append(Event("kept", lane.req, (lane.state, lane.fed)))
                if lane.req.followers and lane.fed == lane.req.fork_at:
                    self._fork(lane.req, lane.state)
            st.generated_tokens += len(lane.generated) - before
        if self.drafting is not None and segs and all(n == 0 for _, _, n in plan):
            self.drafting.width.record(sum(seg.ids.shape[0] for seg in segs),
                                       time.perf_counter() - t_pass,
                                       not any(seg.verify for seg in segs))
        took = self.clock() - t0
        st.seconds += took
        if self.on_pass is not None:
            fed = sum(n for _, _, n in plan)
            self.on_pass(fed, sum(1 for _, _, n in plan if n == 0), took)

