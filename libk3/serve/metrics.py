"""``GET /metrics``: the server's figures in Prometheus' text format.

Owns: naming and typing the figures (prometheus_client, the serve extra) and reading
them at each scrape from where they are kept (the worker's counters and totals, the
core's, the weights' bytes read, the turn cache's, the access log's histograms and
responses by status class). Does not own: counting anything
(a scrape reads the figures ``/health`` reports, so the two never disagree) or HTTP.
"""

from __future__ import annotations


class _Collector:
    """A prometheus_client collector over one Server's worker and run."""

    def __init__(self, worker, run, access=None):
        self.worker, self.run, self.access = worker, run, access

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
             w.core.stats.passes)]
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
        if self.access is not None:
            yield from _request_figures(self.access)


def _request_figures(access):
    """The access log's histograms and the responses by status class (``access``)."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
    for name, text, h in (
            ("k3_time_to_first_token_seconds", "Seconds from a request's arrival to its "
                                               "first generated token", access.ttft),
            ("k3_time_per_output_token_seconds", "Seconds per generated token after the "
                                                 "first, per request", access.tpot),
            ("k3_request_duration_seconds", "Seconds from a request's arrival to the end "
                                            "of its answer", access.duration)):
        yield HistogramMetricFamily(name, text, buckets=h.cumulative(), sum_value=h.total)
    responses = CounterMetricFamily("k3_http_responses", "HTTP responses, by status class",
                                    labels=["status_class"])
    for cls, n in access.by_class.items():
        responses.add_metric([cls], n)
    yield responses


def exposition(worker, run, access=None) -> tuple:
    """(body bytes, content type) of one scrape (with ``access``: the request figures)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(worker, run, access))
    return generate_latest(registry), CONTENT_TYPE_LATEST
