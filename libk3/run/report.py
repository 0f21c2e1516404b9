"""The run report: what a run read, how long it took, how much memory it used.

Owns: assembling the report dict (for ``--report-json`` and ``--json``) and its short
human form. Does not own: measuring (the weight providers keep their own counters).
"""

from __future__ import annotations

import os
import resource
import sys
import time


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: VmHWM from /proc/self/status on Linux,
    getrusage elsewhere. Why not getrusage on Linux: its ru_maxrss survives exec, so a
    k3-run started by a large parent (a Python script holding a model, a batch driver)
    would report the parent's peak (tests/test_run_cli.py runs one under a big parent)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def process_start_time():
    """When this process started, on the ``time.time()`` clock (Linux: /proc, in clock ticks);
    None where /proc is absent."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")    # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - started)


def startup_seconds(first_layer_time):
    """Seconds from process start to the first layer of the first forward (None when
    either is unknown): imports, opening the model, budgets, compiling, first reads."""
    start = process_start_time()
    if start is None or first_layer_time is None:
        return None
    return round(first_layer_time - start, 3)


def run_report(result, weights_stats: dict, budget=None, extra: dict | None = None) -> dict:
    trunk = weights_stats.get("trunk", {})
    experts = weights_stats.get("experts", {})
    req = experts.get("requests", 0)
    rep = {
        "prompt_ids": result.prompt_ids,
        "generated_ids": result.generated_ids,
        "stop_reason": result.stop_reason,
        "prefill_seconds": round(result.prefill_seconds, 6),
        "reused_tokens": result.reused_tokens,
        "prefill_tokens_per_second": _rate(len(result.prompt_ids) - result.reused_tokens,
                                           result.prefill_seconds),
        "decode_seconds": round(result.decode_seconds, 6),
        "seconds_per_token": round(result.seconds_per_token, 6),
        "trunk_bytes_read": trunk.get("bytes_read", 0),
        "trunk_read_seconds": round(trunk.get("read_seconds", 0.0), 6),
        "trunk_wait_seconds": round(trunk.get("wait_seconds", 0.0), 6),
        "pinned_layers": trunk.get("pinned_layers"),
        "ring_slots": trunk.get("ring_slots"),
        "trunk_crc_checks": trunk.get("crc_checks", 0),
        "trunk_crc_seconds": round(trunk.get("crc_seconds", 0.0), 6),
        "trunk_bytes_decoded": trunk.get("bytes_decoded", 0),
        "trunk_decode_seconds": round(trunk.get("decode_seconds", 0.0), 6),
        "expert_bytes_read": experts.get("bytes_read", 0),
        "expert_read_seconds": round(experts.get("read_seconds", 0.0), 6),
        "expert_requests": req,
        "cache_hit_rate": round(experts.get("hits", 0) / req, 6) if req else None,
        "cache_slots": experts.get("slots"),
        "cache_policy": experts.get("policy"),
        "reads_in_flight": experts.get("max_in_flight"),
        "expert_wait_seconds": round(experts.get("wait_seconds", 0.0), 6),
        **prefetch_report(experts),
        "peak_rss_bytes": peak_rss_bytes(),
        "drives": weights_stats.get("drives"),   # per read queue: depth, bytes, throttle waits
    }
    n = len(result.generated_ids)
    rep["bytes_read_per_token"] = (round((rep["trunk_bytes_read"] + rep["expert_bytes_read"])
                                         / n) if n else None)
    if budget is not None:
        rep["budget"] = budget.to_json()
    if extra:
        rep.update(extra)
    return rep


def prefetch_report(experts: dict) -> dict:
    """The read-ahead's figures (libk3.stream.experts): staging slots, predictions made,
    experts predicted, hits (predicted, then routed by the same layer), their rate, reads
    started, reads the router then used, unstarted reads cancelled and bytes wasted."""
    pred = experts.get("prefetch_predicted", 0)
    return {"prefetch_slots": experts.get("prefetch_slots", 0),
            "prefetch_predictions": experts.get("prefetch_predictions", 0),
            "prefetch_predicted": pred,
            "prefetch_hits": experts.get("prefetch_hits", 0),
            "prefetch_hit_rate": (round(experts.get("prefetch_hits", 0) / pred, 6)
                                  if pred else None),
            "prefetch_reads": experts.get("prefetch_reads", 0),
            "prefetch_used": experts.get("prefetch_used", 0),
            "prefetch_cancelled": experts.get("prefetch_cancelled", 0),
            "prefetch_bytes_wasted": experts.get("prefetch_bytes_wasted", 0)}


def _rate(n: int, seconds: float):
    return round(n / seconds, 6) if n and seconds > 0 else None


def short_text(rep: dict) -> str:
    n = len(rep["generated_ids"])
    times = f"prefill {rep['prefill_seconds']:.2f} s"
    if rep.get("prefill_tokens_per_second"):
        times += f" at {rep['prefill_tokens_per_second']:.1f} tokens/s"
    if rep.get("reused_tokens"):
        times += f", {rep['reused_tokens']} prompt tokens resumed from a snapshot"
    if rep.get("startup_seconds") is not None:
        compiling = rep.get("compile_seconds")
        times = (f"start-up {rep['startup_seconds']:.2f} s"
                 + (f" incl. compiling {compiling:.1f} s" if compiling else "") + ", " + times)
    parts = [f"{n} tokens, {rep['seconds_per_token']:.3f} s/token ({times})"]
    if rep.get("cache_hit_rate") is not None:
        parts.append(f"cache hit {100 * rep['cache_hit_rate']:.1f}%")
    parts.append(f"read trunk {rep['trunk_bytes_read'] / 1e6:.1f} MB"
                 + (f" (decoded to {rep['trunk_bytes_decoded'] / 1e6:.1f} MB in "
                    f"{rep['trunk_decode_seconds']:.2f} s)" if rep.get("trunk_bytes_decoded")
                    else "")
                 + f", experts {rep['expert_bytes_read'] / 1e6:.1f} MB")
    if rep.get("cache_slots") is not None:
        ahead = (f"; prefetch: {rep['prefetch_hits']} of {rep['prefetch_predicted']} predicted "
                 f"experts routed ({100 * rep['prefetch_hit_rate']:.1f}%), "
                 f"{rep['prefetch_used']} reads used, "
                 f"{rep['prefetch_bytes_wasted'] / 1e6:.1f} MB wasted"
                 if rep.get("prefetch_predicted") else "")
        parts.append(f"expert wait {rep['expert_wait_seconds']:.3f} s" + ahead)
    spec = rep.get("speculative")
    if spec and spec.get("passes"):
        parts.append(f"drafting: {spec['tokens_per_pass']:.2f} tokens per pass over "
                     f"{spec['passes']} passes, {spec['accepted']} of {spec['drafted']} "
                     f"proposals kept, draft {spec['draft_seconds']:.2f} s")
    if rep.get("bytes_read_per_token") is not None:
        parts.append(f"{rep['bytes_read_per_token'] / 1e6:.1f} MB read per generated token")
    parts.append(f"peak RSS {rep['peak_rss_bytes'] / 1e9:.2f} GB")
    return "; ".join(parts)


def batch_text(summary: dict) -> str:
    """The aggregate line of a batch run (``BatchSink.close``'s figures)."""
    union = summary.get("expert_union_per_layer") or {}
    mean_union = sum(union.values()) / len(union) if union else None
    tps = summary.get("tokens_per_second")
    parts = [f"width {summary['width']}: {summary['generated_tokens']} tokens in "
             f"{summary['seconds']:.1f} s" + (f" = {tps:.3f} tokens/s" if tps else "")]
    if summary.get("trunk_bytes_per_token") is not None:
        parts.append(f"read per token: trunk {summary['trunk_bytes_per_token'] / 1e6:.1f} MB, "
                     f"experts {summary['expert_bytes_per_token'] / 1e6:.1f} MB")
    if mean_union is not None:
        parts.append(f"experts per MoE layer per pass {mean_union:.1f}")
    pre = summary.get("prefixes") or {}
    if pre.get("prompts_resumed"):
        cache = pre.get("cache")
        parts.append(f"shared prefixes: {pre['prompts_resumed']} prompts resumed "
                     f"({pre['tokens_reused']} tokens not prefilled; "
                     f"{pre['prefix_tokens_built']} prefilled once"
                     + (f", {cache['hits']} snapshots read from the prefix cache"
                        if cache else "") + ")")
    return "; ".join(parts)
