"""Prometheus metrics of the server, named like vLLM's (`pagedllm:` instead of `vllm:`).

Two sources:
- engine stats (running/waiting requests, KV blocks, prefix-cache and preemption counts) are read at
  scrape time from the snapshot AsyncEngine refreshes after each step: a custom collector, so the
  values are never stale and never need the engine itself (which only the loop thread may touch);
- per-request events (tokens, latencies, finish reasons) are recorded by the engine loop thread
  through on_output / on_abort. prometheus_client's metrics are thread-safe.

With data-parallel replicas (engine/data_parallel.py) get_stats returns one snapshot per replica, keyed by
its label, and every engine and request metric carries a `replica` label; `pagedllm:replica_up` says
which replicas are alive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "pagedllm:"

# The `*_created` timestamp series double the output and nobody graphs them (vLLM drops them too).
disable_created_metrics()

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class _EngineStatsCollector(Collector):
    """Turns the latest EngineStats snapshot into gauges and (cumulative) counters at scrape time."""

    def __init__(self, get_stats: Callable[[], Any]):
        self.get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        stats = self.get_stats()
        if not isinstance(stats, Mapping):
            yield from _engine_metrics({None: stats})
            return
        up = GaugeMetricFamily(
            PREFIX + "replica_up", "1 while the engine replica is alive.", labels=["replica"]
        )
        for label, replica_stats in stats.items():
            up.add_metric([label], 0.0 if replica_stats is None else 1.0)
        yield up
        yield from _engine_metrics({k: v for k, v in stats.items() if v is not None})


def _engine_metrics(by_replica: Mapping[str | None, Any]) -> Iterator[Metric]:
    """The engine gauges and counters; label None: one engine, unlabelled; else a `replica` label each."""
    labels = [] if None in by_replica else ["replica"]

    def family(kind: type, name: str, doc: str, extra: Sequence[str] = ()) -> Any:
        return kind(PREFIX + name, doc, labels=[*labels, *extra])

    def value(stats: Any, name: str) -> float:
        return float(getattr(stats, name, 0) or 0) if stats is not None else 0.0

    def key(label: str | None) -> list[str]:
        return [] if label is None else [label]

    gauges = [
        ("num_requests_running", "Requests in the running batch.", "num_running"),
        ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
        ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", "kv_cache_usage"),
        ("kv_cache_blocks_total", "KV-cache blocks in the pool.", "num_blocks_total"),
        ("kv_cache_blocks_free", "KV-cache blocks free to allocate.", "num_free_blocks"),
    ]
    counters = [
        ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
        ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
        ("num_preemptions", "Requests preempted (KV blocks short, or a higher priority).", "num_preemptions"),
    ]
    for kind, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
        for name, doc, attr in rows:
            metric = family(kind, name, doc)
            for label, stats in by_replica.items():
                metric.add_metric(key(label), value(stats, attr))
            yield metric
    yield from _offload_metrics(by_replica, family, key)
    yield from _lora_metrics(by_replica, family, key)
    # vLLM's speculative-decoding counters; absent while speculation is off (as in vLLM)
    specs = {k: s.spec_decode for k, s in by_replica.items() if getattr(s, "spec_decode", None) is not None}
    if not specs:
        return
    for name, doc in (
        ("spec_decode_num_drafts", "Verify steps of a request with draft tokens."),
        ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    ):
        metric = family(CounterMetricFamily, name, doc)
        for label, spec in specs.items():
            metric.add_metric(key(label), getattr(spec, name.removeprefix("spec_decode_")))
        yield metric
    per_pos = family(
        CounterMetricFamily,
        "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0 = the first guess).",
        ["position"],
    )
    for label, spec in specs.items():
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric([*key(label), str(pos)], n)
    yield per_pos


# --kv-offload-dir (engine/kv_offload.py): vLLM's names for a KV connector's hits, then the disk store's own
_OFFLOAD_COUNTERS = (
    (
        "external_prefix_cache_queries",
        "Prompt tokens looked up on disk after a prefix-cache miss.",
        "queries",
    ),
    ("external_prefix_cache_hits", "Prompt tokens read back from disk instead of computed.", "hits"),
    ("kv_offload_blocks_read", "KV blocks read back from --kv-offload-dir.", "store.blocks_read"),
    ("kv_offload_bytes_read", "Bytes of KV blocks read back from --kv-offload-dir.", "store.bytes_read"),
    ("kv_offload_blocks_written", "KV blocks written to --kv-offload-dir.", "store.blocks_written"),
    ("kv_offload_bytes_written", "Bytes written to --kv-offload-dir.", "store.bytes_written"),
    ("kv_offload_write_drops", "KV blocks not written: the writer's queue was full.", "store.write_drops"),
    ("kv_offload_corrupt_files", "Block files that failed their checksum, deleted.", "store.corrupt_files"),
    ("kv_offload_files_evicted", "Block files deleted by --kv-offload-max-bytes.", "store.files_evicted"),
)


def _offload_metrics(
    by_replica: Mapping[str | None, Any], family: Callable, key: Callable
) -> Iterator[Metric]:
    """The offload counters; absent without --kv-offload-dir."""
    offload = {k: s.kv_offload for k, s in by_replica.items() if getattr(s, "kv_offload", None) is not None}
    for name, doc, path in _OFFLOAD_COUNTERS:
        if not offload:
            return
        metric = family(CounterMetricFamily, name, doc)
        for label, stats in offload.items():
            value: Any = stats
            for part in path.split("."):
                value = getattr(value, part)
            metric.add_metric(key(label), float(value))
        yield metric


def _lora_metrics(by_replica: Mapping[str | None, Any], family: Callable, key: Callable) -> Iterator[Metric]:
    """vLLM's lora_requests_info: one sample whose labels name the adapters (comma-separated)
    of the running and the waiting requests, valued at the scrape's time; absent without --enable-lora."""
    loras = {k: s.lora for k, s in by_replica.items() if getattr(s, "lora", None) is not None}
    if not loras:
        return
    metric = family(
        GaugeMetricFamily,
        "lora_requests_info",
        "Running stats on LoRA requests.",
        ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    for label, stats in loras.items():
        metric.add_metric(
            [
                *key(label),
                ",".join(map(str, stats.running)),
                ",".join(map(str, stats.waiting)),
                str(stats.max_loras),
            ],
            time.time(),
        )
    yield metric


class ServerMetrics:
    """One CollectorRegistry per server (so tests can run several in one process)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, get_stats: Callable[[], Any] | None = None, replicas: Sequence[str] | None = None):
        """replicas: the labels of data-parallel replicas; every request metric then has a `replica` label
        (on_output and on_abort say which), and get_stats returns one snapshot per replica."""
        self.registry = CollectorRegistry()
        self.replicas = list(replicas) if replicas else None
        r = self.registry
        by = ["replica"] if self.replicas else []
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", by, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", by, registry=r)
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished completions (one per choice), by finish reason.",
            ["finished_reason", *by],
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to first generated token.",
            by,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between two consecutive outputs of a request.",
            by,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to finish of a request.",
            by,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        for replica in self.replicas or [None]:  # show zeros before the first request
            for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e):
                self._child(metric, replica)
            for reason in ("stop", "length", "abort"):
                self._child(self.request_success, replica, finished_reason=reason)
        if get_stats is not None:
            self.attach_engine_stats(get_stats)

    def _child(self, metric: Any, replica: str | None, **labels: str) -> Any:
        """The metric itself, or its child for these labels (and the replica's, when there are replicas)."""
        if self.replicas is not None:
            labels["replica"] = replica or ""
        return metric.labels(**labels) if labels else metric

    def attach_engine_stats(self, get_stats: Callable[[], Any]) -> None:
        self.registry.register(_EngineStatsCollector(get_stats))

    # Called by AsyncEngine on its loop thread (by DataParallelEngine on the server's event loop, with the
    # replica's label). `timing` is that request's RequestTiming *before* this output is accounted (so
    # num_outputs == 0 means this is the first output).
    def on_output(
        self, output: Any, new_tokens: int, timing: Any, now: float, replica: str | None = None
    ) -> None:
        if timing.num_outputs == 0:
            self._child(self.prompt_tokens, replica).inc(len(output.prompt_token_ids or []))
        if new_tokens > 0:
            self._child(self.generation_tokens, replica).inc(new_tokens)
            if timing.first_token is None:
                self._child(self.ttft, replica).observe(now - timing.arrival)
            else:
                self._child(self.itl, replica).observe(now - timing.last_token)
        if output.finished:
            self._child(self.e2e, replica).observe(now - timing.arrival)
            for choice in output.outputs:
                reason = choice.finish_reason or "abort"
                self._child(self.request_success, replica, finished_reason=reason).inc()

    def on_abort(self, request_id: str, replica: str | None = None) -> None:
        self._child(self.request_success, replica, finished_reason="abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def render_by_model(by_model: Mapping[str, ServerMetrics], served: Sequence[str]) -> bytes:
    """A server of several models (entrypoints/openai/model_router.py): each loaded model's metrics, the
    same names as one model's, with a `model_name` label (vLLM's), plus `pagedllm:model_loaded` for every
    served model. A model's counters start again from zero when it is loaded again (as after a restart)."""
    merged: dict[str, Metric] = {}
    loaded = GaugeMetricFamily(
        PREFIX + "model_loaded", "1 while the model is loaded, 0 while not.", labels=["model_name"]
    )
    for name in served:
        loaded.add_metric([name], 1.0 if name in by_model else 0.0)
    merged[loaded.name] = loaded
    for model, metrics in by_model.items():
        for family in metrics.registry.collect():
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for s in family.samples:
                out.samples.append(s._replace(labels={"model_name": model, **s.labels}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
