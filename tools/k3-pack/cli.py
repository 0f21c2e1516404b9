"""k3-pack: convert a K3 checkpoint into a pack (trunk file + expert index); also makes
synthetic checkpoints (``synth``), verifies packs (``verify``) and lists, checks and
empties prefix cache folders (``cache ls|verify|rm``).

Thin click front end: options are parsed here, the work is in libk3.
"""

from __future__ import annotations

import sys

import click

from libk3 import __version__
from k3cli import constraints
from k3cli.group import (DefaultGroup, Finite, Group, Rule, gigabytes, quiet_option,
                         threads_option)
from k3cli.support import handle_errors, print_json
from libk3.engine.settings import seed_problem
from libk3.synth.presets import PRESETS
from libk3.units import size_text, size_texts


@click.group(cls=DefaultGroup, default="pack",
             help="Pack a K3 checkpoint: `k3-pack CHECKPOINT OUT`. "
                  "Subcommands: synth (make a synthetic checkpoint), verify (check a pack), "
                  "compress (compress a pack's trunk), cache (list, check or empty a "
                  "prefix cache folder).")
@click.version_option(__version__, prog_name="k3-pack")
def main():
    pass


@main.command("synth")
@click.option("--preset", type=click.Choice(list(PRESETS)),
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
@click.option("--stripe", "stripes", multiple=True, type=click.Path(file_okay=False),
              help="Lay the trunk over OUT and this directory (repeat: one per drive; "
                   "fixed-size stripes, formats/pack.md). See docs/drives.md.")
@click.option("--json", "json_out", is_flag=True, help="Print the summary as JSON.")
@quiet_option
@threads_option
@handle_errors
def pack_cmd(checkpoint, out, dry_run, throttle_mbps, source_probe, allow_nonfinite,
             compress_trunk, stripes, json_out, quiet, threads):
    """Pack CHECKPOINT into OUT (trunk.bin, trunk.json, experts.idx; with --stripe, the
    trunk over OUT and each stripe directory). Resumable."""
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
                   allow_nonfinite=allow_nonfinite, stripe_dirs=stripes)
    comp = _compress(out, quiet) if compress_trunk else None
    of_src = res.mb_per_s * 1e6 / src_bps if src_bps and res.bytes_written else None
    info = {"out": res.out, "layers": res.layers_total, "packed": res.layers_packed,
            "resumed": res.layers_resumed, "bytes_written": res.bytes_written,
            "seconds": round(res.seconds, 3), "mb_per_s": round(res.mb_per_s, 1),
            "source_seq_read_mb_per_s": round(src_bps / 1e6, 1) if src_bps else None,
            "of_source_read": float(f"{of_src:.3g}") if of_src else None,  # 3 digits at any size
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
@click.option("--stripe-dir", "stripe_dirs", multiple=True, type=click.Path(file_okay=False),
              help="A striped pack's stripe directories where they are now (repeat, in order).")
@threads_option
@handle_errors
def verify_cmd(out, against, allow_nonfinite, json_out, quiet, threads, stripe_dirs):
    """Check a pack as k3-run opens it (every manifest and index field, the inventory of
    its config), then every layer's checksum and NaN/Inf; with --against, also that it
    belongs to that checkpoint, entry by entry and byte by byte."""
    from libk3.io.checkpoint import Checkpoint
    from libk3.pack.writer import verify

    if against:
        with Checkpoint.open(against) as ckpt:
            info = verify(out, ckpt, progress=not quiet, allow_nonfinite=allow_nonfinite,
                          stripe_dirs=list(stripe_dirs) or None)
    else:
        info = verify(out, None, progress=not quiet, allow_nonfinite=allow_nonfinite,
                      stripe_dirs=list(stripe_dirs) or None)
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


@main.group("cache", cls=Group)
def cache():
    """List, check and empty a prefix cache folder (formats/prefix-cache.md): the
    snapshots `k3-run --prefix-cache DIR` keeps."""


_cache_dir = click.argument("directory", metavar="DIR",
                            type=click.Path(exists=True, file_okay=False))


@cache.command("ls")
@_cache_dir
@click.option("--json", "json_out", is_flag=True, help="Print the listing as JSON.")
@handle_errors
def cache_ls(directory, json_out):
    """List DIR's snapshots, most recently used first: name, tokens, size, last use and
    the weights each was computed with (the first 12 hex digits of their identity)."""
    from datetime import datetime

    from libk3.engine import prefix_cache as pc

    rows = [pc.describe(e) for e in reversed(pc.list_entries(directory))]
    total = sum(r["bytes"] for r in rows)
    if json_out:
        print_json({"directory": directory, "snapshots": rows, "bytes": total})
        return
    if not rows:
        click.echo(f"no snapshots in {directory}")
        return
    for r in rows:
        used = datetime.fromtimestamp(r["last_used"]).isoformat(timespec="seconds")
        weights = r["weights"][:12] if r["weights"] else "unreadable"
        click.echo(f"{r['name']}  {r['tokens']:>9,} tokens  {size_text(r['bytes']):>10}  "
                   f"{used}  {weights}")
    click.echo(f"{_snapshots(len(rows))}, {size_text(total)}")


@cache.command("verify")
@_cache_dir
@click.option("--remove-bad", is_flag=True, help="Remove the snapshots that fail.")
@click.option("--json", "json_out", is_flag=True, help="Print the result as JSON.")
@quiet_option
@handle_errors
def cache_verify(directory, remove_bad, json_out, quiet):
    """Check every snapshot in DIR, reading every byte, as far as no model is needed:
    checksum, arrays filling the file, finite values, and as many token ids as its name
    says. Exit 3 when one is bad; with --remove-bad, 0 once every bad one is removed."""
    from libk3 import progress
    from libk3.engine import prefix_cache as pc
    from libk3.errors import FormatError

    entries = pc.list_entries(directory)
    bad = []
    with progress.bar(desc="verify", total=sum(e.size for e in entries), unit="B",
                      unit_scale=True, show=not quiet) as bar:
        for e in entries:
            err = pc.check_entry(e)
            if err is not None:
                bad.append((e, err))
            bar.update(e.size)
    removed, failed = pc.remove_entries([e for e, _ in bad]) if remove_bad else ([], [])
    doc = {"directory": directory, "checked": len(entries),
           "bad": [{"name": e.path.name, "error": err.one_line()} for e, err in bad],
           "removed": [e.path.name for e in removed],
           "failed": [{"name": e.path.name, "error": why} for e, why in failed]}
    left = len(failed) if remove_bad else len(bad)
    error = None if not left else FormatError(
        f"{left} of {len(entries)} snapshots are bad", path=directory,
        hint=None if remove_bad else f"remove them: k3-pack cache verify {directory} "
                                     "--remove-bad")
    if not json_out:
        for _, err in bad:
            click.echo(err.one_line())
        for e in removed:
            click.echo(f"removed {e.path.name}")
        for e, why in failed:
            click.echo(f"cannot remove {e.path}: {why}", err=True)
        click.echo(f"{_snapshots(len(entries))} checked, {len(bad)} bad"
                   + (f", {len(removed)} removed" if remove_bad else ""))
    _end(doc, json_out, error)


# Exactly one selector says what `cache rm` removes (k3cli.constraints).
CACHE_RM_RULES = (
    constraints.OneOf(("all_", "older_than", "keep_gb", "names"),
                      text="give exactly one of --all, --older-than DAYS, --keep-gb G or "
                           "snapshot NAMEs"),
)


@cache.command("rm")
@_cache_dir
@click.argument("names", metavar="[NAME]...", nargs=-1)
@click.option("--all", "all_", is_flag=True,
              help="Every snapshot, and temporaries left by writers that are gone.")
@click.option("--older-than", type=Finite(min=0), metavar="DAYS",
              help="The snapshots last used more than DAYS days ago.")
@click.option("--keep-gb", type=gigabytes(), metavar="G",
              help="The least recently used snapshots, until the rest take at most G GB.")
@click.option("--json", "json_out", is_flag=True, help="Print the result as JSON.")
@click.pass_context
@handle_errors
def cache_rm(ctx, directory, names, all_, older_than, keep_gb, json_out):
    """Remove snapshots from DIR: --all, --older-than DAYS, --keep-gb G, or the NAMEs
    given (file names as `k3-pack cache ls` lists them). Only snapshot files are ever
    removed."""
    from libk3.engine import prefix_cache as pc
    from libk3.errors import K3IOError

    constraints.check(ctx, CACHE_RM_RULES)
    entries = pc.list_entries(directory)
    if all_:
        chosen = entries
    elif older_than is not None:
        chosen = pc.unused_for(entries, older_than * 86400)
    elif keep_gb is not None:
        chosen = pc.over_budget(entries, round(keep_gb * 1e9))
    else:
        chosen = pc.named(entries, names, directory)
    removed, failed = pc.remove_entries(chosen)
    temps = pc.remove_stale_temps(directory) if all_ else 0
    freed = sum(e.size for e in removed)
    left = pc.list_entries(directory)
    doc = {"directory": directory,
           "removed": [{"name": e.path.name, "bytes": e.size} for e in removed],
           "bytes": freed, "temporaries": temps,
           "failed": [{"name": e.path.name, "error": why} for e, why in failed],
           "left": len(left), "left_bytes": sum(e.size for e in left)}
    error = None if not failed else K3IOError(
        f"{len(failed)} snapshot(s) could not be removed", path=directory)
    if not json_out:
        for e in removed:
            click.echo(f"removed {e.path.name} ({size_text(e.size)})")
        for e, why in failed:
            click.echo(f"cannot remove {e.path}: {why}", err=True)
        click.echo(f"removed {_snapshots(len(removed))}, {size_text(freed)} freed"
                   + (f", and {temps} stale temporar{'y' if temps == 1 else 'ies'}"
                      if temps else "")
                   + f"; {len(left)} left, {size_text(doc['left_bytes'])}")
    _end(doc, json_out, error)


def _snapshots(n: int) -> str:
    return f"{n} snapshot{'' if n == 1 else 's'}"


def _end(doc: dict, json_out: bool, error) -> None:
    """Print ``doc`` with --json, then end with ``error`` (its line, its exit code) when
    there is one. The text report is printed by the command before."""
    if json_out:
        print_json(doc)
        if error is not None:              # not raised: handle_errors would print a 2nd doc
            click.echo(f"k3-pack: error: {error.one_line()}", err=True)
            sys.exit(error.exit_code)
    elif error is not None:
        raise error
