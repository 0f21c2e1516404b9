"""k3-doctor's report as text: what the tool prints without --json, section by section.

Owns: ``render_text`` and the wording of each section (machine, storage, kernels, model,
decision, verdict). Does not own: what the report says (``report``).
"""

from __future__ import annotations

from ..units import size_text


def _gb(n) -> str:
    """A size for the text report (``libk3.units``); "?" when it is unknown."""
    return "?" if n is None else size_text(n)


def _mbs(n) -> str:
    return "-" if not n else f"{n / 1e6:,.0f} MB/s"


def render_text(report: dict) -> str:
    """The human-readable report (what k3-doctor prints without --json), section by
    section."""
    out = []
    for section in (_render_machine, _render_storage, _render_kernels, _render_model,
                    _render_decision, _render_verdict):
        section(report, out.append)
    return "\n".join(out) + "\n"


def _render_machine(report: dict, w) -> None:
    """The machine: packages, threads, CPU, load, memory."""
    m = report["machine"]
    w("== machine")
    w(f"python {m['python']} ({m['implementation']}), "
      + ", ".join(f"{k} {v or 'missing'}" for k, v in m["packages"].items()))
    thr = m["numba"]
    w(f"numba threading layer: {thr['layer']} ({thr['threads']} threads, idle threads: "
      f"{thr['wait_policy'] or 'the runtime default'}; fitted to the load as k3 runs)")
    cpu = m["cpu"]
    isa = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["isa"].items())
    w(f"cpu: {cpu['model'] or cpu['machine']}, {cpu['cores_usable']} usable cores "
      f"({cpu['allowance']['why']}); {isa}")
    load = m["load"]
    w(f"load: {', '.join(load['busy']) if load['busy'] else 'the CPUs were free'} "
      f"(sampled {load['seconds']:.1f} s; load average {load['loadavg_1m']})")
    mem = m["memory"]
    cg = _gb(mem["cgroup_limit_bytes"]) if mem["cgroup_limit_bytes"] else "none"
    w(f"memory: total {_gb(mem['total_bytes'])}, available {_gb(mem['available_bytes'])}, "
      f"cgroup limit {cg}, swap {_gb(mem['swap_total_bytes'])}"
      + (" (assumed, --assume-memory-gb)" if mem["assumed"] else ""))


def _render_storage(report: dict, w) -> None:
    """Each directory measured: filesystem, free space, read rates."""
    for s in report["storage"]:
        w(f"== storage: {s['role']} {s['directory']}")
        w(f"filesystem {s['filesystem']} at {s['mount_point']}, free {_gb(s['free_bytes'])}, "
          f"O_DIRECT {'works' if s['o_direct'] else 'no' if s['o_direct'] is False else '?'}")
        r = s.get("reads")
        if r:
            tag = " (cached: page cache may have served these)" if r["cached"] else ""
            seq = ", ".join(f"x{k} {_mbs(v)}" for k, v in r["seq_bps"].items())
            w(f"sequential 8 MiB reads on {s['measured_on']}: {seq}{tag}")
            if r["rand_bps"]:
                rnd = ", ".join(f"QD{k} {_mbs(v)}" for k, v in r["rand_bps"].items())
                w(f"random 17.5 MB reads: {rnd}; best QD{r['rand_best_depth']}{tag}")
        elif not report["quick"]:
            w("read speed: not measured")
        for n in s["notes"]:
            w(f"note: {n}")


def _render_kernels(report: dict, w) -> None:
    """The kernels' measured speed, and whether it can be trusted."""
    k = report.get("kernels")
    if k:
        w(f"== kernels ({k['source']}): BF16 {_mbs(k['bf16_bytes_per_s'])}, "
          f"MXFP4 {_mbs(k['mxfp4_bytes_per_s'])} of weights, one token at the model's "
          "matrix shapes, weights from RAM")
        if k.get("unreliable"):
            lo, hi = k["bf16_range_bytes_per_s"]
            mlo, mhi = k["mxfp4_range_bytes_per_s"]
            w(f"unreliable ({k['unreliable']}): measured twice, BF16 {_mbs(lo)} to "
              f"{_mbs(hi)}, MXFP4 {_mbs(mlo)} to {_mbs(mhi)}; the estimates use the faster")


def _render_model(report: dict, w) -> None:
    """The model: config, shards, sizes, pack."""
    ms = report.get("model")
    if ms:
        w(f"== model {ms['path']}")
        c = ms["config"]
        if c and c["ok"]:
            w(f"config ok: {c['layers']} layers ({c['layer_map']}), {c['experts']} experts, "
              f"top-{c['top_k']}")
        elif c:
            w("config: invalid (see FAIL below)")
        sh = ms.get("shards")
        if sh and "present" in sh:
            w(f"shards: {sh['present']} of {sh['expected']} present, "
              f"{_gb(sh['apparent_bytes'])} ({_gb(sh['allocated_bytes'])} allocated)"
              + ("; every shard's size matches its header" if sh["ok"] else ""))
        sz = ms.get("sizes")
        if sz:
            w(f"sizes{'' if sz['exact'] else ' (from config)'}: trunk {_gb(sz['trunk_bytes'])}, "
              f"experts {_gb(sz['experts_bytes'])} ({sz['experts_total']} x "
              f"{sz['expert_bytes']:,} B), model-level {_gb(sz['model_level_bytes'])}")
        pk = ms.get("pack")
        if pk:
            w(f"pack {pk['directory']}: {pk['state']}; trunk file "
              f"{_gb(pk['trunk_bytes_needed'])}")


def _render_decision(report: dict, w) -> None:
    """Memory to plan with, every preset's budget and estimate, the pick."""
    d = report["decision"]
    w(f"== decision (sizes of {d['sizes_of']})")
    w(f"memory to plan with: {_gb(d['memory_plannable_bytes'])} of {_gb(d['memory_usable_bytes'])}; "
      f"overhead {_gb(d['overhead_bytes'])}; smallest working budget "
      f"{_gb(d['minimum_memory_bytes'])} in all")
    w(f"batch: each sequence holds {_gb(d['sequence_bytes'])} (recurrent state + MLA cache "
      f"for {d['context_positions']} positions); 'batch' is the --batch-width auto beside "
      "each preset")
    bp = d.get("batch")
    if bp:
        w(f"for batch work: --preset {bp['preset']} --batch-width {bp['width']} (trunk read "
          f"per generated token {_gb(bp['trunk_bytes_per_token'])}, the fewest)")
    w(f"{'preset':<12}{'trunk':>11}{'cache':>11}{'peak':>11}{'fits':>6}{'s/token':>10}"
      f"{'pinned':>8}{'batch':>7}")
    for name, row in d["presets"].items():
        b = row["budget"]
        est = row["estimate"]
        if b is None:
            w(f"{name:<12}{'-':>11}{'-':>11}{'-':>11}{'no':>6}{'-':>10}")
            continue
        spt = f"{est['seconds_per_token']:.2f}" if est else "-"
        pinned = str(est["pinned_layers"]) if est else "-"
        width = str(row["batch_width"]) if row["batch_width"] else "-"
        w(f"{name:<12}{_gb(b['trunk_bytes']):>11}{_gb(b['cache_bytes']):>11}"
          f"{_gb(row['peak_bytes']):>11}{'yes' if not row['problems'] else 'no':>6}"
          f"{spt:>10}{pinned:>8}{width:>7}")
    if not any(r["estimate"] for r in d["presets"].values()):
        w("s/token: not estimated" + (" (--quick)" if report["quick"] else
                                      " (read speed or kernels not measured)"))
    else:
        w("s/token is a rough upper estimate: uniform routing, I/O and compute not overlapped")
    if d["pick"]:
        w(f"pick: {d['why']}")
    dr = d.get("drafting")
    if dr and dr.get("ok"):
        w(f"draft {dr['path']}: {_gb(dr['bytes'])} resident, counted in every peak above "
          f"(where that does not fit, k3-run streams its matrices and holds "
          f"{_gb(dr['streamed_bytes'])})")
        if dr.get("advice"):
            w(f"  {dr['advice']['why']} at {d['pick']}")
    pl = d.get("placement")
    if pl:
        for o in pl["options"]:
            w(f"trunk over {' + '.join(o['trunk_dirs'])}: {o['seconds_per_token']:.2f} s/token "
              f"(busiest drive {o['io_s']:.2f} s of reads)")
        w(f"placement: the trunk over {' + '.join(pl['pick']['trunk_dirs'])} at {d['pick']}")
    c = d.get("compression") or {}
    if c.get("recommend") is not None:
        w(f"compressed trunk (k3-pack compress): {c['why']}; expected "
          f"{c['seconds_per_token_compressed']:.2f} s/token compressed vs "
          f"{c['seconds_per_token_raw']:.2f} raw at {d['pick']}")


def _render_verdict(report: dict, w) -> None:
    """Disk for the pack, warnings, failures, the verdict and what to run next."""
    dk = report.get("disk_for_pack")
    if dk:
        w(f"disk for the pack: {_gb(dk['still_to_write_bytes'])} to write, "
          f"{_gb(dk['free_bytes'])} free")
    for x in report["warnings"]:
        w(f"warning: {x}")
    for x in report["problems"]:
        w(f"FAIL: {x}")
    w("== verdict: " + ("this machine can run the model" if report["can_run"]
                        else "cannot run, see FAIL lines"))
    w(f"next: {report['next_step']}")
    for c in report["next_commands"]:
        w(f"  {c}")

