"""Decoding many prompts in lockstep: up to W sequences share every forward pass.

Owns: the scheduler of a batch run: which prompts hold the W slots, what each puts into
the next pass (its next prompt tokens or its one decode token), sampling each sequence
with its own settings, its stop rules, and handing each finished prompt back at once
(``on_done``) so the next one takes its slot (continuous batching). Does not own: the
batch and results files, budgets or the width (``libk3.budget.batch_width``), the
forward pass (``libk3.model.forward.Forward.run``: one trunk fetch per layer and one
fetch per routed expert for all the pass's sequences), printing.

Same tokens as alone: each sequence has its own State and Sampler, and a pass computes
every token exactly as a pass of that sequence alone would (forward.py), so a prompt's
ids and logits do not depend on the width, its neighbours or when it joined. The one
difference from ``generate``: the last generated token is not fed back (a finished
sequence leaves at once; nothing reads its state again).

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

from ..model.forward import Segment
from .defaults import PREFILL_CHUNK
from .generate import Abandoned, GenResult, GenSettings
from .sampler import Sampler
from .stops import Stops


@dataclasses.dataclass
class Job:
    """One prompt of a batch. ``tag`` is the caller's handle, passed back with the result
    (and to trace records as the sequence's tag). ``state``: the State to continue (it
    already holds what came before ``prompt_ids``: an earlier turn), else a new one.
    ``keep_at``: counts of ``prompt_ids``, ascending; after each is fed, the Lockstep's
    ``on_keep`` hears the state and the count (a prefix worth keeping, such as a
    conversation's preamble, or where other sequences fork off).
    ``rows``: the Lockstep's ``on_row`` hears each generated token with the logits row it
    was chosen from; ``prompt_rows``: ``on_prompt_rows`` hears every prompt position's
    row (log-probabilities of the prompt, ``echo``)."""

    tag: object
    prompt_ids: list
    settings: GenSettings
    state: object = None
    keep_at: tuple = ()
    rows: bool = False
    prompt_rows: bool = False


class _Lane:
    """A slot's sequence: where its prompt is, what it generated, when."""

    def __init__(self, job: Job, state, now: float, keep_logits: bool, tokenizer=None,
                 spec=None):
        if not job.prompt_ids:
            raise ValueError("a lockstep job needs at least one prompt token")
        self.job = job
        self.prompt = [int(i) for i in job.prompt_ids]
        self.state = state
        # tokens this lane may generate; its output starts after the state and prompt
        self.limit = job.settings.limit(state.pos + len(self.prompt))
        self.sampler = Sampler.of(job.settings, state.pos + len(self.prompt))
        self.spec = spec                # a Speculator when the run drafts
        self.fed = 0                    # prompt tokens fed so far
        self.next = None                # the sampled token the next pass feeds
        self.generated: list[int] = []
        self.stops = Stops(job.settings, tokenizer, self.sampler.grammar)
        self.reason = None              # set when finished ("error": failed alone)
        self.error = None               # then, what it raised
        self.t_enter = now
        self.t_first = None             # prefill done: first token sampled from here
        self.rows = [] if keep_logits else None

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    def segment(self, ids, n_prompt: int, tag, others: int) -> Segment:
        """The Segment this lane puts into the next pass: ``ids`` of its prompt, or its
        decode token (with the proposals its Speculator chooses to verify, the pass's
        ``others`` sequences riding along)."""
        if n_prompt or self.spec is None:
            every = self.rows is not None or n_prompt == 0 or self.job.prompt_rows
            return Segment(ids, self.state, all_logits=every,
                           phase="prefill" if n_prompt else "decode", tag=tag)
        room = self.limit - len(self.generated)
        return self.spec.plan(self.state, self.next, room, self.stops.ids,
                              self.sampler, tag, others)

    def take(self, seg: Segment, logits, n_prompt: int, on_token, seconds: float,
             on_row=None) -> None:
        """Absorb this lane's logits from a pass that fed ``n_prompt`` prompt tokens (or,
        with 0, its decode token and any proposals: the accepted ones are committed and
        count as generated); sample the next token once the prompt is in. ``on_row(job,
        token, row)`` hears each generated token's row when the Job asks for rows."""
        self.fed += n_prompt
        on_row = on_row if self.job.rows else None
        if self.spec is not None:
            if n_prompt:
                self.spec.observe(self.state, seg.taps)
            else:
                kept = []
                for d in self.spec.accept(seg, logits, self.sampler):
                    kept.append(d)            # chosen from the row after the one before
                    if self._emit(d, on_token, on_row, logits[len(kept) - 1]):
                        break
                self.spec.commit(seg, len(kept), seconds)
                logits = logits[:len(kept) + 1]
        if self.rows is not None:
            self.rows.append(logits)
        if self.prefilling or self.reason is not None:
            return
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if len(self.generated) >= self.limit:
            self.reason = "length"
            return
        tok = self.sampler(logits[-1], self.state.pos, self.state.ids)
        self._emit(tok, on_token, on_row, logits[-1])
        self.next = tok

    def _emit(self, tok: int, on_token, on_row=None, row=None) -> bool:
        """Count ``tok`` as generated; whether it ends the sequence (stop or length)."""
        if on_row is not None:
            on_row(self.job, tok, row)
        self.generated.append(tok)
        if on_token is not None:
            on_token(self.job, tok)
        self.reason = self.stops.see(tok)
        if self.reason is None and len(self.generated) >= self.limit:
            self.reason = "length"
        return self.reason is not None

    def result(self, now: float) -> GenResult:
        logits = np.concatenate(self.rows).astype(np.float32) if self.rows else None
        return GenResult(self.prompt, self.generated, self.reason, self.t_first - self.t_enter,
                         now - self.t_first, logits,
                         stop_strings=tuple(self.job.settings.stop_strings),
                         grammar_seconds=None if self.sampler.grammar is None else
                         self.sampler.grammar.seconds)


@dataclasses.dataclass
class LockstepStats:
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
            kept = [k for k in lane.job.keep_at if k > lane.fed]
            if kept:                                # the pass ends at the next kept prefix
                n = min(n, kept[0] - lane.fed)
            plan.append((lane, lane.prompt[lane.fed:lane.fed + n], n))
            room -= n
    if join_prefill or not plan:
        plan += [(lane, [lane.next], 0) for lane in lanes if not lane.prefilling]
    return plan


class Lockstep:
    """At most ``width`` sequences in flight; ``submit`` a Job when it should start (it
    runs passes until a slot is free), ``drain`` at the end.

    ``new_state(positions)`` makes a fresh State with room for ``positions``.
    ``on_done(job, GenResult)`` is called as each prompt finishes, in finishing order,
    and its slot is free from then on; ``on_token(job, id)`` as each token is sampled.
    ``keep_logits`` collects each prompt's logits rows (prompt positions, then every
    generated token but the last) into its result. ``chunk``: prompt tokens per pass.
    ``should_stop()``, if given, is asked before every pass: True raises Abandoned, and
    the lanes in flight stay in ``lanes`` for the caller to count and drop.
    ``on_pass(prompt tokens, decoders, seconds)``, if given, hears each pass's size and
    duration on ``clock`` (a batch's pace, ``libk3.engine.pace``). ``on_keep(job,
    state, n)`` hears a lane's state once each of its Job's ``keep_at`` counts, n, of
    prompt ids is in.
    ``on_row(job, token, row)`` and ``on_prompt_rows(job, start, rows)`` hear the logits
    rows of Jobs that ask for them (``Job.rows``, ``Job.prompt_rows``): rows[i] is prompt
    position start + i's, predicting the prompt id after it.
    ``on_failed(job, exception)``, if given, hears a lane that failed on its own (its
    grammar, sampler, stops or proposals raised) as it leaves; the others go on, their
    tokens unchanged. Without it, such a failure is raised out of ``step``."""

    def __init__(self, forward, new_state, width: int, on_done, *, chunk: int = PREFILL_CHUNK,
                 tokenizer=None, on_token=None, keep_logits: bool = False,
                 join_prefill: bool = True, should_stop=None, on_pass=None,
                 clock=time.perf_counter, drafting=None, on_keep=None, on_row=None,
                 on_prompt_rows=None, on_failed=None):
        if width < 1 or chunk < 1:
            raise ValueError("width and chunk must be >= 1")
        self.forward, self.new_state, self.width, self.on_done = forward, new_state, width, on_done
        self.chunk, self.tokenizer, self.on_token = chunk, tokenizer, on_token
        self.keep_logits, self.join_prefill = keep_logits, join_prefill
        self.should_stop, self.on_pass, self.clock = should_stop, on_pass, clock
        self.drafting = drafting
        self.on_keep = on_keep
        self.on_row, self.on_prompt_rows = on_row, on_prompt_rows
        self.on_failed = on_failed
        self.lanes: list[_Lane] = []
        self.stats = LockstepStats(width)

    def _alone(self, lane, fn, *args):
        """``fn(*args)`` of one lane; when it raises (and ``on_failed`` hears such
        failures) the lane is marked to leave with its error, and None is returned."""
        if self.on_failed is None:
            return fn(*args)
        try:
            return fn(*args)
        except Exception as e:          # noqa: BLE001 (that lane's own failure, told)
            lane.reason, lane.error = "error", e
            return None

    def make_room(self) -> None:
        """Run passes until a slot is free."""
        while len(self.lanes) >= self.width:
            self.step()

    def submit(self, job: Job) -> None:
        self.make_room()
        state = job.state if job.state is not None else \
            self.new_state(len(job.prompt_ids) + max(job.settings.gen, 0))  # -1: grows
        spec = self.drafting.speculator() if self.drafting is not None else None
        self.lanes.append(_Lane(job, state, time.perf_counter(), self.keep_logits,
                                self.tokenizer, spec))

    def leave(self, which) -> list:
        """Drop at once the lanes whose Job ``which(job)`` picks (a request whose client
        went away); their Jobs. The others' tokens do not change (module docstring)."""
        gone = [lane.job for lane in self.lanes if which(lane.job)]
        self.lanes = [lane for lane in self.lanes if not which(lane.job)]
        return gone

    def drain(self) -> None:
        while self.lanes:
            self.step()

    def step(self) -> None:
        """One pass over every lane in flight; finished lanes leave (``on_done``)."""
        if self.should_stop is not None and self.should_stop():
            raise Abandoned()
        t0 = self.clock()
        st = self.stats
        st.max_active = max(st.max_active, len(self.lanes))
        plan = plan_pass(self.lanes, self.chunk, self.join_prefill)
        segs = [self._alone(lane, lane.segment, ids, n_prompt, lane.job.tag, len(plan) - 1)
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
            if n_prompt and lane.job.prompt_rows and self.on_prompt_rows is not None:
                self.on_prompt_rows(lane.job, lane.fed, logits)
            self._alone(lane, lane.take, seg, logits, n_prompt, self.on_token, took,
                        self.on_row)
            if n_prompt and lane.fed in lane.job.keep_at and self.on_keep is not None \
                    and lane.reason != "error":
                self.on_keep(lane.job, lane.state, lane.fed)
            st.generated_tokens += len(lane.generated) - before
        if self.drafting is not None and segs and all(n == 0 for _, _, n in plan):
            self.drafting.width.record(sum(seg.ids.shape[0] for seg in segs),
                                       time.perf_counter() - t_pass,
                                       not any(seg.verify for seg in segs))
        still = []
        for lane in self.lanes:
            if lane.reason is None:
                still.append(lane)
            elif lane.reason == "error":
                self.on_failed(lane.job, lane.error)
            else:                           # leaves at once; its state is dropped
                self.on_done(lane.job, lane.result(time.perf_counter()))
        self.lanes = still
        took = self.clock() - t0
        st.seconds += took
        if self.on_pass is not None:
            fed = sum(n for _, _, n in plan)
            self.on_pass(fed, sum(1 for _, _, n in plan if n == 0), took)


def run_lockstep(forward, new_state, jobs, width: int, on_done, **kw) -> LockstepStats:
    """Run every Job of the iterable ``jobs`` through a ``Lockstep`` (keywords as there);
    a job is drawn only when a slot is free."""
    ls = Lockstep(forward, new_state, width, on_done, **kw)
    for job in jobs:
        ls.submit(job)
    ls.drain()
    return ls.stats
