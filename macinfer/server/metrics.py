"""Prometheus metrics: engine state read at scrape time, request latencies as histograms."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from macinfer.engine.llm_engine import LLMEngine, RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


class _EngineCollector:
    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def collect(self):
        e = self.engine
        bm = e.block_manager
        yield GaugeMetricFamily("macinfer_requests_running", "Sequences in the running batch", value=e.num_running)
        yield GaugeMetricFamily("macinfer_requests_waiting", "Sequences queued for admission", value=e.num_waiting)
        yield GaugeMetricFamily("macinfer_kv_blocks_used", "KV cache blocks in use", value=bm.num_used_blocks)
        yield GaugeMetricFamily("macinfer_kv_blocks_free", "KV cache blocks free", value=bm.num_free_blocks)
        yield GaugeMetricFamily("macinfer_kv_blocks_total", "KV cache blocks in the pool", value=bm.num_blocks)
        yield GaugeMetricFamily("macinfer_prefix_cache_blocks", "KV blocks holding cached prefixes", value=bm.num_cached_blocks)
        yield CounterMetricFamily("macinfer_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", value=bm.prefix_queries)
        yield CounterMetricFamily("macinfer_prefix_cache_hits", "Prompt tokens found in the prefix cache", value=bm.prefix_hits)
        yield GaugeMetricFamily("macinfer_prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries",
                                value=bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0)
        yield CounterMetricFamily("macinfer_preemptions", "Sequences preempted for KV space", value=e.scheduler.num_preemptions)
        yield CounterMetricFamily("macinfer_prompt_tokens", "Prompt tokens prefilled", value=e.stats["prompt_tokens"])
        yield CounterMetricFamily("macinfer_generation_tokens", "Tokens generated", value=e.stats["generation_tokens"])
        yield CounterMetricFamily("macinfer_spec_draft_tokens", "Speculative draft tokens checked",
                                  value=e.stats["spec_draft_tokens"])
        yield CounterMetricFamily("macinfer_spec_accepted_tokens", "Speculative draft tokens accepted",
                                  value=e.stats["spec_accepted_tokens"])


class ServerMetrics:
    def __init__(self, engine: LLMEngine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("macinfer_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("macinfer_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=self.registry)
        self.e2e = Histogram("macinfer_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)

    def observe(self, out: RequestOutput) -> None:
        m = out.metrics
        if "ttft" in m:
            self.ttft.observe(m["ttft"])
        if "e2e" in m:
            self.e2e.observe(m["e2e"])
            if "ttft" in m and len(out.token_ids) > 1:
                self.tpot.observe((m["e2e"] - m["ttft"]) / (len(out.token_ids) - 1))
