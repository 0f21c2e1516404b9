"""k3-pack: convert a K3 checkpoint into a pack (trunk file + expert index); also makes
synthetic checkpoints (``synth``) and verifies packs (``verify``).

Thin click front end: options are parsed here, the work is in libk3.
"""

from __future__ import annotations

import click

from libk3 import __version__
from k3cli.group import DefaultGroup, Finite, Rule, quiet_option, threads_option
from k3cli.support import handle_errors, print_json
from libk3.engine.settings import seed_problem
from libk3.units import size_text, size_texts


@click.group(cls=DefaultGroup, default="pack",
             help="Pack a K3 checkpoint: `k3-pack CHECKPOINT OUT`. "
                  "Subcommands: synth (make a synthetic checkpoint), verify (check a pack), "
                  "compress (compress a pack's trunk).")
@click.version_option(__version__, prog_name="k3-pack")
def main():
    pass


@main.command("synth")
@click.option("--preset", type=click.Choice(["tiny", "small", "medium", "real-dims", "real-sparse"]),
              default="tiny", show_default=True, help="Size of the synthetic model.")
@click.option("--seed", type=Rule(click.INT, seed_problem, "integer"), default=0,
              show_default=True, help="0 .. 2^64 - 1.")
@click.option("--draft", is_flag=True,
              help="Also write the model's synthetic DSpark draft into OUT/draft.")
@click.option("--json", "json_out", is_flag=True, help="Print a JSON summary.")
@quiet_option
@click.argument("out", type=click.Path(file_okay=False))
@handle_errors
def synth(out, preset, seed, draft, json_out, quiet):
    """Write a synthetic K3 checkpoint in the released layout into OUT (with --draft, and
    its draft in OUT/draft)."""
    from libk3.synth.checkpoint import synth_checkpoint, summary
    from libk3.synth.draft import DRAFT_DIR, draft_summary

    path = synth_checkpoint(out, preset=preset, seed=seed, progress=not quiet, draft=draft)
    info = summary(path)
    info["draft"] = draft_summary(path / DRAFT_DIR) if draft else None
    if json_out:
        print_json(info)
        return
    apparent, disk = size_texts(info["apparent_bytes"], info["disk_bytes"])
    click.echo(f"wrote {info['shards']} shards, {info['tensors']} tensors, {apparent} "
               f"apparent, {disk} on disk to {path}")
    if draft:
        d = info["draft"]
        apparent, disk = size_texts(d["apparent_bytes"], d["disk_bytes"])
        click.echo(f"wrote a draft of {d['tensors']} tensors tapping layers "
                   f"{d['target_layer_ids']}, {apparent} apparent, {disk} on disk to "
                   f"{d['path']}")


@main.command("pack")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--dry-run", is_flag=True, help="Print the plan (sizes, disk needed, free) only.")
@click.option("--throttle-mbps", type=Finite(min=0, min_open=True),
              help="Cap the copy rate (MB/s) to leave the disk to other work.")
@click.option("--source-probe/--no-source-probe", default=None,
              help="Time the source disk's sequential read (1 s, on expert bytes the pack "
                   "never reads) to report the pack's MB/s against it. Default: on when "
                   "at least 1 GB is to be copied.")
@click.option("--allow-nonfinite", is_flag=True,
              help="Pack trunk tensors holding NaN or Inf (with a warning) instead of "
                   "refusing them (exit 3).")
@click.option("--compress-trunk", is_flag=True,
              help="Then compress the trunk losslessly (as `k3-pack compress OUT`); see "
                   "`k3-doctor` for whether it pays on this machine.")
@click.option("--json", "json_out", is_flag=True, help="Print the summary as JSON.")
@quiet_option
@threads_option
@handle_errors
def pack_cmd(checkpoint, out, dry_run, throttle_mbps, source_probe, allow_nonfinite,
             compress_trunk, json_out, quiet, threads):
    """Pack CHECKPOINT into OUT (trunk.bin, trunk.json, experts.idx). Resumable."""
    import shutil
    from pathlib import Path

    from libk3.io.checkpoint import Checkpoint
    from libk3.pack.writer import (PROBE_MIN_BYTES, disk_needed, pack, pack_state, plan_pack,
                                   source_read_rate)

    with Checkpoint.open(checkpoint) as ckpt:
        if dry_run:
            plans = plan_pack(ckpt)
            probe = Path(out)
            while not probe.exists():
                probe = probe.parent
            info = {"checkpoint": checkpoint, "out": out, "layers": len(plans),
                    "trunk_bytes": disk_needed(plans), "disk_free": shutil.disk_usage(probe).free,
                    "state": pack_state(out, ckpt)}
            if json_out:
                print_json(info)
            else:
                need, free = size_texts(info["trunk_bytes"], info["disk_free"])
                click.echo(f"{info['layers']} layers, trunk {need} needed, {free} free at "
                           f"{probe}; pack is {info['state']}")
            return
        if source_probe is None:
            source_probe = (pack_state(out, ckpt) != "complete"
                            and sum(p.nbytes for p in plan_pack(ckpt)) >= PROBE_MIN_BYTES)
        src_bps = source_read_rate(ckpt) if source_probe else None
        res = pack(ckpt, out, progress=not quiet, throttle_mbps=throttle_mbps,
                   allow_nonfinite=allow_nonfinite)
    comp = _compress(out, quiet) if compress_trunk else None
    of_src = res.mb_per_s * 1e6 / src_bps if src_bps and res.bytes_written else None
    info = {"out": res.out, "layers": res.layers_total, "packed": res.layers_packed,
            "resumed": res.layers_resumed, "bytes_written": res.bytes_written,
            "seconds": round(res.seconds, 3), "mb_per_s": round(res.mb_per_s, 1),
            "source_seq_read_mb_per_s": round(src_bps / 1e6, 1) if src_bps else None,
            "of_source_read": round(of_src, 3) if of_src else None,
            "already_complete": res.already_complete, "nonfinite_tensors": res.nonfinite}
    if comp is not None:
        info["compress"] = comp
    _warn_nonfinite(res.nonfinite)
    if json_out:
        print_json(info)
        return
    if comp is not None:
        _echo_compress(comp)
    if res.already_complete:
        click.echo(f"{out}: pack already complete for this checkpoint; nothing to do")
    else:
        click.echo(f"packed {res.layers_packed} layers ({res.layers_resumed} verified from an "
                   f"earlier run), {size_text(res.bytes_written)} in {res.seconds:.2f} s "
                   f"= {res.mb_per_s:.0f} MB/s"
                   + (f" = {of_src:.0%} of the source disk's sequential read "
                      f"({src_bps / 1e6:.0f} MB/s, timed just before)" if of_src else ""))


@main.command("compress")
@click.argument("pack_dir", metavar="PACK", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "json_out", is_flag=True, help="Print the summary as JSON.")
@quiet_option
@threads_option
@handle_errors
def compress_cmd(pack_dir, json_out, quiet, threads):
    """Compress PACK's trunk losslessly (trunk.bin -> trunk.kz; format v3). Resumable;
    the raw trunk stays usable until the compressed one is complete."""
    info = _compress(pack_dir, quiet)
    if json_out:
        print_json(info)
    else:
        _echo_compress(info)


def _compress(pack_dir, quiet: bool) -> dict:
    import numba

    from libk3.pack.compress import compress

    res = compress(pack_dir, threads=numba.get_num_threads(), progress=not quiet)
    return {"out": res.out, "layers": res.layers, "resumed": res.layers_resumed,
            "raw_bytes": res.raw_bytes, "stored_bytes": res.stored_bytes,
            "fraction": round(res.fraction, 4), "seconds": round(res.seconds, 3),
            "already_compressed": res.already_compressed,
            "saves_nothing": res.saves_nothing}


def _echo_compress(info: dict) -> None:
    raw, stored = size_texts(info["raw_bytes"], info["stored_bytes"])
    if info["already_compressed"]:
        click.echo(f"{info['out']}: trunk already compressed "
                   f"({info['fraction']:.1%} of raw); nothing to do")
    elif info["saves_nothing"]:
        click.echo(f"{info['out']}: compressing saves nothing (trunk {raw} raw, {stored} "
                   "compressed, plus its block index); the pack is left as it was")
    else:
        click.echo(f"compressed {info['layers']} layers ({info['resumed']} verified from an "
                   f"earlier run): {raw} -> {stored} ({info['fraction']:.1%}) in "
                   f"{info['seconds']:.2f} s")


@main.command("verify")
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.option("--against", type=click.Path(exists=True, file_okay=False),
              help="Also compare every byte with this checkpoint.")
@click.option("--allow-nonfinite", is_flag=True,
              help="Report trunk tensors holding NaN or Inf as a warning, not an error.")
@click.option("--json", "json_out", is_flag=True)
@quiet_option
@threads_option
@handle_errors
def verify_cmd(out, against, allow_nonfinite, json_out, quiet, threads):
    """Check a pack as k3-run opens it (every manifest and index field, the inventory of
    its config), then every layer's checksum and NaN/Inf; with --against, also that it
    belongs to that checkpoint, entry by entry and byte by byte."""
    from libk3.io.checkpoint import Checkpoint
    from libk3.pack.writer import verify

    if against:
        with Checkpoint.open(against) as ckpt:
            info = verify(out, ckpt, progress=not quiet, allow_nonfinite=allow_nonfinite)
    else:
        info = verify(out, None, progress=not quiet, allow_nonfinite=allow_nonfinite)
    _warn_nonfinite(info["nonfinite"])
    if json_out:
        print_json(info)
    else:
        click.echo(f"{out}: ok ({info['layers']} layers, {info['experts']} experts"
                   + (", every entry and byte match the checkpoint)" if against else
                      "; not compared with a checkpoint: add --against MODEL)"))


def _warn_nonfinite(tensors: list) -> None:
    if tensors:
        click.echo(f"warning: {len(tensors)} trunk tensor(s) hold NaN or Inf, e.g. "
                   f"{tensors[0]} (accepted: --allow-nonfinite)", err=True)
