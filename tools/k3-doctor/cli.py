"""k3-doctor: can this machine run this K3 model, with which preset, and what to run next.

Thin click front end: options are parsed here, the work is in ``libk3.doctor.report``.
Exit status: 0 can run, 1 cannot (every reason printed), 2 usage error.
"""

from __future__ import annotations

import sys

import click

from libk3 import __version__
from k3cli.group import Command, Finite, gigabytes, quiet_option, threads_option
from k3cli.support import handle_errors, print_json


@click.command(cls=Command, help="Check the machine (and a model directory) before running K3: memory, "
                    "disk speed, checkpoint completeness, pack state; pick a preset and "
                    "print the next command. Exit 0 = can run, 1 = cannot, 2 = usage error.")
@click.argument("model", required=False, type=click.Path(exists=True, file_okay=False))
@click.option("--pack", "pack_dir", type=click.Path(file_okay=False),
              help="Pack directory (existing or to be created) to check and measure.")
@click.option("--stripe", "stripes", multiple=True, type=click.Path(file_okay=False),
              help="Another drive's directory the trunk could be striped onto (repeat): "
                   "measured, and the placement with the best s/token recommended.")
@click.option("--draft", type=click.Path(exists=True, file_okay=False),
              help="A DSpark draft for MODEL: checked, counted in every budget, and whether "
                   "drafting pays at the pick.")
@click.option("--json", "json_out", is_flag=True, help="Print the report as JSON.")
@click.option("--quick", is_flag=True, help="Skip the disk and kernel measurements.")
@click.option("--compile", "compile_only", is_flag=True,
              help="Compile every numba kernel the k3 tools use (a minute or more, once per "
                   "machine; numba caches them), say where they are cached, and exit.")
@click.option("--assume-memory-gb", type=gigabytes(positive=True),
              help="Pretend the machine has this much memory available (GB = 1e9 bytes).")
@click.option("--assume-read-mbps", type=Finite(min=0, min_open=True),
              help="Use this sequential read rate (MB/s) instead of the measured one.")
@click.option("--assume-decode-mbps", type=Finite(min=0, min_open=True),
              help="Use this compressed-trunk decode rate (MB/s of output) instead of the "
                   "measured one.")
@click.option("--probe-size-mb", type=Finite(min=1, max=1e9), default=1000.0,
              show_default=True,
              help="Size of the temporary file read when the model's own files cannot be "
                   "(MB = 1e6 bytes): in the temporary directory if it is on the same "
                   "filesystem, never in the model, the pack or a git checkout; always "
                   "removed.")
@threads_option
@quiet_option
@click.version_option(__version__, prog_name="k3-doctor")
@handle_errors
def main(model, pack_dir, stripes, draft, json_out, quick, compile_only, assume_memory_gb,
         assume_read_mbps, assume_decode_mbps, probe_size_mb, threads, quiet):
    from libk3.engine import precompile

    if compile_only:
        summary = precompile.compile_all(show=not quiet)
        if json_out:
            print_json(summary)
        else:
            click.echo(precompile.render_summary(summary))
        return
    precompile.prepare(["probe"], show=not quiet)

    from libk3.doctor.render import render_text
    from libk3.doctor.report import DiskProbe, diagnose
    from libk3.machine.memory import probe_memory

    mem = probe_memory(None if assume_memory_gb is None else int(assume_memory_gb * 1e9))
    diag = diagnose(model, pack_dir, quick=quick, memory=mem,
                    disk=DiskProbe(probe_bytes=int(probe_size_mb * 1e6)), progress=not quiet,
                    read_bps=assume_read_mbps and assume_read_mbps * 1e6,
                    decode_bps=assume_decode_mbps and assume_decode_mbps * 1e6,
                    draft=draft, stripes=stripes)
    if json_out:
        print_json(diag.report)
    else:
        click.echo(render_text(diag.report), nl=False)
    sys.exit(diag.exit_status)
