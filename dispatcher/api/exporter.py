"""Prometheus exposition of the whole pool for ``GET /metrics``.

Counters and histograms come from the ``gpulane:metrics`` hash, into which every
worker and API replica folds its :class:`~dispatcher.contract.metrics.Recorder` once per
heartbeat; gauges come from a :class:`~dispatcher.api.pool.Snapshot`. Both are pool-wide,
so every replica exports the same series and Prometheus may scrape any one of them.
The API's own process metrics (CPU, memory, file descriptors, GC) are added, as any
Python service exports them.

Nothing here is per task: label values are classes, task types, statuses, reasons,
worker names and GPU indexes, all bounded by the configuration and the pool.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from redis.asyncio import Redis

from dispatcher.api.pool import Snapshot
from dispatcher.contract import keys
from dispatcher.contract.metrics import BUCKETS, COUNTERS, HISTOGRAMS, buckets_of, le_text
from dispatcher.contract.scripts import as_text
from dispatcher.contract.workers import WORKER_STATES

__all__ = [
    "Histogram",
    "Recorded",
    "parse",
    "pool_families",
    "read_recorded",
    "redis_families",
    "render",
]

Labels = tuple[str, ...]

# Every worker state (pool.WORKER_STATES) is exported, zero included, so an alert on
# `gpulane_workers{state="idle"} == 0` has a series to evaluate, not an absent one.

_HELP = {
    "submitted": "Tasks accepted by the API.",
    "rejected": "Submits refused: admission (503) or a tenant's limits (429), by reason; "
    'class "-" when refused before the class was read.',
    "finished": "Tasks that reached a final status.",
    "requeued": "Tasks given back to their queue after their worker was lost.",
    "fenced": "Reports (finish, release, progress) dropped because a later attempt of the "
    "task had started: the reporting worker had lost its lease.",
    "queue_wait": "Seconds from submit to start, per started task.",
    "run": "Seconds a task ran on its worker.",
    "latency": "Seconds from submit to a final status.",
    "batch_size": "Tasks per handler call of a batched type.",
    "tokens": "Model tokens used by generations through backend workers, per tenant, model "
    "and kind (prompt, completion).",
    "device": "Device seconds used by tasks, per tenant, class and type, as their workers "
    "measured them (a batch's call time shared by its items; a backend worker's slot time).",
    "ttft": "Seconds from a backend worker's forward to the first streamed token, per backend.",
    "tbt": "Seconds between streamed tokens, per backend.",
    "tokens_per_s": "Completion tokens per second of one generation, per backend.",
}


@dataclass
class Histogram:
    """One histogram series as stored: observations per bucket, not cumulative."""

    buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> count
    sum: float = 0.0
    standard: tuple[float, ...] = BUCKETS  # the bounds always exported

    @property
    def count(self) -> float:
        return sum(self.buckets.values())

    def cumulative(self) -> list[tuple[float, float]]:
        """(upper bound, observations at or below it) for every standard bound, plus any
        other bound found in Redis (written by a version with other buckets)."""
        bounds = sorted(set(self.standard) | set(self.buckets))
        out, running = [], 0.0
        for bound in bounds:
            running += self.buckets.get(bound, 0.0)
            out.append((bound, running))
        return out

    def minus(self, earlier: Histogram) -> Histogram:
        """What was observed since ``earlier`` (negative counts mean Redis was reset)."""
        bounds = set(self.buckets) | set(earlier.buckets)
        return Histogram(
            {b: self.buckets.get(b, 0.0) - earlier.buckets.get(b, 0.0) for b in bounds},
            self.sum - earlier.sum,
            self.standard,
        )


@dataclass
class Recorded:
    """The ``gpulane:metrics`` hash, parsed: short metric name -> label values -> value."""

    counters: dict[str, dict[Labels, float]] = field(default_factory=dict)
    histograms: dict[str, dict[Labels, Histogram]] = field(default_factory=dict)


def parse(raw: Mapping[bytes | str, bytes | str]) -> Recorded:
    """Parse the hash fields documented in :mod:`dispatcher.contract.metrics`. A field of a metric
    this version does not know, or with the wrong number of labels, is skipped: during
    a rolling upgrade a newer worker may record what this API cannot describe yet."""
    out = Recorded(
        counters={name: {} for name in COUNTERS}, histograms={name: {} for name in HISTOGRAMS}
    )
    for raw_field, raw_value in raw.items():
        kind, _, rest = as_text(raw_field).partition("|")
        name, _, label_text = rest.partition("|")
        parts = tuple(label_text.split("|"))
        try:
            value = float(as_text(raw_value))
            if kind == "c" and name in COUNTERS and len(parts) == len(COUNTERS[name][1]):
                series = out.counters[name]
                series[parts] = series.get(parts, 0.0) + value
            elif kind == "h" and name in HISTOGRAMS and len(parts) == len(HISTOGRAMS[name][1]) + 1:
                hist = out.histograms[name].setdefault(
                    parts[:-1], Histogram(standard=buckets_of(name))
                )
                bound = float(parts[-1])  # "+Inf" parses to inf
                hist.buckets[bound] = hist.buckets.get(bound, 0.0) + value
            elif kind == "s" and name in HISTOGRAMS and len(parts) == len(HISTOGRAMS[name][1]):
                hist = out.histograms[name].setdefault(parts, Histogram(standard=buckets_of(name)))
                hist.sum += value
        except ValueError:
            continue  # not a number: nothing gpulane wrote
    return out


async def read_recorded(client: Redis) -> Recorded:
    """One HGETALL: the whole pool's counters and histograms."""
    return parse(await client.hgetall(keys.METRICS))


def _recorded_families(recorded: Recorded) -> Iterator[Metric]:
    for short, (name, labels) in COUNTERS.items():
        counter = CounterMetricFamily(name, _HELP[short], labels=labels)
        for values, total in sorted(recorded.counters.get(short, {}).items()):
            counter.add_metric(values, total)
        yield counter
    for short, (name, labels) in HISTOGRAMS.items():
        unit = "seconds" if name.endswith("_seconds") else ""
        histogram = HistogramMetricFamily(name, _HELP[short], labels=labels, unit=unit)
        for values, hist in sorted(recorded.histograms.get(short, {}).items()):
            buckets = [(le_text(bound), n) for bound, n in hist.cumulative()]
            histogram.add_metric(values, buckets, hist.sum)
        yield histogram


def _device_gauges(workers: Sequence[Mapping[str, Any]]) -> Iterator[Metric]:
    """GPU gauges per worker; cpu workers have no GPU and export none (invariant 6:
    their device shows as cpu in /workers and the dashboard, not as a zero GPU)."""
    util = GaugeMetricFamily(
        "gpulane_gpu_utilization_ratio",
        "GPU busy fraction (0-1) as NVML last sampled it.",
        labels=("worker", "gpu"),
    )
    used = GaugeMetricFamily(
        "gpulane_gpu_memory_used_bytes", "GPU memory in use.", labels=("worker", "gpu")
    )
    total = GaugeMetricFamily(
        "gpulane_gpu_memory_total_bytes", "GPU memory installed.", labels=("worker", "gpu")
    )
    temperature = GaugeMetricFamily(
        "gpulane_gpu_temperature_celsius",
        "GPU die temperature (absent where the card cannot tell).",
        labels=("worker", "gpu"),
    )
    power = GaugeMetricFamily(
        "gpulane_gpu_power_watts",
        "GPU power draw (absent where the card cannot tell).",
        labels=("worker", "gpu"),
    )
    for worker in workers:
        device = worker.get("device") or {}
        if device.get("kind") != "gpu":
            continue
        gpu = str(device["index"] if device.get("index") is not None else device.get("uuid"))
        labels = (str(worker["name"]), gpu)
        for family, key in (
            (util, "utilization"),
            (used, "memory_used_bytes"),
            (total, "memory_total_bytes"),
            (temperature, "temperature_c"),
            (power, "power_w"),
        ):
            value = device.get(key)
            if value is not None and math.isfinite(float(value)):
                family.add_metric(labels, float(value))
    yield from (util, used, total, temperature, power)


def _pool_gauges(snap: Snapshot) -> Iterator[Metric]:
    depth = GaugeMetricFamily("gpulane_queue_depth", "Tasks queued per class.", labels=("class",))
    running = GaugeMetricFamily(
        "gpulane_tasks_running", "Tasks running per class.", labels=("class",)
    )
    serving = GaugeMetricFamily(
        "gpulane_class_workers",
        "Live workers serving each class (idle or busy).",
        labels=("class",),
    )
    tenants = GaugeMetricFamily(
        "gpulane_tenant_queued_tasks",
        "Tasks queued per class and tenant under fair share (tenants with any).",
        labels=("class", "tenant"),
    )
    for cls, class_state in snap.classes.items():
        depth.add_metric((cls,), class_state.depth)
        running.add_metric((cls,), class_state.running)
        serving.add_metric((cls,), class_state.workers)
        for tenant, queued in class_state.tenants:
            tenants.add_metric((cls, tenant), queued)
    yield from (depth, running, serving, tenants)
    states = Counter({state: 0 for state in WORKER_STATES})
    states.update(str(w["state"]) for w in snap.workers)
    workers = GaugeMetricFamily("gpulane_workers", "Live workers by state.", labels=("state",))
    for state, n in states.items():
        workers.add_metric((state,), n)
    yield workers
    yield from _device_gauges(snap.workers)
    yield _model_gauge(snap.workers)


def _model_gauge(workers: Sequence[Mapping[str, Any]]) -> Metric:
    """Seconds each live worker took to load each model it serves (its ``models``)."""
    load = GaugeMetricFamily(
        "gpulane_model_load_seconds",
        "Seconds a worker took to load a model at start.",
        labels=("worker", "model"),
    )
    for worker in workers:
        for model, info in sorted((worker.get("models") or {}).items()):
            seconds = info.get("load_s") if isinstance(info, dict) else None
            if isinstance(seconds, int | float) and math.isfinite(seconds):
                load.add_metric((str(worker["name"]), str(model)), float(seconds))
    return load


def redis_families(memory: Mapping[str, int | None] | None) -> list[Metric]:
    """Whether this replica reaches Redis and, when it does, Redis' memory against its
    ``maxmemory`` (0: no limit): ``memory`` as ``/health`` reads it (``used_bytes``,
    ``max_bytes``, None for no limit), or None when Redis is unreachable, and
    ``gpulane_redis_up`` is then the one gpulane series exported."""
    up = GaugeMetricFamily("gpulane_redis_up", "1 when this API replica reaches Redis, else 0.")
    up.add_metric((), 0.0 if memory is None else 1.0)
    if memory is None:
        return [up]
    used = GaugeMetricFamily("gpulane_redis_memory_used_bytes", "Memory Redis uses.")
    used.add_metric((), float(memory["used_bytes"] or 0))
    limit = GaugeMetricFamily("gpulane_redis_maxmemory_bytes", "Redis maxmemory; 0: no limit.")
    limit.add_metric((), float(memory["max_bytes"] or 0))
    return [up, used, limit]


def pool_families(recorded: Recorded, snap: Snapshot) -> list[Metric]:
    """Every gpulane metric family of docs/design.md, from the hash and a pool snapshot."""
    return [*_recorded_families(recorded), *_pool_gauges(snap)]


# Process metrics of this API replica (process_*, python_gc_*, python_info), in a
# registry of their own: the library's default registry is never exported, so nothing
# an imported package registers there leaks into /metrics.
_PROCESS = CollectorRegistry(auto_describe=False)
ProcessCollector(registry=_PROCESS)
PlatformCollector(registry=_PROCESS)
GCCollector(registry=_PROCESS)


class _Scrape(Collector):
    """One scrape's families followed by the process metrics."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families
        yield from _PROCESS.collect()


def render(families: list[Metric], accept: str = "") -> tuple[bytes, str]:
    """The exposition body and its content type: Prometheus text by default, OpenMetrics
    when the scraper's ``Accept`` asks for it (Prometheus itself does)."""
    encoder, content_type = choose_encoder(accept)
    return encoder(_Scrape(families)), content_type
