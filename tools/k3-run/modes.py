"""k3-run's five modes, one click command each: prompt (the default), batch, chat, serve
and perplexity (docs/run.md "Modes").

Owns: which option groups (``options``) each mode stacks, the rules left between options
that really interact (``RULES``, checked by ``k3cli.constraints``), and each mode's work:
open the run, drive it, print what it gives. Does not own: the option declarations
(``options``), the command that picks a mode and the old one-command spellings (``cli``,
``aliases``), or anything a run does (``libk3.run``).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import click

from k3cli import constraints
from k3cli.group import Command
from k3cli.support import handle_errors, print_json
from libk3.engine.defaults import PREFILL_CHUNK
from libk3.io import atomic
from libk3.text.chat_template import RenderLimits

from . import image_opts, options as o, params, scoring
from .llama import serve_address
from .printer import Printer, ReplyPrinter

# Options that interact within a mode, checked in this order before any work; a rule
# naming an option a mode lacks never fires there.
RULES = (
    constraints.Excludes("verbose", ("quiet",), "--verbose and --quiet (--log-disable) are "
                                               "opposites: give one"),
    constraints.Excludes("resident", ("preset", "trunk_gb", "cache_gb", "pack"),
                         "--resident excludes --preset, --trunk-gb, --cache-gb and --pack"),
    constraints.Excludes("spec", ("draft",),
                         "--spec and --draft are two sources of proposals: give one"),
    constraints.GoesWith(("draft_max", "draft_dump"), ("draft",),
                         "--draft-max and --draft-dump go with --draft"),
    constraints.GoesWith(("prefix_cache_gb", "save_prefix"), ("prefix_cache",),
                         "--prefix-cache-gb and --save-prefix go with --prefix-cache"),
    constraints.Excludes("prefix_cache", ("load_state",),
                         "--prefix-cache excludes --load-state (a state resumes itself)"),
    *image_opts.RULES,
)
PROMPT_RULES = (
    constraints.OneOf(("prompt_arg", "prompt", "prompt_file", "ids"),
                      or_none_with=("load_state",)),
    *RULES,
)

# Where an option shared by two modes goes, said as before the modes (else aliases says it).
ELSEWHERE = {"batch_width": "--batch-width, --parallel and -np go with --batch "
                            "(--batch-width also with --serve; k3-run batch, k3-run serve)"}

# Why perplexity has no generation or state options (said instead of "goes with").
_GENERATING = ("gen", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
               "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop_strings",
               "stop_ids", "draft", "spec", "logits_out", "response_format")
PERPLEXITY_LACKS = {
    **{name: "--perplexity scores the text as it is: it takes no generation options (--gen, "
             "sampling, --stop, --draft, --spec, --logits-out, --response-format)"
       for name in _GENERATING},
    **{name: "--perplexity scores each window from an empty state: it excludes "
             "--load-state, --save-state and --prefix-cache"
       for name in ("load_state", "save_state", "prefix_cache")},
}


class Mode(Command):
    """A mode's command: its usage line reads ``k3-run [OPTIONS] ...`` when the mode was
    not named (its name is blank then)."""

    def format_usage(self, ctx, formatter):
        formatter.write_usage(" ".join(ctx.command_path.split()),
                              " ".join(self.collect_usage_pieces(ctx)))


def _start(ctx, options: dict, rules, mode_flag: str | None = None) -> SimpleNamespace:
    """The mode's options by parameter name, its rules checked (``mode_flag``: the old
    one-command flag that image_opts' rules name as this mode's)."""
    constraints.check(ctx, rules, given_too=(mode_flag,) if mode_flag else ())
    return SimpleNamespace(**options)


def _run_options(ctx, a, **mode):
    """What opens the model: the budget group's options, and ``mode``'s own fields of
    RunOptions (drafting, prefix cache, width, ...)."""
    from libk3.run import runner
    return runner.RunOptions(
        model=a.model, pack=a.pack, preset=a.preset, trunk_gb=a.trunk_gb, cache_gb=a.cache_gb,
        budget_order=ctx.meta.get("k3_budget_order", []), resident=a.resident,
        cache_policy=a.cache_policy, io_threads=a.io_threads, direct_io=not a.buffered_io,
        stripe_dirs=tuple(a.stripe_dirs), io_throttle_mbps=a.io_throttle_mbps,
        prefetch_experts=a.prefetch_experts, trace_path=a.trace_path,
        verify_reads=a.verify_reads, progress=not a.quiet,
        warn=lambda m: click.echo(f"k3-run: {m}", err=True),
        prefill_chunk=a.prefill_chunk, context_limit=a.ctx_size, **mode)


def _drafting(a) -> dict:
    return dict(spec=a.spec, draft=a.draft, draft_max=a.draft_max, draft_dump=a.draft_dump)


def _prefix(a) -> dict:
    return dict(prefix_cache=a.prefix_cache, prefix_cache_bytes=int(a.prefix_cache_gb * 1e9))


def _limits(a) -> dict:
    return dict(template_limits=RenderLimits(a.template_timeout, a.template_max_bytes))


def _settings(a, response_format=None):
    """How tokens are chosen and when generation stops (the sampling group); the logit
    bias's ids checked against the model before any work."""
    from libk3.run import runner
    settings = runner.settings_from(
        gen=a.gen, temperature=a.temperature, top_p=a.top_p, seed=a.seed,
        stop_strings=a.stop_strings, stop_ids=a.stop_ids,
        prefill_chunk=a.prefill_chunk or PREFILL_CHUNK, model=a.model, top_k=a.top_k,
        min_p=a.min_p, repetition_penalty=a.repetition_penalty,
        presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
        logit_bias=a.logit_bias, response_format=response_format)
    params.check_logit_bias(a.model, settings.logit_bias)
    return settings


def _verbose(a, doc) -> None:
    """--verbose: the whole report on stderr, as --json prints it on stdout."""
    if a.verbose:
        import json
        click.echo(json.dumps(doc, indent=2, sort_keys=True, default=str), err=True)


@click.command("prompt", cls=Mode, help="One prompt (the default mode: `k3-run MODEL "
               "PROMPT`): its text as it comes, then the run report.")
@o.model_options
@o.prompt_options
@o.budget_options
@o.output_options
@o.json_option
@o.sampling_options
@o.response_format_option
@o.drafting_options
@o.prefix_options
@o.state_options
@image_opts.image_options
@click.pass_context
@handle_errors
def prompt(ctx, **options):
    """-p, -f, --ids or PROMPT: one prompt; none (--load-state alone): the state's
    generation continues."""
    a = _start(ctx, options, PROMPT_RULES)
    a.prompt = a.prompt if a.prompt_arg is None else a.prompt_arg
    fmt = params.check_response_format(a.response_format)
    opts = _run_options(ctx, a, vision=bool(a.image), load_state=a.load_state, **_drafting(a),
                        **_prefix(a))
    settings = _settings(a, fmt)
    from libk3.run import runner
    with runner.open_run(opts) as run:
        run.check_stop_ids(a.stop_ids)
        settings = run.chunked(settings)
        if a.ids is not None:
            from libk3.engine.session import parse_ids
            prompt_ids = parse_ids(a.ids, run.cfg.vocab_size)
        elif a.prompt_file is not None:
            prompt_ids = run.encode_file(a.prompt_file)
        elif a.prompt is not None:
            prompt_ids = run.encode(a.prompt)
        else:
            prompt_ids = []
        run.check_fits(len(prompt_ids), settings.gen)
        prompt_ids, images = image_opts.prompt_images(a, run, prompt_ids, settings.gen)
        rep = _one_prompt(run, prompt_ids, settings, a, images)
        rep.update({"images": a.image_report} if images else {})
        if a.report_json:
            atomic.write_json(a.report_json, rep)
        if a.json_out:
            print_json(rep)
        else:
            from libk3.run.report import short_text
            click.echo(short_text(rep), err=True)
        _verbose(a, rep)


def _one_prompt(run, prompt_ids, settings, a, images=()) -> dict:
    """Generate with the text shown as it comes; the logits saved when asked; the run
    report."""
    printer = None if a.json_out else Printer(run.session.tokenizer, a.stop_strings,
                                               run.end_ids(settings))
    res = run.generate(prompt_ids, settings, on_token=printer,
                       keep_logits=a.logits_out is not None, load_state=a.load_state,
                       save_state=a.save_state, save_prefix=a.save_prefix, images=images)
    if printer is not None:
        printer.finish()
    if a.logits_out:
        import numpy as np
        npy = a.logits_out if a.logits_out.endswith(".npy") else a.logits_out + ".npy"
        with atomic.replacing(npy) as f:       # np.save's own suffix rule, atomically
            np.save(f, res.logits)
    return run.report(res)


@click.command("batch", cls=Mode, help="A JSONL file of prompts (formats/batch.md) into "
               "a results file: cron-safe, resumes where the last run stopped.")
@o.model_options
@o.batch_options
@o.budget_options
@o.output_options
@o.json_option
@o.sampling_options
@o.response_format_option
@o.drafting_options
@o.width_option
@o.prefix_options
@o.template_options
@image_opts.image_options
@click.pass_context
@handle_errors
def batch(ctx, **options):
    """The whole file (or what the limits allow), then its summary."""
    started = time.monotonic()
    a = _start(ctx, options, RULES, "batch")
    fmt = params.check_response_format(a.response_format)
    opts = _run_options(ctx, a, vision=True, image_dir=a.image_dir,
                        share_prefixes=not a.no_prefix_sharing,
                        batch_width="auto" if a.batch_width is None else a.batch_width,
                        **_drafting(a), **_prefix(a), **_limits(a))
    settings = _settings(a, fmt)
    from libk3.run import batch_run
    limits = batch_run.BatchLimits(
        max_prompts=a.max_prompts, wait=a.wait, started=started,
        deadline=None if a.deadline is None else started + 60.0 * a.deadline)
    summary = batch_run.run_batch(opts, a.batch, a.out_path, settings,
                                  warn=lambda m: click.echo(m, err=True), limits=limits,
                                  shard=a.shard)
    _verbose(a, summary)
    if a.json_out:
        print_json(summary)
        return
    from libk3.run.batch import summary_text
    from libk3.run.report import batch_text
    click.echo(summary_text(summary, a.out_path), err=True)
    if "width" in summary:
        click.echo(batch_text(summary), err=True)


@click.command("chat", cls=Mode, help="Interactive multi-turn chat on stdin, in the "
               "model's chat template (/help lists its commands; docs/serve.md).")
@o.model_options
@o.budget_options
@o.quiet_only
@o.sampling_options
@o.drafting_options
@o.state_options
@o.chat_options
@o.template_options
@image_opts.image_options
@click.pass_context
@handle_errors
def chat(ctx, **options):
    """Turns and commands from the terminal or stdin until /exit or end of input."""
    a = _start(ctx, options, RULES, "chat")
    opts = _run_options(ctx, a, vision=True, load_state=a.load_state, **_drafting(a),
                        **_limits(a))
    settings = _settings(a)
    from libk3.run import chat_session, repl, runner
    with runner.open_run(opts) as run:
        run.check_stop_ids(a.stop_ids)
        settings = run.chunked(settings)
        tok = run.session.tokenizer

        def printer():              # a model without a template continues text: raw
            if run.chat().template is None:
                return Printer(tok, settings.stop_strings)
            return ReplyPrinter(tok, settings.stop_strings)
        with repl.Console(history=a.history) as console:
            chat_session.run_chat(run, settings, load_state=a.load_state,
                                  save_state=a.save_state, emit_factory=printer,
                                  console=console, warn=lambda m: click.echo(m, err=True),
                                  template_kwargs=a.template_kwargs, system=a.system,
                                  images=a.image)


@click.command("serve", cls=Mode, help="Serve an OpenAI-compatible API (needs the serve "
               "extra) on [HOST:]PORT: HOST defaults to 127.0.0.1, any other address needs "
               "--api-key; PORT to 8080 (or --host and --port).")
@o.model_options
@o.serve_options
@o.budget_options
@o.quiet_only
@o.sampling_options
@o.drafting_options
@o.width_option
@o.prefix_options
@o.template_options
@image_opts.image_options
@click.pass_context
@handle_errors
def serve(ctx, **options):
    """The server until it is stopped. A request without max_tokens generates until its
    turn ends or the context is full (what clients expect), unless --gen was given: then
    that is the default."""
    a = _start(ctx, options, RULES, "serve_address")
    address = serve_address(a.serve_address or "", a.host, a.port)
    from libk3.serve.app import beside_bytes, check_address
    check_address(address, a.api_key)                   # before the model is opened
    opts = _run_options(ctx, a, vision=True, image_dir=a.image_dir, serve=True,
                        batch_width="auto" if a.batch_width is None else a.batch_width,
                        beside_bytes=beside_bytes(int(a.reuse_gb * 1e9)),
                        **_drafting(a), **_prefix(a), **_limits(a))
    settings = _settings(a)
    import dataclasses
    from click.core import ParameterSource
    from libk3.engine.settings import UNTIL_END
    from libk3.run import runner
    from libk3.serve.app import serve as serve_api
    with runner.open_run(opts) as run:
        run.check_stop_ids(a.stop_ids)
        settings = run.chunked(settings)
        if ctx.get_parameter_source("gen") != ParameterSource.COMMANDLINE:
            settings = dataclasses.replace(settings, gen=UNTIL_END)
        serve_api(run, address, settings, api_key=a.api_key,
                  log=lambda m: click.echo(m, err=True),
                  reuse_ram_bytes=int(a.reuse_gb * 1e9),
                  model_name=a.served_model_name, log_json=a.log_format == "json")


@click.command("perplexity", cls=Mode, help="Perplexity of a UTF-8 text file, "
               "llama-perplexity's way: windows of --ctx-size tokens (default 512), the "
               "second half of each scored (docs/run.md \"Perplexity\").")
@o.model_options
@o.perplexity_options
@o.budget_options
@o.output_options
@o.json_option
@click.pass_context
@handle_errors
def perplexity(ctx, **options):
    """The running figure after each window, then the final estimate."""
    a = _start(ctx, options, RULES, "perplexity")
    from libk3.run import runner
    with runner.open_run(_run_options(ctx, a)) as run:
        _verbose(a, scoring.perplexity_mode(a, run))


MODES = (prompt, batch, chat, serve, perplexity)
