"""k3-pack: convert a K3 checkpoint into a pack (trunk file + expert index); also makes
synthetic checkpoints (``synth``) and verifies packs (``verify``).

Thin click front end: options are parsed here, the work is in libk3.
"""

from __future__ import annotations

import click

from libk3 import __version__
from libk3.cli_group import DefaultGroup
from libk3.cli_support import handle_errors, print_json


@click.group(cls=DefaultGroup, default="pack",
             help="Pack a K3 checkpoint: `k3-pack CHECKPOINT OUT`. "
                  "Subcommands: synth (make a synthetic checkpoint), verify (check a pack).")
@click.version_option(__version__, prog_name="k3-pack")
def main():
    pass


@main.command("synth")
@click.option("--preset", type=click.Choice(["tiny", "small", "medium", "real-dims", "real-sparse"]),
              default="tiny", show_default=True, help="Size of the synthetic model.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_out", is_flag=True, help="Print a JSON summary.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.argument("out", type=click.Path(file_okay=False))
@handle_errors
def synth(out, preset, seed, json_out, quiet):
    """Write a synthetic K3 checkpoint in the released layout into OUT."""
    from libk3.synth.checkpoint import synth_checkpoint, summary

    path = synth_checkpoint(out, preset=preset, seed=seed, progress=not quiet)
    info = summary(path)
    if json_out:
        print_json(info)
    else:
        click.echo(f"wrote {info['shards']} shards, {info['tensors']} tensors, "
                   f"{info['apparent_bytes'] / 1e9:.3f} GB apparent, "
                   f"{info['disk_bytes'] / 1e9:.3f} GB on disk to {path}")
