"""What one k3-run invocation does, behind the click front end.

Owns: resolving budgets (presets, flags in argv order, auto) before any long work,
admission against available memory, opening the session, trace recording, and the three
run shapes: one prompt, a batch file, a chat. Does not own: option parsing or printing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import numpy as np

from ..errors import BudgetError, UsageError
from ..model.state import State
from ..policy_registry import DEFAULT_POLICY
from ..trace import PHASE_DECODE, PHASE_PREFILL, RECORD_DTYPE
from . import batch as batchfile
from . import chat as chatfmt
from .generate import GenSettings, generate
from .report import run_report
from .session import open_session, parse_ids  # noqa: F401  (parse_ids re-exported for the CLI)


@dataclasses.dataclass
class RunOptions:
    model: str
    pack: str | None = None
    preset: str | None = None
    trunk_gb: float | None = None
    cache_gb: float | None = None
    budget_order: list = dataclasses.field(default_factory=list)
    resident: bool = False
    cache_policy: str = DEFAULT_POLICY
    io_threads: int = 4
    direct_io: bool = True
    trace_path: str | None = None
    memory_override: int | None = None


def settings_from(gen, temperature, top_p, seed, stop_strings=(), stop_ids=(),
                  prefill_chunk=64, spec=0) -> GenSettings:
    return GenSettings(gen=gen, temperature=temperature, top_p=top_p, seed=seed,
                       stop_ids=tuple(stop_ids), stop_strings=tuple(stop_strings),
                       prefill_chunk=prefill_chunk, spec=spec)


def resolve_run_budget(opts: RunOptions, ckpt):
    """Budget from presets/flags (argv order), refused before loading when it cannot work."""
    from ..hwprobe import probe_memory
    from ..presets import ModelSizes, admission_problems, resolve_budget

    sizes = ModelSizes.from_checkpoint(ckpt)
    mem = probe_memory(opts.memory_override)
    budget = resolve_budget(opts.preset, opts.trunk_gb, opts.cache_gb,
                            order=opts.budget_order or None, mem=mem, model_sizes=sizes)
    problems = admission_problems(budget, sizes, mem)
    if problems:
        raise BudgetError("; ".join(problems), hint="choose a smaller --preset or budgets")
    return budget


class Run:
    """An opened model plus the run's budget and optional trace writer."""

    def __init__(self, opts: RunOptions):
        from ..io.checkpoint import Checkpoint

        self.opts = opts
        self.budget = None
        self.trace = None
        ckpt = Checkpoint.open(opts.model)       # indexed once, for the budget and the run
        try:
            if not opts.resident:
                self.budget = resolve_run_budget(opts, ckpt)
        except BaseException:
            ckpt.close()
            raise
        on_route = self._record if opts.trace_path else None
        self.session = open_session(
            opts.model, ckpt=ckpt, pack=opts.pack,
            trunk_bytes=None if opts.resident else self.budget.trunk_bytes,
            cache_bytes=None if opts.resident else self.budget.cache_bytes,
            cache_policy=opts.cache_policy, io_threads=opts.io_threads,
            direct_io=opts.direct_io, on_route=on_route)
        self.seq = 0                       # which prompt of a batch (trace records)
        if opts.trace_path:
            from .. import __version__
            from ..trace import TraceWriter, header_for_config
            self.trace = TraceWriter(opts.trace_path, header_for_config(
                self.cfg, created_by=f"k3-run {__version__}",
                meta={"model": str(opts.model), "pack": opts.pack,
                      "cache_policy": opts.cache_policy}))

    @property
    def cfg(self):
        return self.session.cfg

    def _record(self, L, positions, ids, phase):
        """One MoE layer's routing for a block of tokens: per token, its experts in
        selection order (formats/trace.md: within a prefill chunk, layer-major)."""
        T, k = ids.shape
        rec = np.empty(T * k, RECORD_DTYPE)
        rec["pos"] = np.repeat(np.asarray(positions, np.int64), k)
        rec["seq"] = self.seq
        rec["layer"] = L
        rec["expert"] = ids.reshape(-1)
        rec["phase"] = PHASE_PREFILL if phase == "prefill" else PHASE_DECODE
        self.trace.append_records(rec)

    def encode(self, text: str) -> list:
        tok = self.session.tokenizer
        if tok is None:
            raise UsageError("this model has no tokenizer (tiktoken.model); use --ids")
        ids = tok.encode(text)
        if not ids:
            raise UsageError("the prompt encodes to no tokens")
        return ids

    def report(self, res, extra=None) -> dict:
        stats = self.session.weights.stats()
        rep = run_report(res, stats, self.budget, extra)
        rep["model"] = str(self.opts.model)
        rep["pack"] = self.opts.pack
        tok = self.session.tokenizer
        if tok is not None:
            rep["generated_text"] = tok.decode(res.generated_ids)
        if res.spec is not None:
            rep["speculative"] = res.spec
        return rep

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        self.session.weights.close()
        self.session.ckpt.close()


@contextlib.contextmanager
def open_run(opts: RunOptions):
    run = Run(opts)
    try:
        yield run
    finally:
        run.close()


def _load_state(run: Run, path) -> State:
    return State.load(run.cfg, path) if path else run.session.new_state()


def run_one(run: Run, prompt_ids, settings: GenSettings, *, on_token=None, keep_logits=False,
            load_state=None, save_state=None):
    if settings.stop_strings and run.session.tokenizer is None:
        raise UsageError("--stop needs the model's tokenizer (tiktoken.model); use --stop-id")
    state = _load_state(run, load_state)
    res = generate(run.session.forward, state, prompt_ids, settings,
                   tokenizer=run.session.tokenizer, on_token=on_token, keep_logits=keep_logits,
                   progress=_prefill_bar(len(prompt_ids)))
    if save_state:
        state.save(save_state)
    return res


def _prefill_bar(n: int):
    """A tqdm bar on stderr for prefill (shown on a terminal for prompts over a chunk)."""
    if n <= 64:
        return None
    from tqdm import tqdm
    bar = tqdm(total=n, unit="tok", desc="prefill", leave=False, disable=None)
    return bar.update


def run_batch(run: Run, batch_path, out_path, base: GenSettings, warn) -> dict:
    """Run every prompt of a JSONL file; append each result to ``out_path`` as it finishes;
    skip ids already there; report malformed lines by number and carry on."""
    batchfile.repair_tail(out_path)
    done = batchfile.done_ids(out_path)
    seen = set()
    summary = {"done": 0, "skipped": 0, "malformed": 0, "errors": []}
    lines = Path(batch_path).read_text(encoding="utf-8", errors="replace").splitlines()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            job = batchfile.parse_line(line, run.cfg.vocab_size)
            key = json.dumps(job["id"])
            if key in seen:
                raise batchfile.BatchLineError(f"duplicate id {job['id']!r}")
            seen.add(key)
            prompt_ids = job["ids"] if "ids" in job else run.encode(job["prompt"])
        except (batchfile.BatchLineError, UsageError) as e:
            msg = e.one_line() if isinstance(e, UsageError) else str(e)
            warn(f"{batch_path}:{lineno}: skipped: {msg}")
            summary["malformed"] += 1
            summary["errors"].append({"line": lineno, "error": msg})
            continue
        if key in done:
            summary["skipped"] += 1
            continue
        settings = dataclasses.replace(
            base, spec=base.spec if job.get("temperature", base.temperature) == 0 else 0, gen=job.get("gen", base.gen), temperature=job.get("temperature", base.temperature),
            top_p=job.get("top_p", base.top_p), seed=job.get("seed", base.seed),
            stop_strings=tuple(job["stop"]) or base.stop_strings,
            stop_ids=tuple(job.get("stop_ids", base.stop_ids)))
        run.seq = lineno
        res = run_one(run, prompt_ids, settings)
        rep = run.report(res, {"id": job["id"], "line": lineno})
        batchfile.append_result(out_path, rep)
        summary["done"] += 1
    return summary


def run_chat(run: Run, settings: GenSettings, *, load_state, save_state, emit_factory,
             prompt_fn) -> None:
    """A multi-turn REPL: the state carries every earlier turn (no re-prefill). An empty
    line or end of input ends the chat; the state is saved then if asked."""
    tok = run.session.tokenizer
    if tok is None:
        raise UsageError("--chat needs the model's tokenizer (tiktoken.model)")
    state = _load_state(run, load_state)
    stops = tuple(settings.stop_ids) + chatfmt.stop_ids(tok) if chatfmt.has_xtml(tok) \
        else tuple(settings.stop_ids)
    turn_settings = dataclasses.replace(settings, stop_ids=stops)
    import click
    while True:
        try:
            text = prompt_fn()
        except (EOFError, click.exceptions.Abort):
            break
        if not text:
            break
        ids = chatfmt.user_turn_ids(tok, text)
        printer = emit_factory()
        generate(run.session.forward, state, ids, turn_settings, tokenizer=tok,
                 on_token=printer)
        printer.finish()
    if save_state:
        state.save(save_state)
