"""Prometheus metrics: request outcomes and latencies observed by the server, and the
engine's queue and adapter counters read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraplex.types import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 1.0)


class _EngineCollector:
    """Engine counters and gauges, read when Prometheus scrapes."""

    def __init__(self, stats_fn, in_flight_fn):
        self.stats_fn, self.in_flight_fn = stats_fn, in_flight_fn

    def collect(self):
        s = self.stats_fn()
        gauges = {
            "loraplex_num_requests_waiting": ("Requests queued for the engine", s["requests_waiting"]),
            "loraplex_num_requests_running": ("Requests in the running batch", s["requests_running"]),
            "loraplex_num_requests_in_flight": ("Requests the server is serving", self.in_flight_fn()),
            "loraplex_kv_cache_free_blocks": ("Free KV cache pages", s["kv_blocks_free"]),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, key in (
                ("loraplex_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 "prefix_cache_queried_tokens"),
                ("loraplex_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                 "prefix_cache_hit_tokens"),
                ("loraplex_spec_decode_draft_tokens", "Tokens proposed by speculative decoding",
                 "spec_draft_tokens"),
                ("loraplex_spec_decode_accepted_tokens", "Proposed tokens verification kept",
                 "spec_accepted_tokens"),
                ("loraplex_spec_decode_num_drafts", "Sequence-steps that verified proposals "
                 "(mean accepted length: 1 + accepted / drafts)", "spec_verified_chunks")):
            yield CounterMetricFamily(name, doc, value=s[key])
        loads = CounterMetricFamily("loraplex_adapter_loads", "Adapter loads into a tier",
                                    labels=["tier"])
        loads.add_metric(["device"], s["adapter_slot_loads"])
        loads.add_metric(["host"], s.get("adapter_disk_loads", 0) + s.get("adapter_remote_loads", 0))
        loads.add_metric(["disk"], s.get("adapter_remote_loads", 0))
        yield loads
        evictions = CounterMetricFamily("loraplex_adapter_evictions",
                                        "Adapters evicted from a tier", labels=["tier"])
        evictions.add_metric(["device"], s["adapter_slot_evictions"])
        evictions.add_metric(["host"], s.get("adapter_host_evictions", 0))
        yield evictions


class Metrics:
    def __init__(self, stats_fn, in_flight_fn):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("loraplex_requests", "Finished requests by outcome",
                                ["endpoint", "outcome"], registry=r)
        self.ttft = Histogram("loraplex_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("loraplex_time_per_output_token_seconds",
                              "Time per output token after the first", buckets=_TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("loraplex_e2e_request_latency_seconds", "Request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("loraplex_request_queue_time_seconds", "Arrival to first step",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("loraplex_generation_tokens",
                                         "Generated tokens (aborted requests' included)", registry=r)
        self.aborted_tokens = Counter("loraplex_aborted_generation_tokens",
                                      "Tokens generated for requests aborted before they finished "
                                      "(the client left or was too slow)", registry=r)
        self.adapter_requests = Counter("loraplex_adapter_requests",
                                        "Adapter requests by the tier that held the adapter "
                                        "(device and host are hits)", ["tier"], registry=r)
        self.adapter_load = Histogram("loraplex_adapter_load_seconds",
                                      "Time a request waited for its adapter to be read from "
                                      "its source",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(stats_fn, in_flight_fn))

    def record(self, endpoint: str, outcome: str, out: RequestOutput | None) -> None:
        """A request ended: "ok", "error" or "aborted" (with its newest output, if any)."""
        self.requests.labels(endpoint, outcome).inc()
        if out is not None:
            self.observe(out)
            if outcome == "aborted":
                self.aborted_tokens.inc(sum(len(c.token_ids) for c in out.outputs))

    def observe(self, out: RequestOutput) -> None:
        """Record a request's timings and tokens."""
        m = out.metrics
        n = sum(len(c.token_ids) for c in out.outputs)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(n)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if n > 1 and m.last_token_time is not None:
                self.tpot.observe((m.last_token_time - m.first_token_time) / (n - 1))
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.adapter_source is not None:
            self.adapter_requests.labels(m.adapter_source).inc()
        if m.adapter_load_time:  # the request waited for a load (0: it was in memory)
            self.adapter_load.observe(m.adapter_load_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
