"""Prometheus metrics for the server, names prefixed `jaxserve:`.

Gauges and counters are read from the engine at scrape time (a custom collector, so
nothing is double-counted); latency histograms are observed by the request handlers
when a request finishes, on the event loop thread.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from jaxserve.outputs import RequestMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

_GAUGES = {
    "num_requests_running": ("num_running", "Requests running on the engine"),
    "num_requests_waiting": ("num_waiting", "Requests waiting to be scheduled"),
    "kv_cache_usage_perc": ("kv_usage", "Fraction of KV blocks in use (0-1)"),
    "kv_cache_free_blocks": ("kv_free_blocks", "KV blocks free (cached-but-unused blocks count as free)"),
    "kv_cache_total_blocks": ("kv_total_blocks", "KV blocks in the pool (the null block excluded)"),
    "compiles_after_warmup": ("compiles_after_warmup", "XLA compiles of the step after warm-up (should stay 0)"),
    "num_requests_in_flight": ("num_in_flight", "Requests a client is waiting for"),
    "num_requests_unfinished": ("num_unfinished", "Requests the engine tracks (running, waiting or being aborted)"),
}
_COUNTERS = {
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "num_preemptions": ("num_preemptions", "Requests preempted (recomputed later)"),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens computed"),
    "generation_tokens": ("generation_tokens", "Tokens generated"),
}


# vLLM's speculative-decoding counters: acceptance rate = accepted / draft tokens; tokens per step of a
# speculating sequence = 1 + accepted / drafts.
_SPEC_DECODE = {
    "spec_decode_num_drafts": "Draft proposals verified (one per speculating sequence per step)",
    "spec_decode_num_draft_tokens": "Draft tokens verified",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted",
}


class _EngineCollector:
    def __init__(self, engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self):
        stats = self.engine.stats()
        for name, (key, doc) in _GAUGES.items():
            g = GaugeMetricFamily(f"jaxserve:{name}", doc, labels=["model_name"])
            g.add_metric([self.model_name], float(stats[key]))
            yield g
        for name, (key, doc) in _COUNTERS.items():
            c = CounterMetricFamily(f"jaxserve:{name}", doc, labels=["model_name"])
            c.add_metric([self.model_name], float(stats[key]))
            yield c
        for name, doc in _SPEC_DECODE.items():      # engines without speculative decoding report none
            if name in stats:
                c = CounterMetricFamily(f"jaxserve:{name}", doc, labels=["model_name"])
                c.add_metric([self.model_name], float(stats[name]))
                yield c
        kv_stats = getattr(getattr(self.engine, "engine", None), "kv_stats", None)
        if kv_stats is not None and getattr(self.engine.engine, "kv_role", None):
            yield from _kv_transfer_metrics(kv_stats.snapshot(), self.model_name)


def _kv_transfer_metrics(snap: dict, model_name: str):
    """Disaggregated prefill/decode (jaxserve.core.kv_transfer.KVTransferStats): transfers by outcome,
    bytes moved (sent by a producer, received by a consumer) and the seconds each pull took."""
    c = CounterMetricFamily("jaxserve:kv_transfers", "KV transfers by outcome", labels=["model_name", "outcome"])
    for outcome, n in sorted(snap["outcomes"].items()):
        c.add_metric([model_name, outcome], float(n))
    yield c
    b = CounterMetricFamily("jaxserve:kv_transfer_bytes", "KV bytes sent (producer) or received (consumer)",
                            labels=["model_name"])
    b.add_metric([model_name], float(snap["bytes"]))
    yield b
    h = HistogramMetricFamily("jaxserve:kv_transfer_seconds", "Seconds one KV pull took", labels=["model_name"])
    buckets = [(str(bound), float(n)) for bound, n in snap["buckets"]] + [("+Inf", float(snap["count"]))]
    h.add_metric([model_name], buckets, sum_value=snap["sum"])
    yield h


class ServerMetrics:
    def __init__(self, engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.model_name = model_name

        def hist(name, doc):
            return Histogram(f"jaxserve:{name}", doc, ["model_name"], registry=self.registry,
                             buckets=_LATENCY_BUCKETS).labels(model_name)
        self.ttft = hist("time_to_first_token_seconds", "Time to first token")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens of a request")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish")
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled")

    def observe(self, m: RequestMetrics | None) -> None:
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for d in m.inter_token_latencies:
            self.itl.observe(d)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
