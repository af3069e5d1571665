"""Prometheus metrics of an engine: gauges read at scrape time, histograms and
counters fed by the engine thread through the `EngineObserver` interface."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from lockgate.engine import EngineClient, EngineObserver
from lockgate.memory import allocator_stats

# Buckets for a CPU or GPU server alike: sub-millisecond decode steps up to
# tens of seconds of queueing.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class _EngineGauges(Collector):
    """Running/waiting requests and KV pages, read from the engines when scraped
    (so they can never drift from the truth)."""

    def __init__(self) -> None:
        self.engines: list[EngineClient] = []

    def collect(self):
        families = {
            "requests_running": GaugeMetricFamily(
                "lockgate_requests_running", "Requests being generated.", labels=["model"]),
            "requests_waiting": GaugeMetricFamily(
                "lockgate_requests_waiting", "Requests queued for admission.", labels=["model"]),
            "kv_pages_used": GaugeMetricFamily(
                "lockgate_kv_pages_used", "KV cache pages held by running or waiting sequences.",
                labels=["model"]),
            "kv_pages_cached": GaugeMetricFamily(
                "lockgate_kv_pages_cached",
                "KV cache pages only the prefix cache holds (evicted when pages are short).",
                labels=["model"]),
            "kv_pages_total": GaugeMetricFamily(
                "lockgate_kv_pages_total", "KV cache pages in all.", labels=["model"]),
            "prefix_cache_sequences": GaugeMetricFamily(
                "lockgate_prefix_cache_sequences",
                "Finished sequences the prefix cache keeps (at most one per KV page).", labels=["model"]),
        }
        per_replica = {
            key: GaugeMetricFamily(family.name.replace("lockgate_", "lockgate_replica_", 1),
                                   family.documentation + " One engine replica's.",
                                   labels=["model", "replica"])
            for key, family in families.items()
        }
        for engine in self.engines:
            stats = engine.stats()
            for key, family in families.items():
                family.add_metric([engine.name], stats.figure(key))
            # engines with replicas (the Ray plugin's) also say each one's share
            for replica, figures in (stats.replicas or {}).items():
                for key, family in per_replica.items():
                    family.add_metric([engine.name, replica], figures.figure(key))
        yield from families.values()
        yield from (family for family in per_replica.values() if family.samples)


class _AllocatorGauges(Collector):
    """The C allocator's memory in use and freed-but-kept (glibc only): when
    resident memory grows, these say whether live allocations grew (a leak)
    or the allocator kept what was freed (gone at the next trim)."""

    def collect(self):
        stats = allocator_stats()
        if stats is None:
            return
        yield GaugeMetricFamily("lockgate_allocator_in_use_bytes",
                                "C allocator memory held by live allocations (glibc mallinfo2).",
                                value=stats.in_use)
        yield GaugeMetricFamily("lockgate_allocator_free_bytes",
                                "C allocator memory freed but kept for reuse until a trim (glibc mallinfo2).",
                                value=stats.free_kept)


class Metrics:
    """All lockgate metrics of one server, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        # process_resident_memory_bytes, process_open_fds, ...: growth shows
        # here before a container's memory limit finds it
        ProcessCollector(registry=self.registry)
        self.registry.register(_AllocatorGauges())
        self._gauges = _EngineGauges()
        self.registry.register(self._gauges)
        self.ttft = Histogram(
            "lockgate_time_to_first_token_seconds", "From arrival to the first generated token.",
            ["model"], buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram(
            "lockgate_time_per_output_token_seconds", "Mean time per generated token after the first.",
            ["model"], buckets=_TPOT_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter(
            "lockgate_prompt_tokens", "Prompt tokens of finished requests.", ["model"],
            registry=self.registry)
        self.generation_tokens = Counter(
            "lockgate_generation_tokens", "Generated tokens of finished requests.", ["model"],
            registry=self.registry)
        self.preemptions = Counter(
            "lockgate_preemptions", "Requests preempted for KV pages (recomputed later).", ["model"],
            registry=self.registry)
        self.prefix_queries = Counter(
            "lockgate_prefix_cache_queries", "Prefix-cache lookups (one per sequence admitted).", ["model"],
            registry=self.registry)
        self.prefix_hits = Counter(
            "lockgate_prefix_cache_hits", "Prompt tokens found in the prefix cache, not prefilled.", ["model"],
            registry=self.registry)
        self.drafted = Counter(
            "lockgate_speculative_drafted_tokens", "Draft tokens verified by speculative decoding, by drafter.",
            ["model", "drafter"], registry=self.registry)
        self.accepted = Counter(
            "lockgate_speculative_accepted_tokens", "Draft tokens the sampler drew as drafted, by drafter.",
            ["model", "drafter"], registry=self.registry)
        self.requests = Counter(
            "lockgate_requests", "HTTP requests to the API by outcome and error type.",
            ["outcome", "error_type"], registry=self.registry)
        self.models_loaded = Gauge(
            "lockgate_model_loaded", "1 while the model is loaded, else 0.", ["model"], registry=self.registry)
        self.model_loads = Counter(
            "lockgate_model_loads", "Times the model was loaded.", ["model"], registry=self.registry)
        self.model_memory = Gauge(
            "lockgate_model_memory_bytes", "Bytes the loaded model's executor allocated, by kind "
            "(weights, kv_cache).", ["model", "kind"], registry=self.registry)

    def observe_engine(self, engine: EngineClient) -> None:
        """Report `engine`'s gauges and events from now on."""
        self._gauges.engines.append(engine)
        engine.observer = _EngineMetrics(self, engine.name)
        self.models_loaded.labels(engine.name).set(1)
        self.model_loads.labels(engine.name).inc()
        memory = engine.stats().memory or {}
        for kind, size in memory.items():
            self.model_memory.labels(engine.name, kind).set(size)

    def forget_engine(self, engine: EngineClient) -> None:
        """`engine` was unloaded: its gauges go (its counters stay)."""
        if engine in self._gauges.engines:
            self._gauges.engines.remove(engine)
        self.models_loaded.labels(engine.name).set(0)
        for kind in ("weights", "kv_cache"):
            self.model_memory.labels(engine.name, kind).set(0)

    def count_request(self, status: int, error_type: str | None) -> None:
        """One finished HTTP request: `status` 499 means the client went away."""
        if status == 499:
            outcome = "aborted"
        elif status >= 400 or error_type:  # error_type alone: failed mid-stream
            outcome = "error"
        else:
            outcome = "success"
        self.requests.labels(outcome=outcome, error_type=error_type or "").inc()


class _EngineMetrics(EngineObserver):
    def __init__(self, metrics: Metrics, model: str) -> None:
        self.metrics = metrics
        self.model = model

    def request_finished(self, *, ttft, tpot, prompt_tokens, completion_tokens, outcome) -> None:
        m = self.metrics
        if ttft is not None:
            m.ttft.labels(self.model).observe(ttft)
        if tpot is not None:
            m.tpot.labels(self.model).observe(tpot)
        m.prompt_tokens.labels(self.model).inc(prompt_tokens)
        m.generation_tokens.labels(self.model).inc(completion_tokens)

    def preempted(self) -> None:
        self.metrics.preemptions.labels(self.model).inc()

    def speculated(self, drafter: str | None, drafted: int, accepted: int) -> None:
        self.metrics.drafted.labels(self.model, drafter or "").inc(drafted)
        self.metrics.accepted.labels(self.model, drafter or "").inc(accepted)

    def prefix_lookup(self, tokens: int, found: int) -> None:
        self.metrics.prefix_queries.labels(self.model).inc()
        self.metrics.prefix_hits.labels(self.model).inc(found)
