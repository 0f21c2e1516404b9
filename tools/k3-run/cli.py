"""k3-run: streamed inference of Kimi K3 (thin click front end over libk3.engine)."""

from __future__ import annotations

import codecs
import json
import sys

import click
import numpy as np

from libk3 import __version__
from libk3.cli_support import handle_errors, print_json
from libk3.errors import UsageError


def _emit_stream(tokenizer):
    """A per-token printer: text when a tokenizer exists (UTF-8 never split), else ids."""
    if tokenizer is None:
        def emit(tok):
            sys.stdout.write(f"{tok} ")
            sys.stdout.flush()
        return emit
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def emit(tok):
        sys.stdout.write(dec.decode(tokenizer.decode_bytes([tok])))
        sys.stdout.flush()
    return emit


@click.command(help="Run Kimi K3 (or a synthetic K3 checkpoint) on a prompt.")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", help="Prompt text (needs the model's tokenizer).")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False),
              help="Read the prompt verbatim from a file.")
@click.option("--ids", help="Prompt as comma-separated token ids.")
@click.option("--gen", type=click.IntRange(0), default=16, show_default=True,
              help="Tokens to generate.")
@click.option("--temperature", type=click.FloatRange(0), default=0.0, show_default=True,
              help="0 = greedy.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0,
              show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--stop", "stop_strings", multiple=True, help="Stop when this text appears.")
@click.option("--stop-id", "stop_ids", type=int, multiple=True, help="Stop at this token id.")
@click.option("--threads", type=click.IntRange(1), help="numba threads (default: all cores).")
@click.option("--logits-out", type=click.Path(dir_okay=False),
              help="Write float32 logits [prompt + generated, vocab] as .npy.")
@click.option("--report-json", type=click.Path(dir_okay=False), help="Write the run report.")
@click.option("--json", "json_out", is_flag=True, help="Print the report as JSON on stdout.")
@click.version_option(__version__, prog_name="k3-run")
@handle_errors
def main(model, prompt, prompt_file, ids, gen, temperature, top_p, seed, stop_strings,
         stop_ids, threads, logits_out, report_json, json_out):
    from libk3.engine.generate import GenSettings, generate
    from libk3.engine.session import open_session, parse_ids

    given = [o for o, v in (("--prompt", prompt), ("--prompt-file", prompt_file),
                            ("--ids", ids)) if v is not None]
    if len(given) != 1:
        raise UsageError("give exactly one of --prompt, --prompt-file, --ids"
                         + (f" (got {', '.join(given)})" if given else ""))
    if threads:
        import numba
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    sess = open_session(model)
    cfg = sess.cfg
    if ids is not None:
        prompt_ids = parse_ids(ids, cfg.vocab_size)
    else:
        if sess.tokenizer is None:
            raise UsageError("this model has no tokenizer (tiktoken.model); use --ids")
        text = prompt if prompt is not None else open(prompt_file, encoding="utf-8").read()
        prompt_ids = sess.tokenizer.encode(text)
        if not prompt_ids:
            raise UsageError("the prompt encodes to no tokens")
    settings = GenSettings(gen=gen, temperature=temperature, top_p=top_p, seed=seed,
                           stop_ids=tuple(stop_ids), stop_strings=tuple(stop_strings))
    emit = None if json_out else _emit_stream(sess.tokenizer)
    res = generate(sess.forward, sess.new_state(), prompt_ids, settings,
                   tokenizer=sess.tokenizer, on_token=emit, keep_logits=logits_out is not None)
    if not json_out:
        sys.stdout.write("\n")
    if logits_out:
        np.save(logits_out, res.logits)
    report = {
        "model": str(model), "prompt_ids": res.prompt_ids, "generated_ids": res.generated_ids,
        "stop_reason": res.stop_reason, "prefill_seconds": round(res.prefill_seconds, 6),
        "decode_seconds": round(res.decode_seconds, 6),
        "seconds_per_token": round(res.seconds_per_token, 6),
        "temperature": temperature, "top_p": top_p, "seed": seed,
    }
    if sess.tokenizer is not None:
        report["generated_text"] = sess.tokenizer.decode(res.generated_ids)
    if report_json:
        with open(report_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    if json_out:
        print_json(report)
    else:
        click.echo(f"{len(res.generated_ids)} tokens, {res.seconds_per_token:.3f} s/token "
                   f"(prefill {res.prefill_seconds:.2f} s)", err=True)
