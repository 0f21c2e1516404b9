"""The server's access log and request figures (docs/serve.md "Logs and metrics"): one
line per request, text or JSON, and the /metrics histograms and status-class counters
read by a Prometheus parser; skipped without the serve extra."""

from __future__ import annotations

import datetime
import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("aiohttp")
parser = pytest.importorskip("prometheus_client.parser")

from libk3.serve.access import Access, Usage  # noqa: E402

from .test_serve import KEY, _post, _start, _stop  # noqa: E402

CHAT = json.dumps({"model": "tiny", "max_tokens": 4,
                   "messages": [{"role": "user", "content": "Hi there"}]}).encode()


def _clock(times):
    it = iter(times)
    return lambda: next(it)


def test_access_line_has_every_field_and_times_from_the_request_start():
    """Catches a line missing the request id, route, status or token counts, a time to
    first token measured from anything but the request's arrival, and a time per output
    token that divides by all tokens instead of the ones after the first; control: a
    request without generation says - for them."""
    lines = []
    wall = lambda: datetime.datetime(2026, 1, 2, 3, 4, 5, 678000,  # noqa: E731
                                     tzinfo=datetime.timezone.utc)
    a = Access(lines.append, clock=_clock([12.5, 13.0]), wall=wall)
    f = a.finished("req_1", "POST", "/v1/chat/completions", 200, 10.0,
                   Usage(prompt_tokens=7, generated_tokens=5, first_token=10.5, last_token=12.5))
    assert lines[0] == ("2026-01-02T03:04:05.678Z req_1 POST /v1/chat/completions 200 "
                        "prompt=7 generated=5 ttft=0.500s total=2.500s")
    assert f["ttft_seconds"] == 0.5 and a.tpot.total == pytest.approx(0.5)
    a.finished("req_2", "GET", "/health", 200, 12.9)
    assert lines[1].endswith("GET /health 200 prompt=- generated=- ttft=- total=0.100s")
    assert a.ttft.n == 1 and a.duration.n == 2 and a.by_class["2xx"] == 2


def test_access_json_lines_and_an_unprintable_route_stay_one_line():
    """Catches JSON output that is not one object per line, and a route holding a
    newline (a hostile path) splitting the log line."""
    lines = []
    a = Access(lines.append, json_lines=True, clock=_clock([1.0]))
    a.finished("req_9", "GET", "/x\n/injected y", 404, 0.75)
    assert len(lines) == 1 and "\n" not in lines[0]
    doc = json.loads(lines[0])
    assert doc["status"] == 404 and doc["request_id"] == "req_9"
    assert doc["route"] == "/x\\n/injected%20y" and doc["seconds"] == 0.25
    assert a.by_class == {"2xx": 0, "3xx": 0, "4xx": 1, "5xx": 0}


def test_histogram_buckets_are_cumulative_and_end_at_inf():
    """Catches per-bucket counts exposed as cumulative ones (Prometheus' le buckets
    count every value at or below) and a value above every bound lost."""
    from libk3.serve.access import Histogram
    h = Histogram((1, 2))
    for v in (0.5, 1.0, 1.5, 9.0):
        h.observe(v)
    assert h.cumulative() == [("1.0", 2), ("2.0", 3), ("+Inf", 4)] and h.total == 12.0


def _metrics(srv) -> dict:
    req = urllib.request.Request(srv["url"] + "/metrics",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read().decode()
    out = {}
    for fam in parser.text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.labels.get("status_class") or s.labels.get("le")
            out[(s.name, key) if key else s.name] = s.value
    return out


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_serve_logs_each_request_and_metrics_count_them(tiny_dir, tmp_path, fmt):
    """Catches a server that logs no access line (or one per route only), misses the
    4xx answers in the status counters, or whose histograms do not count the
    generating requests: two chats, a 400, a 401, each logged once and counted."""
    srv = _start(tiny_dir, tmp_path / "stderr.log", "--log-format", fmt)
    try:
        for _ in range(2):
            status, body = _post(srv, "/v1/chat/completions", CHAT)
            assert status == 200, body
        assert _post(srv, "/v1/chat/completions", b"{not json")[0] == 400
        assert _post(srv, "/v1/chat/completions", CHAT, key="wrong")[0] == 401
        m = _metrics(srv)
    finally:
        _stop(srv)
    log = srv["log"].read_text().splitlines()
    access = [ln for ln in log if "/v1/chat/completions" in ln and "req_" in ln]
    assert len(access) == 4, log
    if fmt == "json":
        docs = [json.loads(ln) for ln in access]
        assert [d["status"] for d in docs] == [200, 200, 400, 401]
        assert docs[0]["generated_tokens"] == 4 and docs[0]["prompt_tokens"] > 0
        assert docs[0]["ttft_seconds"] <= docs[0]["seconds"]
    else:
        assert [ln.split()[4] for ln in access] == ["200", "200", "400", "401"]
        assert "generated=4" in access[0] and "ttft=" in access[0]
    assert m["k3_time_to_first_token_seconds_count"] == 2
    assert m["k3_time_per_output_token_seconds_count"] == 2
    assert m[("k3_time_to_first_token_seconds_bucket", "+Inf")] == 2
    assert m["k3_request_duration_seconds_count"] == 4     # the scrape is counted after
    assert m[("k3_http_responses_total", "4xx")] == 2
    assert m[("k3_http_responses_total", "2xx")] == 2
