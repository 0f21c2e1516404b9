"""Where ``run_batch`` hands each prompt of a batch file: run alone or in lockstep.

Owns: starting each accepted prompt (one by one at width 1, exactly as ``k3-run --ids``
would, or in a ``Lockstep`` of the run's width), writing its result line as it finishes,
the progress bar, and the batch's aggregate figures (width, tokens/s, trunk and expert
bytes read per generated token, expert union per MoE layer, per-prompt tokens and times).
Does not own: reading or validating the batch file, skipping finished ids, sharding
(``runner.run_batch``, ``batch``), the scheduler (``lockstep``), the run report
(``report``).
"""

from __future__ import annotations

import time

from ..errors import UsageError
from ..model.state import State
from . import batch as batchfile
from .generate import Abandoned
from .lockstep import Job, Lockstep


class BatchSink:
    def __init__(self, run, out_path, width: int, chunk: int, should_stop=None):
        self.run, self.out_path, self.width = run, out_path, width
        self.should_stop = should_stop
        self.abandoned = 0                  # prompts dropped at the deadline (redone next run)
        self.prompts: list[dict] = []
        self.t0 = time.perf_counter()
        self.stats0 = run.session.weights.stats()
        fwd = run.session.forward
        self.union0, self.passes0 = list(fwd.expert_union), fwd.passes
        self.generated = 0
        self.bar = _bar(run.opts.progress)
        self.ids = {}                       # line -> the line's id
        self.chats = set()                  # lines given as "messages"
        self.lockstep = None
        if width > 1:
            cfg = run.cfg
            self.lockstep = Lockstep(fwd, lambda n: State(cfg, capacity=n), width,
                                     self._done, chunk=chunk,
                                     tokenizer=run.session.tokenizer, on_token=self._token,
                                     should_stop=should_stop)

    def submit(self, lineno: int, job_id, prompt_ids, settings, chat: bool = False) -> bool:
        """Run the prompt (width 1) or queue it for the next free slot; ``chat``: a
        "messages" line, whose result also carries the parsed reply. False when the
        deadline passed meanwhile: this prompt and every one in flight are dropped."""
        from .runner import check_stop_strings, run_one
        self.ids[lineno] = job_id
        if chat:
            self.chats.add(lineno)
        job = Job(lineno, prompt_ids, settings)          # the tag is the trace's seq
        try:
            if self.lockstep is None:
                self.run.seq = lineno
                self._done(job, run_one(self.run, prompt_ids, settings,
                                        should_stop=self.should_stop))
                return True
            if settings.spec:
                raise UsageError("--spec decodes one prompt at a time: use --batch-width 1")
            check_stop_strings(self.run, settings)
            self.lockstep.submit(job)
        except Abandoned:
            self.abandoned += 1 + self._drop_lanes()
            return False
        return True

    def _drop_lanes(self) -> int:
        if self.lockstep is None:
            return 0
        n, self.lockstep.lanes = len(self.lockstep.lanes), []
        return n

    def _token(self, job, tok) -> None:
        self.generated += 1
        self.bar.set_postfix(tokens=self.generated, refresh=False)

    def _done(self, job, res) -> None:
        lineno = job.tag
        job_id = self.ids.pop(lineno)
        rep = self.run.report(res, {"id": job_id, "line": lineno, "batch_width": self.width})
        if lineno in self.chats:
            self.chats.discard(lineno)
            rep["message"] = self.run.reply_message(res.generated_ids)
        batchfile.append_result(self.out_path, rep)
        if self.lockstep is None:
            self.generated += len(res.generated_ids)
        self.prompts.append({"id": job_id, "line": lineno,
                             "prompt_tokens": len(res.prompt_ids),
                             "generated_tokens": len(res.generated_ids),
                             "stop_reason": res.stop_reason,
                             "prefill_seconds": round(res.prefill_seconds, 6),
                             "decode_seconds": round(res.decode_seconds, 6)})
        self.bar.set_postfix(tokens=self.generated, refresh=False)
        self.bar.update(1)

    def close(self) -> dict:
        """Finish every prompt in flight; the batch's aggregate figures."""
        if self.lockstep is not None:
            try:
                self.lockstep.drain()
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
            "max_in_flight": self.lockstep.stats.max_active if self.lockstep else min(1, n),
            "trunk_bytes_per_token": per_token("trunk"),
            "expert_bytes_per_token": per_token("experts"),
            "expert_union_per_layer": {
                str(L): round((fwd.expert_union[L] - self.union0[L]) / passes, 3)
                for L in cfg.moe_layers} if passes else {},
            "prompts": self.prompts,
        }


def _bar(show: bool):
    """Progress over finished prompts, with generated tokens, on stderr (``progress.bar``)."""
    from .. import progress
    return progress.bar(unit="prompt", desc="batch", show=show)
