"""k3-run --perplexity's front end: the progress over windows, the running figures as
llama-perplexity prints them, the final estimate or the --json document.

Owns: printing. Does not own: the windows, the figures or the logits file
(``libk3.run.perplexity``), or opening the model (``modes``).
"""

from __future__ import annotations

import time

import click

from k3cli.support import print_json


def perplexity_mode(a, run) -> dict:
    """--perplexity: the running figure after each window on stdout (llama-perplexity's
    ``[1]12.3,[2]11.9,``), then the final estimate; --json: the result document only.
    Returns the document."""
    from libk3 import progress
    from libk3.run import perplexity
    started = time.monotonic()
    ids = run.encode(perplexity.read_text(a.perplexity))
    ctx = run.context if a.ctx_size else min(perplexity.DEFAULT_CTX, run.context)
    p = perplexity.plan(ids, ctx, a.perplexity)
    bar = progress.bar(desc="perplexity", total=p.windows, unit="windows", eta=True,
                       show=not a.quiet)

    def shown(i, doc):
        bar.update(1)
        if not a.json_out:
            click.echo(f"[{i + 1}]{doc['ppl']:.4f},", nl=False)
    with bar:
        doc = perplexity.evaluate(
            perplexity.engine_window_logits(run.session, run.prefill_chunk), ids, p,
            run.cfg.vocab_size, save=a.save_logits, base=a.kl_divergence, on_window=shown)
    if a.json_out:
        print_json(doc)
    else:
        click.echo("\n" + perplexity.text_line(doc))
    click.echo(f"perplexity: {p.windows} windows of {p.ctx} tokens, {doc['scored']} scored, "
               f"{time.monotonic() - started:.1f} s", err=True)
    return doc
