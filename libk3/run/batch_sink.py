"""Where ``run_batch`` hands each prompt of a batch file: run alone or in lockstep.

Owns: starting each accepted prompt (one by one at width 1, exactly as ``k3-run --ids``
would, or in the engine core at the run's width; a line's ``n`` choices always in the
core, which prefills it once), writing its result line once its choices finish (with
their log-probabilities when the line asks: formats/batch.md "Results file"),
the progress bar, and the batch's aggregate figures (width, tokens/s, trunk and expert
bytes read per generated token, expert union per MoE layer, per-prompt tokens and times).
Does not own: reading or validating the batch file, skipping finished ids, sharding
(``batch_run.run_batch``, ``batch``), the loop (``libk3.engine.core``), the run report
(``report``).
"""

from __future__ import annotations

import math
import time

from ..errors import K3Error, UsageError
from ..model.state import State
from . import batch as batchfile
from ..engine.core import EngineCore, Request
from ..engine.core import Abandoned
from ..engine.logprobs import content
from ..engine.pace import Pace, Work


STARTED, ABANDONED, NO_TIME = "started", "abandoned", "no time"
CHOICE_KEYS = ("generated_ids", "generated_text", "stop_reason")    # of each of n choices


class BatchSink:
    """``limits`` (``batch_run.BatchLimits``) with a deadline: admit a prompt only when this
    run's pace says it and every prompt in flight finish before it (``pace``), and drop
    what is still in flight once it has passed; such a run goes through the lockstep
    scheduler even at width 1, which is how its passes are timed."""

    def __init__(self, run, out_path, width: int, chunk: int, limits, total=None,
                 store=None):
        self.run, self.out_path, self.width, self.chunk = run, out_path, width, chunk
        self.deadline, self.clock = limits.deadline, limits.clock
        self.should_stop = limits.passed if self.deadline is not None else None
        # where the deadline counts from
        self.since = self.clock() if limits.started is None else limits.started
        self.pace = Pace() if self.deadline is not None else None
        # one line for a run that finished nothing: the first prompt the deadline was too
        # short for, what it needed at this run's pace, the deadline that would fit it
        self.unfit = None
        self.abandoned = 0                  # prompts dropped at the deadline (redone next run)
        self.discarded = 0                  # tokens those prompts had generated
        self.prompts: list[dict] = []
        self.t0 = time.perf_counter()
        self.stats0 = run.session.weights.stats()
        fwd = run.session.forward
        self.union0, self.passes0 = list(fwd.expert_union), fwd.passes
        self.generated = 0
        self.failed: list = []              # (line, reason) of prompts that failed alone
        self.bar = _bar(run.opts.progress, total)
        self.ids = {}                       # line -> the line's id
        self.chats = set()                  # lines given as "messages"
        self.prompt_ids = {}                # line -> its whole prompt
        self.reused = {}                    # line -> prompt ids resumed from a snapshot
        self.choices = {}                   # line -> {choice: GenResult} of its n
        self.n = {}                         # line -> its choices
        # width 1 without a deadline: a line of one choice runs as ``k3-run --ids`` would
        self.alone = width == 1 and self.pace is None
        cfg = run.cfg
        self.core = EngineCore(fwd, lambda n: State(cfg, capacity=n), width,
                               chunk=chunk, tokenizer=run.session.tokenizer,
                               should_stop=self.should_stop,
                               on_pass=self.pace.record if self.pace else None,
                               clock=self.clock, drafting=run.drafting, store=store)

    def submit(self, lineno: int, job_id, prompt_ids, settings, chat: bool = False,
               starts=None, n: int = 1, logprobs: int | None = None, images=()) -> str:
        """Run the prompt (width 1) or queue it for the next free slot, started from the
        state store's longest prefix of it (the core's admission, never past its first
        image); ``chat``: a "messages" line, whose result also carries the parsed reply;
        ``starts()`` puts the prefix it shares in the store
        (``prefixes.PrefixStarts.prepare``), asked once the prompt is let in; ``n``
        choices, each token's log-probability and ``logprobs`` alternatives (None: none);
        ``images``: ``forward.ImageRows`` at the prompt's pads. ABANDONED when the
        deadline passed meanwhile: this prompt and every one in flight are dropped;
        NO_TIME when it would not finish before the deadline (nothing of it was run)."""
        job = Request(lineno, prompt_ids, settings, logprobs=logprobs, n=n,  # tag: trace seq
                      images=tuple(images), reuse=True)
        self.n[lineno] = n
        started = False
        try:
            if self.alone and n == 1:
                self._expect(job_id, lineno, chat, prompt_ids)
                self.run.seq = lineno
                if starts is not None:
                    starts()
                started = True
                try:
                    res = self.run.generate(prompt_ids, settings,
                                            should_stop=self.should_stop, logprobs=logprobs,
                                            images=tuple(images))
                except UsageError as e:     # its grammar gave up: this line alone fails
                    self._failed(job, e)
                    return STARTED
                self.reused[lineno] = res.reused_tokens
                self.generated += len(res.generated_ids)
                self._done(job, res)
                return STARTED
            self.run.check_stop_strings(settings)
            self._make_room()
            if self.pace is not None and not self._fits(job_id, job):
                return NO_TIME
            self._expect(job_id, lineno, chat, prompt_ids)
            self.run.seq = lineno                        # a shared prefix built for it
            if starts is not None:
                starts()
            try:
                self.core.add(job)
                self.reused[lineno] = job.reused
            except UsageError as e:     # its own settings cannot start (a grammar)
                self._failed(job, e)
            while self.alone and self.core.busy:      # width 1: its choices, one by one
                self._step()
        except Abandoned:             # this prompt counts as cut off only if it began
            self.abandoned += started + self._drop_lanes()
            return ABANDONED if started else NO_TIME
        return STARTED

    def _step(self) -> None:
        """One pass of the core; its events to this sink."""
        for ev in self.core.step():
            if ev.kind == "token":
                self._token(ev.request, ev.data[0])
            elif ev.kind == "done":
                self._done(ev.request, ev.data)
            elif ev.kind == "failed":
                self._failed(ev.request, ev.data)

    def _make_room(self) -> None:
        while self.core.full:
            self._step()

    def _expect(self, job_id, lineno: int, chat: bool, prompt_ids) -> None:
        self.ids[lineno] = job_id
        self.prompt_ids[lineno] = prompt_ids
        if chat:
            self.chats.add(lineno)

    def _fits(self, job_id, job) -> bool:
        """Whether ``job`` and every lane in flight finish before the deadline at this
        run's pace, asked again after each pass while lanes are in flight (each one that
        finishes leaves room). Until the pace is measured, the first prompt is let in
        alone; until a pass as wide as the lanes in flight is priced (``Pace.knows``),
        no other is (the width grows one lane at a time)."""
        ls = self.core
        while ls.lanes and not (self.pace.measured and self.pace.knows(len(ls.lanes))):
            self._step()
        if not self.pace.measured:
            return True
        new = Work(len(job.prompt_ids), job.settings.limit(len(job.prompt_ids)))
        while True:
            works = [_work_left(lane) for lane in ls.lanes]
            if self.pace.finish(works + [new], self.chunk) <= self.deadline - self.clock():
                return True
            if not ls.lanes:
                self._short(job_id, self.pace.finish([new], self.chunk), "needs")
                return False
            self._step()

    def _short(self, job_id, need: float, verb: str) -> None:
        """Remember the first prompt the deadline was too short for (``unfit``)."""
        if self.unfit is None:
            minutes = math.ceil((self.clock() - self.since + need) / 60)
            self.unfit = (f"deadline: prompt {job_id!r} {verb} about {need:.0f} s more at this "
                          f"run's pace; a --deadline of at least {minutes} min would fit it")

    def _drop_lanes(self) -> int:
        """Drop every request in flight; the lines they were (a line's choices count once)."""
        lanes, self.core.lanes = self.core.lanes, []
        lines = {lane.req.tag for lane in lanes} | {req.tag for req in self.core.waiting}
        self.core.waiting = []
        self.discarded += sum(len(lane.generated) for lane in lanes)
        if lanes and self.pace is not None and self.pace.seen:
            lane = lanes[0]
            self._short(self.ids.get(lane.req.tag, lane.req.tag),
                        self.pace.finish([_work_left(lane)], self.chunk),
                        "was cut off at the deadline; it needed")
        return len(lines)

    def _token(self, job, tok) -> None:
        self.generated += 1
        self.bar.set_postfix_str(f"{self.generated:,} tokens", refresh=False)

    def _done(self, job, res) -> None:
        """A choice finished; once every choice of its line has, the line's result."""
        lineno = job.tag
        if lineno not in self.ids:
            return                              # another choice of its line failed
        got = self.choices.setdefault(lineno, {})
        got[res.choice] = res
        if len(got) < self.n[lineno]:
            return
        results = [got[i] for i in range(self.n.pop(lineno))]
        del self.choices[lineno]
        job_id = self.ids.pop(lineno)
        res = results[0]
        res.prompt_ids = self.prompt_ids.pop(lineno)    # the whole prompt, resumed or not
        res.reused_tokens = self.reused.pop(lineno, 0)
        rep = self.run.report(res, {"id": job_id, "line": lineno, "batch_width": self.width})
        chat = lineno in self.chats
        self.chats.discard(lineno)
        rep.update(choice_fields(self.run, res, chat))
        if len(results) > 1:
            rep["choices"] = [self._choice(i, r, chat) for i, r in enumerate(results)]
        batchfile.append_result(self.out_path, rep)
        self.prompts.append({"id": job_id, "line": lineno,
                             "prompt_tokens": len(res.prompt_ids),
                             "reused_tokens": res.reused_tokens,
                             "generated_tokens": len(res.generated_ids),
                             "stop_reason": res.stop_reason,
                             "prefill_seconds": round(res.prefill_seconds, 6),
                             "decode_seconds": round(res.decode_seconds, 6)})
        self.bar.set_postfix_str(f"{self.generated:,} tokens", refresh=False)
        self.bar.update(1)

    def _choice(self, index: int, res, chat: bool) -> dict:
        """One choice of a line of ``n`` > 1 (formats/batch.md "Results file")."""
        one = self.run.report(res)
        return {"index": index, **{k: one[k] for k in CHOICE_KEYS if k in one},
                **choice_fields(self.run, res, chat)}

    def _failed(self, job, e: Exception) -> None:
        """A prompt that failed on its own (its grammar gave up): no result line; its
        line and reason are reported as a malformed line's are."""
        lineno = job.tag
        if lineno in self.ids:          # (each choice of a line reports; the first tells)
            self.failed.append((lineno, e.one_line() if isinstance(e, K3Error) else repr(e)))
        self._forget(lineno)

    def _forget(self, lineno: int) -> None:
        for held in (self.ids, self.prompt_ids, self.reused, self.choices, self.n):
            held.pop(lineno, None)
        self.chats.discard(lineno)

    def close(self) -> dict:
        """Finish every prompt in flight; the batch's aggregate figures."""
        try:
            while self.core.busy:
                self._step()
        except Abandoned:
            self.abandoned += self._drop_lanes()
        self.bar.close()
        secs = time.perf_counter() - self.t0
        fwd = self.run.session.forward
        passes = fwd.passes - self.passes0
        cfg = self.run.cfg
        stats = self.run.session.weights.stats()
        n = self.generated

        def per_token(part):
            got = stats.get(part, {}).get("bytes_read", 0)
            return round((got - self.stats0.get(part, {}).get("bytes_read", 0)) / n) if n else None
        return {
            "width": self.width, "generated_tokens": n, "seconds": round(secs, 6),
            "tokens_per_second": round(n / secs, 6) if secs > 0 else None,
            "passes": passes,
            "max_in_flight": max(self.core.stats.max_active, min(1, n)),
            "trunk_bytes_per_token": per_token("trunk"),
            "expert_bytes_per_token": per_token("experts"),
            "expert_union_per_layer": {
                str(L): round((fwd.expert_union[L] - self.union0[L]) / passes, 3)
                for L in cfg.moe_layers} if passes else {},
            "prompts": self.prompts,
        }


def choice_fields(run, res, chat: bool) -> dict:
    """What a result line says of one choice beyond the run report: the parsed reply of a
    "messages" line (``message``), each token's log-probabilities when asked
    (``logprobs``: OpenAI's chat shape, ``logprobs.content``)."""
    out = {}
    if chat:
        out["message"] = run.reply_message(res.generated_ids, res.stop_strings)
    if res.logprobs is not None:
        out["logprobs"] = {"content": content(run.session.tokenizer, res.logprobs)}
    return out


def _work_left(lane) -> Work:
    """What a lane still has to do: prompt tokens to feed, tokens to generate."""
    return Work(len(lane.prompt) - lane.fed, lane.limit - len(lane.generated))


def _bar(show: bool, total=None):
    """Progress over finished prompts of the ``total`` this run means to run, with
    generated tokens and the time left, on stderr (``progress.bar``)."""
    from .. import progress
    return progress.bar(unit="prompts", desc="batch", show=show, total=total, eta=True)
