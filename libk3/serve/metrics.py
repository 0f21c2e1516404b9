"""``GET /metrics``: the server's figures in Prometheus' text format.

Owns: naming and typing the figures (prometheus_client, the serve extra) and reading
them at each scrape from where they are kept (the worker's counters and totals, the
lockstep's, the weights' bytes read, the turn cache's). Does not own: counting anything
(a scrape reads the figures ``/health`` reports, so the two never disagree) or HTTP.
"""

from __future__ import annotations


class _Collector:
    """A prometheus_client collector over one Server's worker and run."""

    def __init__(self, worker, run):
        self.worker, self.run = worker, run

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        w = self.worker
        requests = CounterMetricFamily("k3_requests", "Requests finished, by outcome",
                                       labels=["outcome"])
        for outcome in ("served", "cancelled", "failed"):
            requests.add_metric([outcome], w.counts[outcome])
        yield requests
        counters = [
            ("k3_generated_tokens", "Tokens generated", w.counts["generated_tokens"]),
            ("k3_prompt_tokens", "Prompt tokens of served requests", w.totals["prompt_tokens"]),
            ("k3_reused_prompt_tokens", "Prompt tokens resumed from a kept state, not "
                                        "prefilled", w.totals["reused_tokens"]),
            ("k3_prefill_seconds", "Seconds served requests spent prefilling",
             w.totals["prefill_seconds"]),
            ("k3_decode_seconds", "Seconds served requests spent decoding",
             w.totals["decode_seconds"]),
            ("k3_passes", "Forward passes (each reads the trunk once for every lane)",
             w.lockstep.stats.passes)]
        stats = self.run.session.weights.stats()
        for part in ("trunk", "experts"):
            counters.append((f"k3_{part}_read_bytes", f"Bytes of {part} read from disk",
                             stats.get(part, {}).get("bytes_read", 0)))
        for name, text, value in counters:
            yield CounterMetricFamily(name, text, value=value)
        gauges = [("k3_queue_depth", "Requests waiting for a lane", w.queued()),
                  ("k3_lanes_in_flight", "Requests decoding now", len(w.jobs)),
                  ("k3_lanes", "Lanes: requests decoded together at most", w.width)]
        for name, text, value in gauges:
            yield GaugeMetricFamily(name, text, value=value)


def exposition(worker, run) -> tuple:
    """(body bytes, content type) of one scrape."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(worker, run))
    return generate_latest(registry), CONTENT_TYPE_LATEST
