"""Prometheus metrics: engine state read at scrape time, request latencies as histograms."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from macinfer.engine.llm_engine import LLMEngine, RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


class _EngineCollector:
    """Each loaded model's engine state, read at scrape time; labelled `model` when the
    server serves several models (one model keeps the plain series)."""

    def __init__(self, engines, labelled: bool):
        self.engines = engines  # () -> [(model name, engine)]
        self.labelled = labelled

    def collect(self):
        labels = ["model"] if self.labelled else []
        families = {}

        def add(kind, name, doc, value, model):
            if name not in families:
                families[name] = kind(name, doc, labels=labels)
            families[name].add_metric([model] if self.labelled else [], value)

        for model, e in self.engines():
            bm = e.block_manager
            g, c = GaugeMetricFamily, CounterMetricFamily
            add(g, "macinfer_requests_running", "Sequences in the running batch", e.num_running, model)
            add(g, "macinfer_requests_waiting", "Sequences queued for admission", e.num_waiting, model)
            add(g, "macinfer_kv_blocks_used", "KV cache blocks in use", bm.num_used_blocks, model)
            add(g, "macinfer_kv_blocks_free", "KV cache blocks free", bm.num_free_blocks, model)
            add(g, "macinfer_kv_blocks_total", "KV cache blocks in the pool", bm.num_blocks, model)
            add(g, "macinfer_kv_bytes_per_token", "KV cache bytes one token takes, every cache group together "
                "(its dtype's: --kv-cache-dtype; past the first tokens --kv-quant-start keeps)",
                sum(g_.get("bytes_per_token", 0) for g_ in e.cache_groups() if "first_tokens" not in g_), model)
            add(g, "macinfer_prefix_cache_blocks", "KV blocks holding cached prefixes", bm.num_cached_blocks, model)
            add(c, "macinfer_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", bm.prefix_queries, model)
            add(c, "macinfer_prefix_cache_hits", "Prompt tokens found in the prefix cache", bm.prefix_hits, model)
            add(g, "macinfer_prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries",
                bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0, model)
            add(c, "macinfer_preemptions", "Sequences preempted for KV space", e.scheduler.num_preemptions, model)
            add(c, "macinfer_prompt_tokens", "Prompt tokens prefilled", e.stats["prompt_tokens"], model)
            add(c, "macinfer_generation_tokens", "Tokens generated", e.stats["generation_tokens"], model)
            add(c, "macinfer_spec_draft_tokens", "Speculative draft tokens checked", e.stats["spec_draft_tokens"], model)
            add(c, "macinfer_spec_accepted_tokens", "Speculative draft tokens accepted",
                e.stats["spec_accepted_tokens"], model)
            add(c, "macinfer_spec_verify_steps", "Sequence steps that verified drafts (each: one target row "
                "per draft, tokens gained = accepted + 1)", e.stats["spec_verify_steps"], model)
            for j, (d, a) in enumerate(zip(e.stats["spec_drafted_by_position"], e.stats["spec_accepted_by_position"])):
                add(g, f"macinfer_spec_acceptance_position_{j + 1}", f"Share of drafts at position {j + 1} accepted",
                    a / d if d else 0.0, model)
            vision = getattr(e, "vision", None)
            if vision is not None:
                enc = vision.encoder
                add(c, "macinfer_images", "Images in accepted requests", e.stats["images"], model)
                add(c, "macinfer_image_tokens", "Prompt tokens that are image placeholders", e.stats["image_tokens"], model)
                add(c, "macinfer_images_encoded", "Images run through the vision tower", enc.images_encoded, model)
                add(c, "macinfer_encoder_cache_hits", "Images found encoded in the encoder cache", enc.cache.hits, model)
                add(c, "macinfer_encoder_cache_misses", "Images not in the encoder cache", enc.cache.misses, model)
                add(g, "macinfer_encoder_cache_bytes", "Bytes the encoder cache holds", enc.cache.nbytes, model)
            disk = bm.disk
            if disk is not None:
                add(c, "macinfer_prefix_cache_disk_hits", "Prompt tokens whose K/V came back from the disk tier",
                    disk.hit_tokens, model)
                add(g, "macinfer_prefix_cache_disk_bytes", "Bytes the disk tier holds", disk.store.bytes, model)
                add(c, "macinfer_prefix_cache_disk_writes", "Records the disk tier wrote", disk.store.writes, model)
                add(c, "macinfer_prefix_cache_disk_corrupt", "Disk records dropped as corrupt",
                    disk.store.corrupt, model)
                add(g, "macinfer_prefix_cache_disk_enabled", "1 while the disk tier works", int(disk.enabled), model)
            if self.labelled:
                add(g, "macinfer_model_memory_bytes", "Weights and KV cache of a loaded model", e.memory_bytes(), model)
        yield from families.values()


class ServerMetrics:
    """`engines()`: the loaded models as (name, engine); `labelled`: several models served."""

    def __init__(self, engines, labelled: bool = False):
        if isinstance(engines, LLMEngine):  # one engine: the plain series
            engine = engines
            engines = lambda: [("", engine)]  # noqa: E731
        self.labelled = labelled
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engines, labelled))
        names = ("model",) if labelled else ()
        self.ttft = Histogram("macinfer_time_to_first_token_seconds", "Time to first token", names,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("macinfer_time_per_output_token_seconds", "Time per output token after the first",
                              names, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=self.registry)
        self.e2e = Histogram("macinfer_e2e_request_latency_seconds", "End-to-end request latency", names,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)

    def observe(self, out: RequestOutput, model: str = "") -> None:
        m = out.metrics
        ttft, tpot, e2e = ((h.labels(model) if self.labelled else h) for h in (self.ttft, self.tpot, self.e2e))
        if "ttft" in m:
            ttft.observe(m["ttft"])
        if "e2e" in m:
            e2e.observe(m["e2e"])
            if "ttft" in m and len(out.token_ids) > 1:
                tpot.observe((m["e2e"] - m["ttft"]) / (len(out.token_ids) - 1))
