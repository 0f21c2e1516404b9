"""k3-run's options, declared once in groups that the modes stack (docs/run.md "Modes").

Owns: every option of every k3-run mode as a decorator, grouped by what it sets: the
model and where its weights come from (``model_options``, ``budget_options``), output
(``output_options``), how tokens are chosen (``sampling_options``, ``drafting_options``),
saved states and the prefix cache, chat-template limits, and each mode's own options.
Does not own: which mode stacks which group (``modes``), what a value may be (option
types in ``k3cli.group``, rules in ``libk3.engine.settings``), the image options
(``image_opts``) or the llama.cpp flags refused everywhere (``llama``).

Why groups: a mode lists only the options it reads, so ``k3-run batch --help`` shows
batch's, and an option no mode of its kind reads is never silently taken.
"""

from __future__ import annotations

import click

from k3cli.group import (Finite, JsonObject, Rule, Shard, Width, gigabytes, quiet_option,
                         threads_option)
from libk3 import __version__
from libk3.config import MAX_SIZE
from libk3.engine.defaults import IO_THREADS, PREFILL_CHUNK, PREFIX_CACHE_BYTES
from libk3.engine.settings import (MAX_POSITIONS, frequency_penalty_problem,
                                   gen_or_until_end_problem, min_p_problem,
                                   presence_penalty_problem,
                                   repetition_penalty_problem, seed_problem,
                                   temperature_problem, top_k_problem, top_p_problem)
from libk3.policies.registry import DEFAULT_POLICY, ONLINE_OBJECT_POLICIES
from libk3.text.chat_template import DEFAULT_LIMITS

from . import params
from .llama import refused_options


def stack(*decorators):
    """One decorator applying ``decorators`` so that the first is the first in --help."""
    def apply(fn):
        for d in reversed(decorators):
            fn = d(fn)
        return fn
    return apply


model_options = stack(
    click.argument("model", type=click.Path(exists=True, file_okay=False)),
    click.option("-m", "--model", "model_option", metavar="MODEL", expose_value=False,
                 help="The model directory, as the MODEL argument (give one of them)."),
    click.version_option(__version__, prog_name="k3-run"),
)

budget_options = stack(
    click.option("--pack", type=click.Path(exists=True, file_okay=False),
                 help="Pack directory made by k3-pack (else the trunk is read from the "
                      "shards)."),
    click.option("--preset", callback=params.note_order,
                 help="Memory preset: laptop, desktop, workstation, server, max, auto."),
    click.option("--trunk-gb", type=gigabytes(), callback=params.note_order,
                 help="Trunk budget in GB (1e9)."),
    click.option("--cache-gb", type=gigabytes(), callback=params.note_order,
                 help="Expert cache budget in GB."),
    click.option("--resident", is_flag=True, help="Load every weight into RAM (small models)."),
    click.option("--cache-policy", type=click.Choice(ONLINE_OBJECT_POLICIES),
                 default=DEFAULT_POLICY, show_default=True,
                 help="Expert cache eviction policy (never changes output)."),
    click.option("--io-threads", type=click.IntRange(1, 64), default=IO_THREADS,
                 show_default=True),
    click.option("--prefetch-experts", type=click.IntRange(0, 4096),
                 help="Experts per MoE layer read ahead from a prediction (never changes "
                      "output; 0: off) [default: the model's experts per token]"),
    click.option("--buffered-io", is_flag=True, help="Do not use O_DIRECT."),
    click.option("--stripe-dir", "stripe_dirs", multiple=True,
                 type=click.Path(file_okay=False),
                 help="With a striped --pack: where its stripe directories are now (repeat, "
                      "in the order k3-pack got them; default: where its manifest says)."),
    click.option("--io-throttle-mbps", type=Finite(min=0, min_open=True),
                 help="Cap each drive queue's reads at this many MB/s (leave bandwidth to "
                      "others)."),
    click.option("--verify-reads", type=click.Choice(["first", "every"]), default="first",
                 show_default=True, help="With --pack: check a trunk layer's CRC-32 the "
                                         "first time this run reads it, or on every read."),
    click.option("--prefill-chunk", type=click.IntRange(1),
                 help=f"Prompt tokens per prefill pass [default: {PREFILL_CHUNK}, longer "
                      "when the expert cache has room for its activations]"),
    threads_option,
    click.option("-c", "--ctx-size", type=click.IntRange(1, MAX_POSITIONS), metavar="N",
                 help="Context limit: the prompt and the tokens generated after it fit in "
                      "N tokens, else the run is refused (default: the model's context)."),
    click.option("--trace", "trace_path", type=click.Path(dir_okay=False),
                 help="Record every expert request to this trace file (formats/trace.md)."),
)

output_options = stack(
    click.option("-v", "--verbose", is_flag=True,
                 help="Also print the whole run report (as --json gives it) on stderr."),
    refused_options,
    lambda fn: quiet_option(fn, "--log-disable"),
)

quiet_only = stack(refused_options, lambda fn: quiet_option(fn, "--log-disable"))

json_option = click.option("--json", "json_out", is_flag=True,
                           help="Print the report as JSON on stdout.")

sampling_options = stack(
    click.option("-n", "--gen", "--predict", "--n-predict", "gen",
                 type=Rule(click.INT, gen_or_until_end_problem, "integer"),
                 default=16, show_default=True,
                 help="Tokens to generate (per turn in chat; in serve the default "
                      "max_tokens, else until the turn ends), at most 1,048,576 (the "
                      "trained context); -1: until the model ends its turn, a stop, or the "
                      "context is full."),
    click.option("--temperature", "--temp", "temperature",
                 type=Rule(click.FLOAT, temperature_problem, "float"),
                 default=0.0, show_default=True,
                 help="0 = greedy; else at least 2^-126 (the smallest normal float32)."),
    click.option("--top-p", type=Rule(click.FLOAT, top_p_problem, "float"), default=1.0,
                 show_default=True, help="Nucleus mass, in (0, 1]."),
    click.option("--top-k", type=Rule(click.INT, top_k_problem, "integer"), default=0,
                 show_default=True,
                 help="Keep the K likeliest tokens, 1 .. 2^24; 0 or -1: all."),
    click.option("--min-p", type=Rule(click.FLOAT, min_p_problem, "float"), default=0.0,
                 show_default=True, help="Keep tokens at least this fraction as likely as "
                                         "the likeliest, in [0, 1]; 0: all."),
    click.option("--repeat-penalty", "--repetition-penalty", "repetition_penalty",
                 type=Rule(click.FLOAT, repetition_penalty_problem, "float"), default=1.0,
                 show_default=True, help="Divide the positive logits (multiply the "
                                         "negative) of every token already in the context, "
                                         "in [2^-126, 2^126]; 1: off."),
    click.option("--presence-penalty",
                 type=Rule(click.FLOAT, presence_penalty_problem, "float"),
                 default=0.0, show_default=True,
                 help="Subtract this from the logit of every token generated so far, in "
                      "[-2, 2]."),
    click.option("--frequency-penalty",
                 type=Rule(click.FLOAT, frequency_penalty_problem, "float"), default=0.0,
                 show_default=True, help="Subtract this times its count so far from each "
                                         "generated token's logit, in [-2, 2] (docs/run.md "
                                         "\"Sampling\")."),
    click.option("--logit-bias", "logit_bias", multiple=True, callback=params.logit_bias,
                 metavar="ID=BIAS",
                 help="Add BIAS, in [-100, 100], to token ID's logit before the penalties "
                      "(-100: all but banned, 100: all but forced); repeatable, an id "
                      "once, at most 300 (docs/run.md \"Sampling\")."),
    click.option("-s", "--seed", "seed", type=Rule(click.INT, seed_problem, "integer"),
                 default=0, show_default=True, help="0 .. 2^64 - 1."),
    click.option("--stop", "stop_strings", multiple=True, callback=params.stop_strings,
                 help="Stop when this text appears in the generated text (left out of the "
                      "text shown and reported; docs/run.md \"Stop strings\")."),
    click.option("--stop-id", "stop_ids", type=click.IntRange(0, MAX_SIZE - 1),
                 multiple=True, help="Stop at this token id (checked against the "
                                     "vocabulary)."),
)

response_format_option = click.option(
    "--response-format", callback=params.response_format, metavar="json_object|@SCHEMA",
    help="Structured output: the text is a JSON object (json_object), or JSON valid "
         "against the JSON schema in the file SCHEMA; needs the structured extra "
         "(docs/run.md \"Structured output\").")

drafting_options = stack(
    click.option("--spec", type=click.IntRange(0, 16), default=0, show_default=True,
                 help="Speculative decoding by prompt lookup: propose up to N tokens from "
                      "the context and verify them in one pass (same tokens as without)."),
    click.option("--draft", type=click.Path(exists=True, file_okay=False),
                 help="Speculative decoding with a DSpark draft (its directory): several "
                      "tokens per pass, the same tokens as without (docs/run.md, "
                      "\"Drafting\")."),
    click.option("--draft-max", type=click.IntRange(1, 16),
                 help="With --draft: verify at most N proposals per pass (default: the "
                      "draft's block, 7)."),
    click.option("--draft-dump", type=click.Path(dir_okay=False),
                 help="With --draft: write every verify pass's taps, block, draft logits, "
                      "confidence and target logits to this .npz."),
)

prefix_options = stack(
    click.option("--prefix-cache", metavar="DIR|auto",
                 help="Keep snapshots of prompt prefixes on disk and resume later prompts "
                      "(batch lines, requests, runs) from them (auto: prefix-cache/ in the "
                      "pack, else the user cache; docs/run.md \"Prefix cache\")."),
    click.option("--prefix-cache-gb", type=gigabytes(), default=PREFIX_CACHE_BYTES / 1e9,
                 show_default=True, help="With --prefix-cache: its size on disk, least "
                                         "recently used out."),
)

state_options = stack(
    click.option("--save-state", type=click.Path(dir_okay=False),
                 help="Save the state at the end."),
    click.option("--load-state", type=click.Path(exists=True, dir_okay=False),
                 help="Continue from a saved state (the prompt continues it; with no "
                      "prompt, generation continues where the state ends)."),
)

template_options = stack(
    click.option("--template-timeout", type=Finite(0, 10 ** 6, min_open=True),
                 metavar="SECONDS", default=DEFAULT_LIMITS.seconds, show_default=True,
                 help="A chat-template rendering that runs longer is that conversation's "
                      "error (docs/serve.md)."),
    click.option("--template-max-bytes", type=click.IntRange(1), metavar="BYTES",
                 default=DEFAULT_LIMITS.max_bytes, show_default=True,
                 help="A chat-template rendering that writes more is that conversation's "
                      "error."),
)

width_option = click.option(
    "--batch-width", "--parallel", "-np", "batch_width", default=None, type=Width(),
    metavar="N|auto", help="Prompts (requests) decoded in lockstep, sharing each weight "
                           "read (default auto: the most whose state fits beside the "
                           "budgets).")

prompt_options = stack(
    click.argument("prompt_arg", required=False, metavar="[PROMPT]",
                   callback=params.encodable),
    click.option("-p", "--prompt", callback=params.encodable,
                 help="Prompt text (needs the model's tokenizer)."),
    click.option("-f", "--prompt-file", "--file", "prompt_file",
                 type=click.Path(exists=True, dir_okay=False, allow_dash=True),
                 help="Read the prompt from a file, byte for byte (CRLF kept; must be UTF-8 "
                      "and fit the model's context); -: standard input."),
    click.option("--ids", help="Prompt as comma-separated token ids."),
    click.option("--save-prefix", is_flag=True,
                 help="With --prefix-cache: keep the state after the prompt as a snapshot, "
                      "for later prompts that start with it."),
    click.option("--logits-out", type=click.Path(dir_okay=False),
                 help="Write float32 logits [prompt + generated, vocab] as .npy."),
    click.option("--report-json", type=click.Path(dir_okay=False),
                 help="Write the run report."),
)

batch_options = stack(
    click.argument("batch", metavar="PROMPTS.jsonl",
                   type=click.Path(exists=True, dir_okay=False, allow_dash=True)),
    click.option("--out", "out_path", type=click.Path(), required=True,
                 metavar="RESULTS.jsonl",
                 help="Results JSONL, appended; ids already there are skipped."),
    click.option("--wait", is_flag=True,
                 help="If another run holds the results file, wait for it instead of "
                      "exiting with code 6."),
    click.option("--max-prompts", type=click.IntRange(1),
                 help="Stop cleanly after this many prompts (the rest: next run)."),
    click.option("--deadline", type=Finite(0, 10 ** 7, min_open=True), metavar="MINUTES",
                 help="Stop cleanly this many minutes after start, having started only "
                      "prompts this run's pace says finish by then (docs/batch.md)."),
    click.option("--shard", type=Shard(), metavar="K/N",
                 help="Run only the ids of shard K of N (docs/batch.md)."),
    click.option("--no-prefix-sharing", is_flag=True,
                 help="Prefill every line whole, even the prefix lines share (to measure "
                      "what sharing saves)."),
)

chat_options = stack(
    click.option("--template-kwargs", type=JsonObject(), metavar="JSON",
                 callback=params.encodable,
                 help="Extra chat-template variables, e.g. '{\"thinking\": false}'."),
    click.option("--system", "-sys", "--system-prompt", "system",
                 callback=params.system_text, metavar="TEXT|@FILE",
                 help="The system message opening the conversation (@FILE: the file's "
                      "text; @@ for a literal @)."),
    click.option("--history", type=click.Path(dir_okay=False), envvar="K3_CHAT_HISTORY",
                 show_envvar=True, help="The line-editing history file (default "
                                        "$XDG_STATE_HOME/k3/chat_history)."),
)

serve_options = stack(
    click.argument("serve_address", metavar="[[HOST:]PORT]", required=False),
    click.option("--host", help="With no address: the host (default 127.0.0.1)."),
    click.option("--port", type=click.IntRange(0, 65535),
                 help="With no address: the port (default 8080)."),
    click.option("--log-format", type=click.Choice(["text", "json"]), default="text",
                 show_default=True, help="The access log on stderr, a text line or a JSON "
                                         "object per request (docs/serve.md)."),
    click.option("--api-key", envvar="K3_API_KEY", show_envvar=True,
                 help="The key every request must send (Authorization: Bearer)."),
    click.option("--served-model-name", "-a", "--alias", "served_model_name", metavar="NAME",
                 help="The model's name in the API (default: the checkpoint directory's "
                      "name); a request naming another model is 404."),
    click.option("--reuse-gb", type=gigabytes(), default=1.0, show_default=True,
                 help="RAM for states of earlier requests, resumed when a prompt extends "
                      "one (least recently used out; 0 = off)."),
)

perplexity_options = stack(
    click.argument("perplexity", metavar="TEXT",
                   type=click.Path(exists=True, dir_okay=False, allow_dash=True)),
    click.option("--save-logits", type=click.Path(dir_okay=False), metavar="FILE",
                 help="Keep the scored positions' logits for a later --kl-divergence "
                      "(formats/logits.md)."),
    click.option("--kl-divergence", type=click.Path(exists=True, dir_okay=False),
                 metavar="BASE",
                 help="The KL divergence of this run's token distributions from those "
                      "saved in BASE (--save-logits), and the same-top-token share."),
)
