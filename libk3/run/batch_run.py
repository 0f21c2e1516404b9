"""A batch file's run: every prompt of a JSONL file through one opened model, ``run.width``
at a time in lockstep, results appended as they finish (formats/batch.md).

Owns: ``run_batch`` and ``BatchLimits`` (when a cron tick stops), the lock on the results
file, which lines are accepted, refused or already done, their prompt ids (a
``reasoning_effort`` rendered as the template's switch) and the grammar of their
``tool_choice``. Does not own: opening the model (``runner``), the scheduler and
results sink (``batch_sink``), the line format (``batch``).
"""

from __future__ import annotations

import dataclasses
import time

from ..engine.defaults import PREFILL_CHUNK
from ..engine.generate import GenSettings
from ..errors import K3Error, UsageError
from . import batch as batchfile
from .batch_sink import ABANDONED, NO_TIME, BatchSink
from .prefixes import PrefixStarts, shared_lengths
from .runner import RunOptions, open_run


@dataclasses.dataclass
class BatchLimits:
    """When a batch run stops before the end of its file (cron: leave the rest to the next
    tick). ``deadline`` is in seconds of ``clock()`` (monotonic), counted from ``started``;
    a prompt is started only when this run's pace says it finishes in time
    (``batch_sink``); one still in flight at the deadline is abandoned at its next pass."""
    max_prompts: int | None = None
    deadline: float | None = None
    wait: bool = False
    clock: object = time.monotonic
    started: float | None = None

    def passed(self) -> bool:
        return self.deadline is not None and self.clock() >= self.deadline


def run_batch(opts: RunOptions, batch_path, out_path, base: GenSettings, warn,
              limits: BatchLimits | None = None, shard=None) -> dict:
    """Run every prompt of a JSONL file (``shard`` (K, N): only the ids of shard K of N),
    ``run.width`` at a time in lockstep; append each result to ``out_path`` as it
    finishes; skip ids already there; report malformed lines by number and carry on.

    One run per results file: the file's lock is taken before the model is opened and
    before its finished ids are read (BusyError at once; with ``limits.wait``, after the
    holder ends, re-reading what it finished). Stops early, cleanly, after
    ``limits.max_prompts`` prompts or at the deadline (formats/batch.md)."""
    from ..io.filelock import FileLock

    limits = limits or BatchLimits()
    batchfile.check_results_path(out_path)      # before the lock: a FIFO would block it
    summary = {"done": 0, "skipped": 0, "malformed": 0, "errors": [], "stopped": None,
               "remaining": None, "cut_off": 0, "discarded_tokens": 0}
    lock = FileLock(out_path)
    if not lock.acquire(wait=limits.wait, until=limits.deadline, notice=warn,
                        clock=limits.clock):
        summary["stopped"] = "deadline"          # still waiting for the lock at the deadline
        return summary
    with lock, open_run(opts) as run:
        summary["remaining"] = 0
        return _run_batch_locked(run, batch_path, out_path, base, warn, limits, summary,
                                 shard)


def _run_batch_locked(run, batch_path, out_path, base, warn, limits, summary, shard) -> dict:
    run.check_stop_ids(base.stop_ids)
    base = run.chunked(base)
    done = batchfile.open_results(out_path)
    summary["other_shard"] = 0
    tok = run.session.tokenizer
    bound = batchfile.line_bound(run.context, tok.longest_rank_bytes if tok else None)
    lines = batchfile.read_lines(batch_path, bound)     # one at a time, each at most bound
    images = _LineImages(run)
    rows = {}                           # line -> (its images, where each stands), if any
    accepted, given = _accepted_lines(run, lines, base, batch_path, warn, summary,
                                      (done, rows, images))
    width = min(run.width, max(1, given))
    summary["width_reasons"] = list(run.width_reasons) + (
        [f"capped at {width} (the batch's lines)"] if width < run.width else [])
    left_for_time = False               # a prompt not started: it would not finish in time
    planned = sum(1 for _, job, _ in accepted
                  if shard is None or batchfile.in_shard(job["id"], *shard))
    if limits.max_prompts is not None:
        planned = min(planned, limits.max_prompts)
    # prefixes are shared across every shard, at a grain that no budget changes: each
    # shard then builds (or finds on disk) the same snapshots
    shared = shared_lengths([ids for _, _, ids in accepted],
                            min(base.prefill_chunk, PREFILL_CHUNK)) \
        if run.opts.share_prefixes else [0] * len(accepted)
    # a prefix is shared only before a line's first image: pads look alike, rows do not
    shared = [min(s, rows[n][1][0]) if n in rows else s
              for (n, _, _), s in zip(accepted, shared)]
    starts = PrefixStarts(run.session, base.prefill_chunk,
                          [(ids, s) for (_, _, ids), s in zip(accepted, shared)],
                          run.store, run.drafting,
                          limits.passed if limits.deadline is not None else None)
    sink = BatchSink(run, out_path, width, base.prefill_chunk, limits, total=planned,
                     store=run.store)
    started = 0
    for (lineno, job, prompt_ids), share in zip(accepted, shared):
        if shard is not None and not batchfile.in_shard(job["id"], *shard):
            summary["other_shard"] += 1
            continue
        if summary["stopped"] is None:
            if limits.max_prompts is not None and started >= limits.max_prompts:
                summary["stopped"] = "max-prompts"
            elif limits.passed():
                summary["stopped"] = "deadline"
        if summary["stopped"] is not None:
            summary["remaining"] += 1      # keep counting: the summary says what is left
            continue
        settings = run.until_end(batchfile.job_settings(job, base))
        if "messages" in job:
            settings = run.chat_settings(settings, warn)
        settings = run.structured(settings)     # compiled (and checked) in _accepted_lines
        settings = tool_settings(run, job, prompt_ids, settings)
        try:                            # the tower runs only for a line that runs
            line_rows = images.rows(*rows.pop(lineno)) if lineno in rows else ()
        except batchfile.BatchLineError as e:
            warn(f"{batch_path}:{lineno}: skipped: {e}")
            summary["malformed"] += 1
            summary["errors"].append({"line": lineno, "error": str(e)})
            continue
        outcome = sink.submit(lineno, job["id"], prompt_ids, settings, chat="messages" in job,
                              starts=lambda ids=prompt_ids, s=share: starts.prepare(ids, s),
                              n=job.get("n") or 1, logprobs=batchfile.alternatives(job),
                              images=line_rows)
        if outcome == NO_TIME:
            summary["remaining"] += 1          # a shorter prompt further on may still fit
            left_for_time = True
            continue
        started += 1
        if outcome == ABANDONED:
            summary["stopped"] = "deadline"
    summary.update(sink.close())
    for lineno, why in sink.failed:
        warn(f"{batch_path}:{lineno}: skipped: {why}")
        summary["malformed"] += 1
        summary["errors"].append({"line": lineno, "error": why})
    resumed = [p["reused_tokens"] for p in summary["prompts"] if p["reused_tokens"]]
    summary["prefixes"] = {**starts.summary(), "prompts_resumed": len(resumed),
                           "tokens_reused": sum(resumed)}
    if left_for_time:
        summary["stopped"] = summary["stopped"] or "deadline"
    summary["cut_off"], summary["discarded_tokens"] = sink.abandoned, sink.discarded
    if sink.abandoned:
        summary["stopped"] = summary["stopped"] or "deadline"
        summary["remaining"] += sink.abandoned
    if not summary["prompts"] and summary["stopped"] == "deadline":
        warn(sink.unfit or "deadline: it passed before the first prompt started "
             f"({limits.clock() - sink.since:.1f} s after the run began); give a longer "
             "--deadline")
    summary["done"] = len(summary["prompts"])
    return summary


def _accepted_lines(run, lines, base, batch_path, warn, summary, known) -> tuple:
    """(line number, job, prompt ids) of each line to run, and the count of lines that
    are not blank: malformed lines (one over the line bound among them, or with an image
    k3 cannot read) are reported and counted, ids already in the results counted as
    skipped. ``known``: (ids already done, the dict each line's images and their starts
    go to, the batch's ``_LineImages``)."""
    done, line_rows, images = known
    context = run.context
    name = "the model's context" if run.opts.context_limit is None else \
        "--ctx-size's context"
    seen = set()
    out, given = [], 0
    for lineno, line in lines:
        if isinstance(line, bytes) and not line.strip():
            continue
        given += 1
        try:
            if not isinstance(line, bytes):
                raise batchfile.BatchLineError(
                    f"the line is {line.size:,} bytes, more than the {line.limit:,} a "
                    f"line that fits {name} of {context:,} tokens can take: it was not read")
            job = images.read(batchfile.parse_line(line, run.cfg.vocab_size))
            key = batchfile.id_key(job["id"])
            if key in seen:
                raise batchfile.BatchLineError(f"duplicate id {job['id']!r}")
            seen.add(key)
            prompt_ids, found = images.expanded(job, _line_ids(run, job, warn, context, name))
            why = batchfile.context_problem(len(prompt_ids), job.get("gen", base.gen), context,
                                            name)
            if why:
                raise batchfile.BatchLineError(why)
            if job.get("response_format") is not None:
                run.structured(batchfile.job_settings(job, base))   # compiled once, cached
            tool_settings(run, job, prompt_ids,                    # the same
                          run.structured(batchfile.job_settings(job, base)))
            if batchfile.alternatives(job) is not None and run.session.tokenizer is None:
                raise batchfile.BatchLineError("\"logprobs\" needs the model's tokenizer "
                                               "(a token's text)")
        except (batchfile.BatchLineError, UsageError) as e:
            msg = e.one_line() if isinstance(e, UsageError) else str(e)
            warn(f"{batch_path}:{lineno}: skipped: {msg}")
            summary["malformed"] += 1
            summary["errors"].append({"line": lineno, "error": msg})
            continue
        if key in done:
            summary["skipped"] += 1
            continue
        out.append((lineno, job, [int(i) for i in prompt_ids]))
        if found:
            line_rows[lineno] = found
    return out, given


def _line_ids(run, job: dict, warn, context: int, name: str) -> list:
    """A batch line's prompt ids; a text too long for ``context`` (``name``: what that
    context is) is refused by its bytes before it is tokenized, and tokenizing stops past
    the context."""
    if "ids" in job:
        return job["ids"]
    if "messages" in job:
        if job.get("reasoning_effort") is not None:     # onto the template's switches
            job = {**job, "template_kwargs": run.chat(warn).reasoning_kwargs(
                job["reasoning_effort"], job.get("tools"), job.get("template_kwargs"))}
        return run.encode_messages(job, warn, limit=context)    # images: one pad each
    size = len(job["prompt"].encode("utf-8"))
    if size > context * run.prompts.tokenizer.longest_rank_bytes:
        raise batchfile.BatchLineError(f"the prompt is {size:,} bytes, more than {name} of "
                                       f"{context:,} tokens can hold")
    return run.encode(job["prompt"], limit=context)


class _LineImages:
    """The image parts of a batch's "messages" lines (``request.images``: data: URLs, or
    paths under --image-dir): read and checked when a line is accepted, its pads expanded
    by the size rule's row counts; the tower runs only for a line that runs (each digest
    encoded once: ``images.Images``, made at the first image)."""

    def __init__(self, run):
        self.run, self.images = run, None
        vcfg = run.session.ckpt.vision_config
        self.media = vcfg.media if vcfg is not None and run.session.tokenizer and \
            run.opts.vision else None

    def read(self, job: dict) -> dict:
        """``job`` with each user message holding images as one text, the images'
        markup in it, and its images under "k3_images" (BatchLineError: one refused)."""
        from ..request.images import ImageRefused, read_parts
        if "messages" not in job:
            return job
        try:
            messages, found = read_parts(job["messages"], self.media, self.run.opts.image_dir)
        except ImageRefused as e:
            raise batchfile.BatchLineError(str(e)) from None
        return {**job, "messages": messages, "k3_images": found} if found else job

    def expanded(self, job: dict, ids) -> tuple:
        """(ids with each pad repeated as many times as its image has rows, (images,
        their starts) or None) of a line read by ``read``."""
        found = job.pop("k3_images", None)
        if not found:
            return ids, None
        from ..media.markup import expand, pad_id
        vcfg = self.run.session.ckpt.vision_config
        try:
            pad = pad_id(self.run.session.tokenizer, vcfg.media_placeholder_token_id)
            ids, starts = expand(list(ids), pad, [im.rows for im in found],
                                 "the rendered conversation")
        except K3Error as e:
            raise batchfile.BatchLineError(e.one_line()) from None
        return ids, (tuple(found), tuple(starts))

    def rows(self, found, starts) -> tuple:
        """The ``forward.ImageRows`` of a line's images at their starts (BatchLineError:
        one the tower cannot take)."""
        from ..model.forward import ImageRows
        from .images import Images
        try:
            if self.images is None:
                self.images = Images(self.run.session, "an image part")
            loaded = [self.images.load_data(im.data, im.name) for im in found]
        except K3Error as e:
            raise batchfile.BatchLineError(e.one_line()) from None
        for im, image in zip(found, loaded):
            if image.rows.shape[0] != im.rows:        # the size rule and the tower disagree
                raise batchfile.BatchLineError(f"{im.name}: the tower gave "
                                               f"{image.rows.shape[0]} rows, not {im.rows}")
        return tuple(ImageRows(s, im.rows, im.digest) for s, im in zip(starts, loaded))


def tool_settings(run, job: dict, prompt_ids, settings: GenSettings) -> GenSettings:
    """``settings`` with the grammar that enforces a "messages" line's ``tool_choice`` and
    ``parallel_tool_calls`` (docs/serve.md, tool_choice), as the server's; unchanged when
    nothing is enforced or a response format's grammar holds the reply. UsageError when
    a call is asked of a model without a chat template (its calls are read from its
    markup)."""
    choice = job.get("tool_choice") or "auto"
    parallel = job.get("parallel_tool_calls") is not False
    tools = job.get("tools")
    if settings.grammar is not None or choice == "none" or \
            (choice == "auto" and (parallel or not tools)):
        return settings
    if run.session.tokenizer is None or run.chat().template is None:
        raise UsageError("\"tool_choice\" needs the model's chat template (its calls are "
                         "read from the reply's markup)")
    from ..constrain.tool_grammar import compile_tool_grammar, think_mode
    tok = run.session.tokenizer
    grammar = compile_tool_grammar(tok, tools, choice, parallel, think_mode(tok, prompt_ids))
    return settings if grammar is None else dataclasses.replace(settings, grammar=grammar)
