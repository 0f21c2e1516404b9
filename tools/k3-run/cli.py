"""k3-run: streamed inference of Kimi K3 (thin click front end over libk3.engine)."""

from __future__ import annotations

import json
import sys

import click
import numpy as np

from libk3 import __version__
from libk3.cli_support import handle_errors, print_json
from libk3.errors import UsageError
from libk3.policy_registry import DEFAULT_POLICY, ONLINE_OBJECT_POLICIES


def _note_order(ctx, param, value):
    """Record budget flags in argv order: a later flag overrides an earlier one."""
    if value is not None:
        ctx.meta.setdefault("k3_budget_order", []).append(param.name)
    return value


class _Printer:
    """Writes each token to stdout as it is produced: text through the tokenizer's
    streaming decoder (a UTF-8 character is never split), or ids when there is none."""

    def __init__(self, tokenizer):
        self.dec = tokenizer.stream_decoder() if tokenizer is not None else None

    def __call__(self, tok):
        sys.stdout.write(self.dec.push(tok) if self.dec is not None else f"{tok} ")
        sys.stdout.flush()

    def finish(self):
        if self.dec is not None:
            sys.stdout.write(self.dec.flush())
        sys.stdout.write("\n")
        sys.stdout.flush()


@click.command(help="Run Kimi K3 (or a synthetic K3 checkpoint) on a prompt, a batch file "
                    "or a chat. Logits are identical at every budget.")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option("--pack", type=click.Path(exists=True, file_okay=False),
              help="Pack directory made by k3-pack (else the trunk is read from the shards).")
@click.option("--prompt", help="Prompt text (needs the model's tokenizer).")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False),
              help="Read the prompt verbatim from a file.")
@click.option("--ids", help="Prompt as comma-separated token ids.")
@click.option("--batch", type=click.Path(exists=True, dir_okay=False),
              help="JSONL prompts (id, prompt|ids, optional gen/temperature/top_p/seed/stop).")
@click.option("--out", "out_path", type=click.Path(dir_okay=False),
              help="With --batch: results JSONL, appended; ids already there are skipped.")
@click.option("--chat", is_flag=True, help="Interactive multi-turn chat on stdin.")
@click.option("--gen", type=click.IntRange(0), default=16, show_default=True,
              help="Tokens to generate (per turn in --chat).")
@click.option("--temperature", type=click.FloatRange(0), default=0.0, show_default=True,
              help="0 = greedy.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0,
              show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--stop", "stop_strings", multiple=True, help="Stop when this text appears.")
@click.option("--stop-id", "stop_ids", type=int, multiple=True, help="Stop at this token id.")
@click.option("--preset", callback=_note_order, expose_value=True,
              help="Memory preset: laptop, desktop, workstation, server, max, auto.")
@click.option("--trunk-gb", type=float, callback=_note_order, help="Trunk budget in GB (1e9).")
@click.option("--cache-gb", type=float, callback=_note_order, help="Expert cache budget in GB.")
@click.option("--resident", is_flag=True, help="Load every weight into RAM (small models).")
@click.option("--cache-policy", type=click.Choice(ONLINE_OBJECT_POLICIES), default=DEFAULT_POLICY,
              show_default=True, help="Expert cache eviction policy (never changes output).")
@click.option("--io-threads", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--buffered-io", is_flag=True, help="Do not use O_DIRECT.")
@click.option("--prefill-chunk", type=click.IntRange(1), default=64, show_default=True)
@click.option("--spec", type=click.IntRange(0, 16), default=0, show_default=True,
              help="Speculative decoding: draft up to N tokens by prompt lookup and verify "
                   "them in one batched forward (greedy only; same tokens as without; backs "
                   "off while drafts keep failing).")
@click.option("--threads", type=click.IntRange(1), help="numba threads (default: all cores).")
@click.option("--save-state", type=click.Path(dir_okay=False), help="Save the state at the end.")
@click.option("--load-state", type=click.Path(exists=True, dir_okay=False),
              help="Continue from a saved state (the prompt continues it).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False),
              help="Record every expert request to this trace file (formats/trace.md).")
@click.option("--logits-out", type=click.Path(dir_okay=False),
              help="Write float32 logits [prompt + generated, vocab] as .npy.")
@click.option("--report-json", type=click.Path(dir_okay=False), help="Write the run report.")
@click.option("--json", "json_out", is_flag=True, help="Print the report as JSON on stdout.")
@click.version_option(__version__, prog_name="k3-run")
@click.pass_context
@handle_errors
def main(ctx, model, pack, prompt, prompt_file, ids, batch, out_path, chat, gen, temperature,
         top_p, seed, stop_strings, stop_ids, preset, trunk_gb, cache_gb, resident,
         cache_policy, io_threads, buffered_io, prefill_chunk, spec, threads, save_state, load_state,
         trace_path, logits_out, report_json, json_out):
    from libk3.engine import runner

    modes = [o for o, v in (("--prompt", prompt), ("--prompt-file", prompt_file),
                            ("--ids", ids), ("--batch", batch), ("--chat", chat or None))
             if v is not None]
    if len(modes) != 1:
        raise UsageError("give exactly one of --prompt, --prompt-file, --ids, --batch, --chat"
                         + (f" (got {', '.join(modes)})" if modes else ""))
    if batch and not out_path:
        raise UsageError("--batch needs --out RESULTS.jsonl")
    if out_path and not batch:
        raise UsageError("--out goes with --batch")
    if resident and (preset or trunk_gb is not None or cache_gb is not None or pack):
        raise UsageError("--resident excludes --preset, --trunk-gb, --cache-gb and --pack")
    if spec and temperature > 0:
        raise UsageError("--spec keeps exactly the greedy result; it needs --temperature 0")
    if threads:
        import numba
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    opts = runner.RunOptions(
        model=model, pack=pack, preset=preset, trunk_gb=trunk_gb, cache_gb=cache_gb,
        budget_order=ctx.meta.get("k3_budget_order", []), resident=resident,
        cache_policy=cache_policy, io_threads=io_threads, direct_io=not buffered_io,
        trace_path=trace_path)
    settings = runner.settings_from(gen=gen, temperature=temperature, top_p=top_p, seed=seed,
                                    stop_strings=stop_strings, stop_ids=stop_ids,
                                    prefill_chunk=prefill_chunk, spec=spec)
    with runner.open_run(opts) as run:
        if batch:
            summary = runner.run_batch(run, batch, out_path, settings,
                                       warn=lambda m: click.echo(m, err=True))
            if json_out:
                print_json(summary)
            else:
                click.echo(f"batch: {summary['done']} done, {summary['skipped']} already in "
                           f"{out_path}, {summary['malformed']} malformed line(s)", err=True)
            return
        if chat:
            runner.run_chat(run, settings, load_state=load_state, save_state=save_state,
                            emit_factory=lambda: _Printer(run.session.tokenizer),
                            prompt_fn=lambda: click.prompt("you", prompt_suffix="> ",
                                                           default="", show_default=False,
                                                           err=True))
            return
        if ids is not None:
            prompt_ids = runner.parse_ids(ids, run.cfg.vocab_size)
        else:
            text = prompt if prompt is not None else open(prompt_file, encoding="utf-8").read()
            prompt_ids = run.encode(text)
        printer = None if json_out else _Printer(run.session.tokenizer)
        res = runner.run_one(run, prompt_ids, settings, on_token=printer,
                             keep_logits=logits_out is not None, load_state=load_state,
                             save_state=save_state)
        if printer is not None:
            printer.finish()
        if logits_out:
            np.save(logits_out, res.logits)
        rep = run.report(res)
    if report_json:
        with open(report_json, "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=2, sort_keys=True)
            f.write("\n")
    if json_out:
        print_json(rep)
    else:
        from libk3.engine.report import short_text
        click.echo(short_text(rep), err=True)
