"""/metrics: the engine's stats and the server's counters as Prometheus text."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

GAUGES = {
    "num_running": ("asyncllm_num_requests_running", "requests in the running batch"),
    "num_waiting": ("asyncllm_num_requests_waiting", "requests waiting to be scheduled"),
    "kv_cache_usage": ("asyncllm_kv_cache_usage_perc", "fraction of KV cache blocks in use"),
    "prefix_cache_hit_rate": (
        "asyncllm_prefix_cache_hit_rate",
        "prompt tokens found in the prefix cache over those looked up, since start",
    ),
    "spec_acceptance_rate": (
        "asyncllm_spec_decode_acceptance_rate",
        "draft tokens accepted over those verified, since start",
    ),
}
COUNTERS = {
    "num_preemptions": ("asyncllm_num_preemptions", "requests preempted"),
    "total_prefill_tokens": ("asyncllm_prompt_tokens", "prompt tokens computed"),
    "total_decode_tokens": ("asyncllm_generation_tokens", "tokens generated"),
    "prefix_cache_queries": ("asyncllm_prefix_cache_queries", "prompt tokens looked up"),
    "prefix_cache_hits": ("asyncllm_prefix_cache_hits", "prompt tokens found cached"),
    "spec_num_drafts": (
        "asyncllm_spec_decode_num_drafts",
        "requests that verified draft tokens (one per request and step)",
    ),
    "spec_num_draft_tokens": ("asyncllm_spec_decode_num_draft_tokens", "draft tokens verified"),
    "spec_num_accepted_tokens": (
        "asyncllm_spec_decode_num_accepted_tokens",
        "draft tokens the model agreed with",
    ),
}
HISTOGRAMS = {
    "ttft_s": ("asyncllm_time_to_first_token_seconds", "time to first token"),
    "tpot_s": ("asyncllm_time_per_output_token_seconds", "time per output token after the first"),
    "e2e_latency_s": ("asyncllm_e2e_request_latency_seconds", "arrival to finish"),
    "queue_time_s": ("asyncllm_request_queue_time_seconds", "arrival to first scheduled"),
}


class _Snapshot:
    def __init__(
        self,
        stats: dict[str, Any],
        http: Counter[tuple[str, int]],
        finished: Counter[str],
    ) -> None:
        self.stats, self.http, self.finished = stats, http, finished

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        for key, (name, doc) in GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(s.get(key, 0.0)))
        for key, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(s.get(key, 0)))
        for key, (name, doc) in HISTOGRAMS.items():
            h = s[key]
            cumulative, buckets = 0, []
            for le, count in zip(h["buckets"], h["counts"]):
                cumulative += count
                buckets.append(("+Inf" if le == "+inf" else repr(float(le)), cumulative))
            total = (h["mean"] or 0.0) * h["count"]
            yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)
        http = CounterMetricFamily(
            "asyncllm_http_requests", "HTTP answers by route and status", labels=["route", "status"]
        )
        for (route, status), n in sorted(self.http.items()):
            http.add_metric([route, str(status)], n)
        yield http
        done = CounterMetricFamily(
            "asyncllm_request_success",
            "completions finished, by finish reason",
            labels=["finished_reason"],
        )
        for reason, n in sorted(self.finished.items()):
            done.add_metric([reason], n)
        yield done


def render_metrics(
    stats: dict[str, Any], http: Counter[tuple[str, int]], finished: Counter[str]
) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats, http, finished))
    return generate_latest(registry)
