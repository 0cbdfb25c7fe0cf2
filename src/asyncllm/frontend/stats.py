"""Request latency histograms and the stats dict both entry points return."""

from __future__ import annotations

import bisect
from typing import Any

from asyncllm.messages import SchedulerStats
from asyncllm.outputs import RequestOutput

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "buckets": [*self.buckets, "+inf"],
            "counts": list(self.counts),
            "count": self.n,
            "mean": self.total / self.n if self.n else None,
        }


class LatencyStats:
    """Time to first token, time per output token, end-to-end latency and queue time of
    finished requests, from the timestamps in `RequestOutput.metrics`."""

    def __init__(self) -> None:
        self.ttft = Histogram()
        self.tpot = Histogram()
        self.e2e = Histogram()
        self.queue = Histogram()

    def observe(self, out: RequestOutput) -> None:
        m = out.metrics
        if "first_token_time" in m:
            self.ttft.observe(m["first_token_time"] - m["arrival_time"])
            # the request's whole output (a DELTA output holds only its last tokens)
            n = int(m.get("num_generation_tokens", max(len(c.token_ids) for c in out.outputs)))
            if "finished_time" in m and n > 1:
                self.tpot.observe((m["finished_time"] - m["first_token_time"]) / (n - 1))
        if "finished_time" in m:
            self.e2e.observe(m["finished_time"] - m["arrival_time"])
        if "first_scheduled_time" in m:
            self.queue.observe(max(m["first_scheduled_time"] - m["arrival_time"], 0.0))

    def as_dict(self) -> dict[str, Any]:
        return {
            "ttft_s": self.ttft.as_dict(),
            "tpot_s": self.tpot.as_dict(),
            "e2e_latency_s": self.e2e.as_dict(),
            "queue_time_s": self.queue.as_dict(),
        }


def stats_dict(core: SchedulerStats, latency: LatencyStats, num_requests: int) -> dict[str, Any]:
    """The engine core's counters, the prefix-cache hit rate, the number of requests the
    frontend tracks and the latency histograms, as one plain dict."""
    out: dict[str, Any] = {f: getattr(core, f) for f in core.__struct_fields__}
    q = core.prefix_cache_queries
    out["prefix_cache_hit_rate"] = core.prefix_cache_hits / q if q else 0.0
    drafts, tokens = core.spec_num_drafts, core.spec_num_draft_tokens
    out["spec_acceptance_rate"] = core.spec_num_accepted_tokens / tokens if tokens else 0.0
    # (per verification: the drafts agreed with, and the drafts verified)
    out["spec_mean_accepted_tokens"] = core.spec_num_accepted_tokens / drafts if drafts else 0.0
    out["spec_mean_draft_tokens"] = tokens / drafts if drafts else 0.0
    out["num_frontend_requests"] = num_requests
    out.update(latency.as_dict())
    return out
