"""k3-trace: import, inspect and replay expert-routing traces (formats/trace.md).

Thin click front end: options are parsed here, the work is in libk3 (``libk3.trace.format``,
``libk3.trace.report``, ``libk3.trace.replay``, ``libk3.trace.sizing``). Subcommands are
registered one per function on the ``main`` group; ``--help`` lists them from there, so
the help text names none by hand.
"""

from __future__ import annotations

import os

import click

from libk3 import __version__
from k3cli import constraints
from k3cli.group import Finite, Group, NumberList, gigabytes, quiet_option
from k3cli.support import handle_errors, print_json
from libk3.config import MAX_EXPERTS, MAX_LAYERS
from libk3.errors import UsageError
from libk3.trace.format import MAX_EXPERT_BYTES
from libk3.policies.registry import DEFAULT_POLICY, ONLINE_OBJECT_POLICIES

# The real model's shape: defaults for importing C-engine traces, which carry no header.
from libk3.k3_dims import EXPERT_BYTES as REAL_EXPERT_BYTES  # noqa: E402
from libk3.k3_dims import N_EXPERTS as REAL_N_EXPERTS  # noqa: E402
from libk3.k3_dims import N_LAYERS as REAL_N_LAYERS  # noqa: E402
from libk3.k3_dims import TOP_K as REAL_TOP_K  # noqa: E402


def _jobs(jobs):
    """--jobs, else up to 2 replays at once, never more than the CPUs this process may use."""
    if jobs is not None:
        return jobs
    from libk3.machine.cpus import allowance
    return min(2, allowance().count)


@click.group(cls=Group, help="Record, import, inspect and replay expert-routing traces, "
                              "and size a memory budget from one.")
@click.version_option(__version__, prog_name="k3-trace")
def main():
    pass


@main.command("import")
@click.argument("raw", type=click.Path(exists=True, dir_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--n-layers", type=click.IntRange(1, MAX_LAYERS), default=REAL_N_LAYERS,
              show_default=True)
@click.option("--n-experts", type=click.IntRange(1, MAX_EXPERTS), default=REAL_N_EXPERTS,
              show_default=True)
@click.option("--top-k", type=click.IntRange(1, MAX_EXPERTS), default=REAL_TOP_K,
              show_default=True, help="At most --n-experts.")
@click.option("--expert-bytes", type=click.IntRange(1, MAX_EXPERT_BYTES),
              default=REAL_EXPERT_BYTES, show_default=True)
@click.option("--json", "json_out", is_flag=True, help="Print a JSON summary.")
@handle_errors
def import_cmd(raw, out, n_layers, n_experts, top_k, expert_bytes, json_out):
    """Convert the public C engine's expert_trace.bin (headerless int32 layer, expert
    pairs) into a k3 trace OUT. Token positions are unknown there and recorded as such."""
    from libk3.trace.raw_import import import_raw_c_trace

    if top_k > n_experts:
        raise UsageError(f"--top-k {top_k} exceeds --n-experts {n_experts}")
    info = import_raw_c_trace(raw, out, n_layers=n_layers, n_experts=n_experts,
                              expert_bytes=expert_bytes, top_k=top_k,
                              created_by=f"k3-trace {__version__} import")
    if json_out:
        print_json(info)
    else:
        click.echo(f"wrote {info['requests']:,} requests in {info['frames']} frames to "
                   f"{info['path']}")


@main.command("stats")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("--tolerate-truncated", is_flag=True,
              help="Use the intact frames of a trace whose last frame is damaged.")
@click.option("--json", "json_out", is_flag=True, help="Print JSON.")
@handle_errors
def stats(trace, tolerate_truncated, json_out):
    """Requests, tokens, distinct experts, reuse, hottest experts, per-layer spread and
    the compulsory-miss ceiling of TRACE."""
    from libk3.trace.format import TraceReader
    from libk3.trace.report import format_stats, trace_stats

    s = trace_stats(TraceReader(trace, tolerate_truncated_tail=tolerate_truncated))
    _emit(s, json_out, format_stats)


@main.command("replay")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("--capacity-gb", type=NumberList(gigabytes(positive=True)),
              help="Comma-separated cache sizes in GB (10^9 bytes). Default (neither this "
                   "nor --slots): 1/64, 1/32, ... 1/2 and all of the distinct experts the "
                   "trace touches.")
@click.option("--slots", type=NumberList(click.IntRange(1)),
              help="Comma-separated cache sizes in slots (with --capacity-gb: both).")
@click.option("--expert-bytes", type=click.IntRange(1, MAX_EXPERT_BYTES),
              help="Override the trace's expert size.")
@click.option("--policy", "policy", help="Comma-separated policies (default: all).")
@click.option("--jobs", type=click.IntRange(1, 64),
              help="Replays run in parallel (default: up to 2).")
@click.option("--tolerate-truncated", is_flag=True,
              help="Use the intact frames of a trace whose last frame is damaged.")
@click.option("--plot", type=click.Path(dir_okay=False),
              help="Also write a hit-rate-versus-capacity chart, its format from the "
                   "name (.png, .svg, .pdf; needs pip install 'k3[plot]').")
@click.option("--json", "json_out", is_flag=True, help="Print JSON.")
@quiet_option
@handle_errors
def replay(trace, capacity_gb, slots, expert_bytes, policy, jobs, tolerate_truncated, plot,
           json_out, quiet):
    """Hit rate and bytes read per token of each cache policy at each capacity, replaying
    TRACE offline (routing does not depend on the cache)."""
    from libk3.engine.precompile import prepare
    from libk3.policies.registry import POLICIES, check_policy_names
    from libk3.trace.format import TraceReader
    from libk3.trace.report import (format_replay, plot_replay, replay_report,
                                    require_matplotlib)

    if plot:
        require_matplotlib()
    policies = (check_policy_names(p.strip() for p in policy.split(","))
                if policy else list(POLICIES))
    reader = TraceReader(trace, tolerate_truncated_tail=tolerate_truncated)
    reader.require_replayable()           # a hostile header is refused before compiling
    prepare(["replay"], show=not quiet)
    rep = replay_report(reader, policies=policies, capacities_gb=capacity_gb,
                        slots=slots, expert_bytes=expert_bytes,
                        workers=_jobs(jobs))
    if plot:
        plot_replay(rep, plot)
    _emit(rep, json_out, format_replay)


@main.command("record", context_settings={"ignore_unknown_options": True})
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False))
@click.option("--batch", type=click.Path(exists=True, dir_okay=False))
@click.argument("run_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
@handle_errors
def record(ctx, model, out, prompt_file, batch, run_args):
    """Run MODEL exactly as k3-run does and record every expert request to OUT.

    A thin wrapper over `k3-run --trace OUT` (one recording path): any further k3-run
    option (--pack, --preset, --trunk-gb, --cache-gb, --gen, --threads, --quiet, ...) is
    passed through.
    k3-run is started as this interpreter's `-m k3_run`, never looked up on PATH, so the
    recording always runs the k3 installed beside this k3-trace."""
    import subprocess
    import sys
    import tempfile

    constraints.check(ctx, (constraints.OneOf(("prompt_file", "batch")),))
    args = [sys.executable, "-m", "k3_run", model, "--trace", out, *run_args]
    with tempfile.TemporaryDirectory() as tmp:      # batch results are not kept
        if prompt_file:
            args += ["--prompt-file", prompt_file]
        else:
            args += ["--batch", batch, "--out", os.path.join(tmp, "results.jsonl")]
        code = subprocess.run(args, stdout=sys.stderr).returncode
    if code:
        sys.exit(code)
    click.echo(f"recorded {out}", err=True)


@main.command("predict")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("--slots", type=click.IntRange(1), required=True,
              help="The cache's slots (k3-run's cache_slots plus prefetch_slots).")
@click.option("--prefetch", type=click.IntRange(0), required=True,
              help="Experts read ahead per layer (k3-run --prefetch-experts).")
@click.option("--policy", default=DEFAULT_POLICY, show_default=True,
              type=click.Choice(ONLINE_OBJECT_POLICIES))
@click.option("--json", "json_out", is_flag=True)
@handle_errors
def predict(trace, slots, prefetch, policy, json_out):
    """Price expert prediction on TRACE (recorded with predictions): hit rate, bytes
    wasted and bytes taken off the wait path, without it, with it, and with the unused
    guesses kept in the cache."""
    from libk3.trace.format import TraceReader
    from libk3.trace.prediction import format_prediction, price_prediction

    rep = price_prediction(TraceReader(trace), slots, policy=policy, cap=prefetch)
    _emit(rep, json_out, format_prediction)


@main.command("size")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("--budget-gb", type=gigabytes(positive=True), required=True,
              help="Total memory for trunk + expert cache (GB = 10^9 bytes).")
@click.option("--pack", "pack_dir", type=click.Path(exists=True, file_okay=False), required=True,
              help="The pack (its trunk.json gives every layer's size).")
@click.option("--seq-mbps", type=Finite(min=0, min_open=True),
              help="Sequential read speed (trunk), MB/s.")
@click.option("--rand-mbps", type=Finite(min=0, min_open=True),
              help="Random read speed of one expert at the best queue depth, MB/s.")
@click.option("--doctor-json", type=click.Path(exists=True, dir_okay=False),
              help="Take the disk speeds from `k3-doctor --json` output.")
@click.option("--policy", default=DEFAULT_POLICY, show_default=True,
              help="The cache policy whose replayed misses size the split.")
@click.option("--steps", type=click.IntRange(2, 64), default=12, show_default=True)
@click.option("--prefetch", type=click.IntRange(0, 4096), default=0, show_default=True,
              help="Also price reading this many predicted experts ahead per layer (k3-run "
                   "--prefetch-experts; a trace recorded with predictions).")
@click.option("--json", "json_out", is_flag=True)
@quiet_option
@handle_errors
def size(trace, budget_gb, pack_dir, seq_mbps, rand_mbps, doctor_json, policy, steps, prefetch,
         json_out, quiet):
    """Recommend the trunk/cache split of a total budget, from the pack's layer sizes, the
    trace's replayed miss curve and the disk's speeds, with predicted s/token per split."""
    from libk3.trace.sizing import disk_speeds_from_doctor, format_sizing, size_budget

    if doctor_json:
        seq_d, rand_d = disk_speeds_from_doctor(doctor_json)
        seq_mbps = seq_mbps or seq_d
        rand_mbps = rand_mbps or rand_d
    if not seq_mbps or not rand_mbps:
        raise UsageError("give --seq-mbps and --rand-mbps, or --doctor-json from k3-doctor --json")
    from libk3.engine.precompile import prepare
    from libk3.trace.format import TraceReader
    TraceReader(trace).require_replayable()   # a hostile header is refused before compiling
    prepare(["replay"], show=not quiet)
    rep = size_budget(trace, pack_dir, budget_gb * 1e9, seq_mbps * 1e6, rand_mbps * 1e6,
                      policy=policy, steps=steps, prefetch=prefetch)
    _emit(rep, json_out, format_sizing)



def _emit(report: dict, json_out: bool, fmt) -> None:
    """The report as JSON or as ``fmt``'s text; a tolerated truncated tail is warned on
    stderr either way."""
    if json_out:
        print_json(report)
    else:
        click.echo(fmt(report))
    if report.get("truncated_tail"):
        click.echo(f"k3-trace: warning: {report['truncated_tail']}", err=True)

if __name__ == "__main__":
    main()
