"""k3-run: streamed inference of Kimi K3 (thin click front end over libk3.engine)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import click

from libk3 import __version__
from k3cli import constraints
from k3cli.group import (Command, Finite, JsonObject, Rule, Shard, Width, gigabytes,
                         quiet_option, threads_option)
from k3cli.support import handle_errors, print_json
from libk3.config import MAX_SIZE
from libk3.engine.defaults import IO_THREADS, PREFILL_CHUNK, PREFIX_CACHE_BYTES
from libk3.engine.settings import (MAX_POSITIONS, frequency_penalty_problem,
                                   gen_or_until_end_problem, min_p_problem,
                                   presence_penalty_problem,
                                   repetition_penalty_problem, seed_problem,
                                   temperature_problem, top_k_problem, top_p_problem)
from libk3.io import atomic
from libk3.text.chat_template import DEFAULT_LIMITS, RenderLimits
from libk3.policies.registry import DEFAULT_POLICY, ONLINE_OBJECT_POLICIES

from . import image_opts, params
from .llama import refused_options, serve_address
from . import scoring
from .printer import Printer, ReplyPrinter


# Which options go together (k3cli.constraints), checked in this order before any work.
_GENERATING = ("gen", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
               "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop_strings",
               "stop_ids", "draft", "spec", "logits_out", "response_format")
_BUDGET_WIDTH = "--batch-width and --shard go with --batch (--batch-width also with --serve)"
RULES = (
    constraints.OneOf(("model", "model_option"),
                      text="give the model directory once: MODEL or -m/--model"),
    constraints.OneOf(("prompt_arg", "prompt", "prompt_file", "ids", "batch", "chat",
                       "serve_address", "perplexity"), or_none_with=("load_state",)),
    constraints.GoesWith(("save_logits", "kl_divergence"), ("perplexity",),
                         "--save-logits and --kl-divergence go with --perplexity"),
    constraints.Excludes("perplexity", ("load_state", "save_state", "prefix_cache"),
                         "--perplexity scores each window from an empty state: it excludes "
                         "--load-state, --save-state and --prefix-cache"),
    constraints.Excludes("perplexity", _GENERATING,
                         "--perplexity scores the text as it is: it takes no generation "
                         "options (--gen, sampling, --stop, --draft, --spec, --logits-out, "
                         "--response-format)"),
    constraints.GoesWith(("host", "port"), ("serve_address",),
                         "--host and --port go with --serve"),
    constraints.Excludes("verbose", ("quiet",), "--verbose and --quiet (--log-disable) are "
                                               "opposites: give one"),
    constraints.GoesWith(("batch",), ("out_path",), "--batch needs --out RESULTS.jsonl"),
    constraints.GoesWith(("out_path",), ("batch",), "--out goes with --batch"),
    constraints.GoesWith(("wait", "max_prompts", "deadline"), ("batch",),
                         "--wait, --max-prompts and --deadline go with --batch"),
    constraints.Excludes("resident", ("preset", "trunk_gb", "cache_gb", "pack"),
                         "--resident excludes --preset, --trunk-gb, --cache-gb and --pack"),
    constraints.GoesWith(("template_kwargs",), ("chat",), "--template-kwargs goes with --chat"),
    constraints.GoesWith(("system", "history"), ("chat",),
                         "--system and --history go with --chat"),
    constraints.GoesWith(("api_key",), ("serve_address",), "--api-key goes with --serve"),
    constraints.GoesWith(("log_format",), ("serve_address",), "--log-format goes with --serve"),
    constraints.GoesWith(("served_model_name",), ("serve_address",),
                         "--served-model-name goes with --serve"),
    constraints.GoesWith(("template_timeout", "template_max_bytes"),
                         ("chat", "batch", "serve_address"),
                         "--template-timeout and --template-max-bytes go with --chat, --batch "
                         "or --serve"),
    constraints.Excludes("spec", ("draft",),
                         "--spec and --draft are two sources of proposals: give one"),
    constraints.GoesWith(("draft_max", "draft_dump"), ("draft",),
                         "--draft-max and --draft-dump go with --draft"),
    constraints.GoesWith(("prefix_cache_gb", "save_prefix"), ("prefix_cache",),
                         "--prefix-cache-gb and --save-prefix go with --prefix-cache"),
    constraints.GoesWith(("save_prefix",), ("prompt_arg", "prompt", "prompt_file", "ids"),
                         "--save-prefix goes with a prompt (-p, -f or --ids)"),
    constraints.Excludes("prefix_cache", ("load_state", "chat"),
                         "--prefix-cache excludes --load-state and --chat (a chat resumes "
                         "from its own state)"),
    constraints.GoesWith(("no_prefix_sharing",), ("batch",),
                         "--no-prefix-sharing goes with --batch"),
    constraints.GoesWith(("shard",), ("batch",), _BUDGET_WIDTH),
    constraints.GoesWith(("batch_width",), ("batch", "serve_address"), _BUDGET_WIDTH),
    constraints.GoesWith(("response_format",),
                         ("prompt_arg", "prompt", "prompt_file", "ids", "batch"),
                         "--response-format goes with a prompt (-p, -f or --ids) or --batch"),
    *image_opts.RULES,
)


@click.command(cls=Command, help="Run Kimi K3 (or a synthetic K3 checkpoint) on a prompt, a batch file "
                    "or a chat, serve it, or score a text's perplexity. Logits are identical "
                    "at every budget.")
@click.argument("model", required=False)
@click.argument("prompt_arg", required=False, metavar="[PROMPT]", callback=params.encodable)
@click.option("-m", "--model", "model_option", metavar="MODEL",
              type=click.Path(exists=True, file_okay=False),
              help="The model directory, as the MODEL argument (give one of them).")
@click.option("--pack", type=click.Path(exists=True, file_okay=False),
              help="Pack directory made by k3-pack (else the trunk is read from the shards).")
@click.option("-p", "--prompt", callback=params.encodable,
              help="Prompt text (needs the model's tokenizer).")
@click.option("-f", "--prompt-file", "--file", "prompt_file",
              type=click.Path(exists=True, dir_okay=False, allow_dash=True),
              help="Read the prompt from a file, byte for byte (CRLF kept; must be UTF-8 "
                   "and fit the model's context); -: standard input.")
@click.option("--ids", help="Prompt as comma-separated token ids.")
@click.option("--batch", type=click.Path(exists=True, dir_okay=False, allow_dash=True),
              help="JSONL prompts (id, prompt|ids|messages, optional gen, sampling fields, "
                   "stop; formats/batch.md); -: standard input.")
@click.option("--perplexity", type=click.Path(exists=True, dir_okay=False, allow_dash=True),
              metavar="TEXT", help="Perplexity of a UTF-8 text file, llama-perplexity's way: "
                                   "windows of --ctx-size tokens (default 512), the second "
                                   "half of each scored (docs/run.md \"Perplexity\").")
@click.option("--save-logits", type=click.Path(dir_okay=False), metavar="FILE",
              help="With --perplexity: keep the scored positions' logits for a later "
                   "--kl-divergence (formats/logits.md).")
@click.option("--kl-divergence", type=click.Path(exists=True, dir_okay=False), metavar="BASE",
              help="With --perplexity: the KL divergence of this run's token distributions "
                   "from those saved in BASE (--save-logits), and the same-top-token share.")
@click.option("--out", "out_path", type=click.Path(),
              help="With --batch: results JSONL, appended; ids already there are skipped.")
@click.option("--wait", is_flag=True,
              help="With --batch: if another run holds the results file, wait for it instead "
                   "of exiting with code 6.")
@click.option("--max-prompts", type=click.IntRange(1),
              help="With --batch: stop cleanly after this many prompts (the rest: next run).")
@click.option("--deadline", type=Finite(0, 10 ** 7, min_open=True),
              metavar="MINUTES",
              help="With --batch: stop cleanly this many minutes after start, having "
                   "started only prompts this run's pace says finish by then (docs/batch.md).")
@click.option("--batch-width", "--parallel", "-np", "batch_width", default=None,
              type=Width(), metavar="N|auto",
              help="With --batch or --serve: prompts (requests) decoded in lockstep, "
                   "sharing each weight read (default auto: the most whose state fits "
                   "beside the budgets).")
@click.option("--shard", type=Shard(), metavar="K/N",
              help="With --batch: run only the ids of shard K of N (docs/batch.md).")
@click.option("--chat", "-i", "-cnv", "--conversation", "chat", is_flag=True,
              help="Interactive multi-turn chat on stdin, in the model's chat template "
                   "(/help lists its commands; docs/serve.md).")
@click.option("--template-kwargs", type=JsonObject(), metavar="JSON",
              callback=params.encodable,
              help="With --chat: extra chat-template variables, e.g. '{\"thinking\": false}'.")
@click.option("--template-timeout", type=Finite(0, 10 ** 6, min_open=True), metavar="SECONDS",
              default=DEFAULT_LIMITS.seconds, show_default=True,
              help="With --chat, --batch or --serve: a chat-template rendering that runs "
                   "longer is that conversation's error (docs/serve.md).")
@click.option("--template-max-bytes", type=click.IntRange(1), metavar="BYTES",
              default=DEFAULT_LIMITS.max_bytes, show_default=True,
              help="With --chat, --batch or --serve: a chat-template rendering that writes "
                   "more is that conversation's error.")
@click.option("--system", "-sys", "--system-prompt", "system", callback=params.system_text,
              metavar="TEXT|@FILE",
              help="With --chat: the system message opening the conversation (@FILE: the "
                   "file's text; @@ for a literal @).")
@click.option("--history", type=click.Path(dir_okay=False), envvar="K3_CHAT_HISTORY",
              show_envvar=True, help="With --chat: the line-editing history file (default "
                                     "$XDG_STATE_HOME/k3/chat_history).")
@click.option("--serve", "serve_address", metavar="[[HOST:]PORT]", is_flag=False,
              flag_value="",
              help="Serve an OpenAI-compatible API (needs the serve extra); HOST defaults "
                   "to 127.0.0.1, any other address needs --api-key; PORT to 8080 (or "
                   "--host and --port).")
@click.option("--host", help="With --serve and no address: the host (default 127.0.0.1).")
@click.option("--port", type=click.IntRange(0, 65535),
              help="With --serve and no address: the port (default 8080).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="With --serve: the access log on stderr, a text line "
                                      "or a JSON object per request (docs/serve.md).")
@click.option("--api-key", envvar="K3_API_KEY", show_envvar=True,
              help="With --serve: the key every request must send (Authorization: Bearer).")
@click.option("--served-model-name", "-a", "--alias", "served_model_name", metavar="NAME",
              help="With --serve: the model's name in the API (default: the checkpoint "
                   "directory's name); a request naming another model is 404.")
@click.option("--reuse-gb", type=gigabytes(), default=1.0, show_default=True,
              help="With --serve: RAM for states of earlier requests, resumed when a prompt "
                   "extends one (least recently used out; 0 = off).")
@click.option("--prefix-cache", metavar="DIR|auto",
              help="Keep snapshots of prompt prefixes on disk and resume later prompts "
                   "(batch lines, requests, runs) from them (auto: prefix-cache/ in the "
                   "pack, else the user cache; docs/run.md \"Prefix cache\").")
@click.option("--prefix-cache-gb", type=gigabytes(), default=PREFIX_CACHE_BYTES / 1e9,
              show_default=True, help="With --prefix-cache: its size on disk, least "
                                      "recently used out.")
@click.option("--no-prefix-sharing", is_flag=True,
              help="With --batch: prefill every line whole, even the prefix lines share "
                   "(to measure what sharing saves).")
@click.option("--save-prefix", is_flag=True,
              help="With --prefix-cache and a prompt: keep the state after the prompt as a "
                   "snapshot, for later prompts that start with it.")
@click.option("-n", "--gen", "--predict", "--n-predict", "gen",
              type=Rule(click.INT, gen_or_until_end_problem, "integer"),
              default=16, show_default=True,
              help="Tokens to generate (per turn in --chat; with --serve the default "
                   "max_tokens, else until the turn ends), at most 1,048,576 (the trained "
                   "context); -1: until the model ends its turn, a stop, or the context is "
                   "full.")
@click.option("--temperature", "--temp", "temperature",
              type=Rule(click.FLOAT, temperature_problem, "float"),
              default=0.0, show_default=True,
              help="0 = greedy; else at least 2^-126 (the smallest normal float32).")
@click.option("--top-p", type=Rule(click.FLOAT, top_p_problem, "float"), default=1.0,
              show_default=True, help="Nucleus mass, in (0, 1].")
@click.option("--top-k", type=Rule(click.INT, top_k_problem, "integer"), default=0,
              show_default=True, help="Keep the K likeliest tokens, 1 .. 2^24; 0 or -1: all.")
@click.option("--min-p", type=Rule(click.FLOAT, min_p_problem, "float"), default=0.0,
              show_default=True, help="Keep tokens at least this fraction as likely as the "
                                      "likeliest, in [0, 1]; 0: all.")
@click.option("--repeat-penalty", "--repetition-penalty", "repetition_penalty",
              type=Rule(click.FLOAT, repetition_penalty_problem, "float"), default=1.0,
              show_default=True, help="Divide the positive logits (multiply the negative) of "
                                      "every token already in the context, in [2^-126, "
                                      "2^126]; 1: off.")
@click.option("--presence-penalty", type=Rule(click.FLOAT, presence_penalty_problem, "float"),
              default=0.0, show_default=True,
              help="Subtract this from the logit of every token generated so far, in "
                   "[-2, 2].")
@click.option("--frequency-penalty",
              type=Rule(click.FLOAT, frequency_penalty_problem, "float"), default=0.0,
              show_default=True, help="Subtract this times its count so far from each "
                                      "generated token's logit, in [-2, 2] (docs/run.md "
                                      "\"Sampling\").")
@click.option("--logit-bias", "logit_bias", multiple=True, callback=params.logit_bias,
              metavar="ID=BIAS",
              help="Add BIAS, in [-100, 100], to token ID's logit before the penalties "
                   "(-100: all but banned, 100: all but forced); repeatable, an id once, "
                   "at most 300 (docs/run.md \"Sampling\").")
@click.option("--response-format", callback=params.response_format,
              metavar="json_object|@SCHEMA",
              help="Structured output: the text is a JSON object (json_object), or JSON "
                   "valid against the JSON schema in the file SCHEMA; needs the structured "
                   "extra (docs/run.md \"Structured output\").")
@click.option("-s", "--seed", "seed", type=Rule(click.INT, seed_problem, "integer"), default=0,
              show_default=True, help="0 .. 2^64 - 1.")
@click.option("--stop", "stop_strings", multiple=True, callback=params.stop_strings,
              help="Stop when this text appears in the generated text (left out of the "
                   "text shown and reported; docs/run.md \"Stop strings\").")
@click.option("--stop-id", "stop_ids", type=click.IntRange(0, MAX_SIZE - 1), multiple=True,
              help="Stop at this token id (checked against the vocabulary).")
@click.option("--preset", callback=params.note_order, expose_value=True,
              help="Memory preset: laptop, desktop, workstation, server, max, auto.")
@click.option("--trunk-gb", type=gigabytes(), callback=params.note_order,
              help="Trunk budget in GB (1e9).")
@click.option("--cache-gb", type=gigabytes(), callback=params.note_order,
              help="Expert cache budget in GB.")
@click.option("--resident", is_flag=True, help="Load every weight into RAM (small models).")
@click.option("--cache-policy", type=click.Choice(ONLINE_OBJECT_POLICIES), default=DEFAULT_POLICY,
              show_default=True, help="Expert cache eviction policy (never changes output).")
@click.option("--io-threads", type=click.IntRange(1, 64), default=IO_THREADS, show_default=True)
@click.option("--prefetch-experts", type=click.IntRange(0, 4096),
              help="Experts per MoE layer read ahead from a prediction (never changes "
                   "output; 0: off) [default: the model's experts per token]")
@click.option("--buffered-io", is_flag=True, help="Do not use O_DIRECT.")
@click.option("--stripe-dir", "stripe_dirs", multiple=True, type=click.Path(file_okay=False),
              help="With a striped --pack: where its stripe directories are now (repeat, in "
                   "the order k3-pack got them; default: where its manifest says).")
@click.option("--io-throttle-mbps", type=Finite(min=0, min_open=True),
              help="Cap each drive queue's reads at this many MB/s (leave bandwidth to others).")
@click.option("--verify-reads", type=click.Choice(["first", "every"]), default="first",
              show_default=True, help="With --pack: check a trunk layer's CRC-32 the first "
                                      "time this run reads it, or on every read.")
@click.option("--prefill-chunk", type=click.IntRange(1),
              help=f"Prompt tokens per prefill pass [default: {PREFILL_CHUNK}, longer when "
                   "the expert cache has room for its activations]")
@click.option("--spec", type=click.IntRange(0, 16), default=0, show_default=True,
              help="Speculative decoding by prompt lookup: propose up to N tokens from the "
                   "context and verify them in one pass (same tokens as without).")
@click.option("--draft", type=click.Path(exists=True, file_okay=False),
              help="Speculative decoding with a DSpark draft (its directory): several tokens "
                   "per pass, the same tokens as without (docs/run.md, \"Drafting\").")
@click.option("--draft-max", type=click.IntRange(1, 16),
              help="With --draft: verify at most N proposals per pass (default: the "
                   "draft's block, 7).")
@click.option("--draft-dump", type=click.Path(dir_okay=False),
              help="With --draft: write every verify pass's taps, block, draft logits, "
                   "confidence and target logits to this .npz.")
@threads_option
@click.option("-c", "--ctx-size", type=click.IntRange(1, MAX_POSITIONS), metavar="N",
              help="Context limit: the prompt and the tokens generated after it fit in N "
                   "tokens, else the run is refused (default: the model's context).")
@click.option("-v", "--verbose", is_flag=True,
              help="Also print the whole run report (as --json gives it) on stderr.")
@refused_options
@lambda fn: quiet_option(fn, "--log-disable")
@click.option("--save-state", type=click.Path(dir_okay=False), help="Save the state at the end.")
@click.option("--load-state", type=click.Path(exists=True, dir_okay=False),
              help="Continue from a saved state (the prompt continues it; with no prompt, "
                   "generation continues where the state ends).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False),
              help="Record every expert request to this trace file (formats/trace.md).")
@click.option("--logits-out", type=click.Path(dir_okay=False),
              help="Write float32 logits [prompt + generated, vocab] as .npy.")
@image_opts.image_options
@click.option("--report-json", type=click.Path(dir_okay=False), help="Write the run report.")
@click.option("--json", "json_out", is_flag=True, help="Print the report as JSON on stdout.")
@click.version_option(__version__, prog_name="k3-run")
@click.pass_context
@handle_errors
def main(ctx, **options):
    """Each mode is one function below; ``a`` holds every option by its parameter name."""
    started = time.monotonic()
    a = SimpleNamespace(**options)
    _positionals(ctx, a)
    constraints.check(ctx, RULES)
    a.model = a.model or a.model_option
    a.prompt = a.prompt if a.prompt_arg is None else a.prompt_arg
    a.serve_address = serve_address(a.serve_address, a.host, a.port)
    if a.serve_address:
        from libk3.serve.app import check_address
        check_address(a.serve_address, a.api_key)        # before the model is opened
    a.response_format = params.check_response_format(a.response_format)
    opts, settings = _run_options(ctx, a), _settings(a)
    params.check_logit_bias(a.model, settings.logit_bias)
    if a.batch:
        _batch_mode(a, opts, settings, started)
        return
    from libk3.run import runner
    with runner.open_run(opts) as run:
        run.check_stop_ids(a.stop_ids)
        settings = run.chunked(settings)
        if a.perplexity:
            _verbose(a, scoring.perplexity_mode(a, run))
        elif a.serve_address:
            _serve_mode(a, run, settings)
        elif a.chat:
            _chat_mode(a, run, settings)
        else:
            _prompt_mode(a, run, settings)


def _positionals(ctx, a) -> None:
    """MODEL [PROMPT], or with -m/--model: [PROMPT] alone (llama.cpp's positional
    prompt; a directory there is the model given twice); the model directory checked as
    the MODEL argument's type would."""
    import os
    from click.core import ParameterSource
    if a.model_option is not None and a.model is not None and a.prompt_arg is None \
            and not os.path.isdir(a.model):
        a.model, a.prompt_arg = None, a.model
        ctx.set_parameter_source("model", ParameterSource.DEFAULT)
        ctx.set_parameter_source("prompt_arg", ParameterSource.COMMANDLINE)
        params.encodable(ctx, None, a.prompt_arg)
    if a.model is not None:
        param = next(p for p in ctx.command.params if p.name == "model")
        a.model = click.Path(exists=True, file_okay=False).convert(a.model, param, ctx)


def _run_options(ctx, a):
    """What opens the model: budget, pack, streaming, drafting, tracing."""
    from libk3.run import runner
    width = None if not (a.batch or a.serve_address) else \
        ("auto" if a.batch_width is None else a.batch_width)
    beside = 0
    if a.serve_address:
        from libk3.serve.app import beside_bytes
        beside = beside_bytes(int(a.reuse_gb * 1e9))
    return runner.RunOptions(
        model=a.model, pack=a.pack, preset=a.preset, trunk_gb=a.trunk_gb, cache_gb=a.cache_gb,
        budget_order=ctx.meta.get("k3_budget_order", []), resident=a.resident,
        cache_policy=a.cache_policy, io_threads=a.io_threads, direct_io=not a.buffered_io,
        stripe_dirs=tuple(a.stripe_dirs), io_throttle_mbps=a.io_throttle_mbps,
        prefetch_experts=a.prefetch_experts, trace_path=a.trace_path,
        verify_reads=a.verify_reads, batch_width=width,
        progress=not a.quiet, spec=a.spec, draft=a.draft, draft_max=a.draft_max,
        draft_dump=a.draft_dump, warn=lambda m: click.echo(f"k3-run: {m}", err=True),
        template_limits=RenderLimits(a.template_timeout, a.template_max_bytes),
        prefix_cache=a.prefix_cache, prefix_cache_bytes=int(a.prefix_cache_gb * 1e9),
        share_prefixes=not a.no_prefix_sharing, serve=bool(a.serve_address),
        vision=bool(a.image or a.chat or a.batch or a.serve_address), image_dir=a.image_dir,
        load_state=a.load_state, prefill_chunk=a.prefill_chunk, beside_bytes=beside,
        context_limit=a.ctx_size)


def _settings(a):
    """How tokens are chosen and when generation stops."""
    from libk3.run import runner
    return runner.settings_from(gen=a.gen, temperature=a.temperature, top_p=a.top_p,
                                seed=a.seed, stop_strings=a.stop_strings, stop_ids=a.stop_ids,
                                prefill_chunk=a.prefill_chunk or PREFILL_CHUNK, model=a.model,
                                top_k=a.top_k,
                                min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                                presence_penalty=a.presence_penalty,
                                frequency_penalty=a.frequency_penalty,
                                logit_bias=a.logit_bias, response_format=a.response_format)


def _serve_mode(a, run, settings) -> None:
    """--serve: the OpenAI-style server until it is stopped. A request without
    max_tokens generates until its turn ends or the context is full (what clients
    expect), unless --gen was given: then that is the default."""
    import dataclasses
    from click.core import ParameterSource
    from libk3.engine.settings import UNTIL_END
    from libk3.serve.app import serve
    if click.get_current_context().get_parameter_source("gen") != ParameterSource.COMMANDLINE:
        settings = dataclasses.replace(settings, gen=UNTIL_END)
    serve(run, a.serve_address, settings, api_key=a.api_key,
          log=lambda m: click.echo(m, err=True),
          reuse_ram_bytes=int(a.reuse_gb * 1e9),
          model_name=a.served_model_name, log_json=a.log_format == "json")


def _chat_mode(a, run, settings) -> None:
    """--chat: turns and commands from the terminal or stdin until /exit or end of input."""
    from libk3.run import chat_session, repl
    tok = run.session.tokenizer

    def printer():                  # a model without a template continues text: raw
        if run.chat().template is None:
            return Printer(tok, settings.stop_strings)
        return ReplyPrinter(tok, settings.stop_strings)
    with repl.Console(history=a.history) as console:
        chat_session.run_chat(run, settings, load_state=a.load_state,
                              save_state=a.save_state, emit_factory=printer,
                              console=console, warn=lambda m: click.echo(m, err=True),
                              template_kwargs=a.template_kwargs, system=a.system,
                              images=a.image)


def _prompt_mode(a, run, settings) -> None:
    """--prompt, --prompt-file, --ids: one prompt, its text as it comes, then the report;
    none (--load-state alone): the state's generation continues."""
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


def _batch_mode(a, opts, settings, started: float) -> None:
    """--batch: the whole file (or what the limits allow), then its summary."""
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


def _verbose(a, doc) -> None:
    """--verbose: the whole report on stderr, as --json prints it on stdout."""
    if a.verbose:
        import json
        click.echo(json.dumps(doc, indent=2, sort_keys=True, default=str), err=True)


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
