"""Pool-wide metrics, aggregated in Redis so any API replica exports the whole pool.

Processes record into a local :class:`Recorder` (no Redis command per task) and fold
what they gathered into the ``gpulane:metrics`` hash once per heartbeat with
``HINCRBY``/``HINCRBYFLOAT``, so a counter costs nothing on the task path and the
export lags by at most one heartbeat. Hash fields::

    c|<counter>|<label values...>          counter value
    h|<histogram>|<label values...>|<le>   observations in the bucket ending at le
    s|<histogram>|<label values...>        sum of observations

Label values never contain ``|``: classes, task types and tenants are validated names,
and a backend worker writes a model id's ``|`` as ``_``.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field

__all__ = [
    "BUCKETS",
    "COUNTERS",
    "HISTOGRAMS",
    "SIZE_BUCKETS",
    "Drained",
    "Recorder",
    "buckets_of",
    "le_text",
]

# Seconds; GPU work spans milliseconds (a cached inference) to an hour (a long batch).
BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
    7200.0,
    float("inf"),
)


# Seconds between a generation's tokens, or to its first: milliseconds, finer below.
TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    float("inf"),
)  # fmt: skip
# Tokens per second of one generation (gpulane_backend_tokens_per_second).
RATE_BUCKETS = (1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0, float("inf"))

# Tasks per handler call (gpulane_batch_size).
SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, float("inf"))


def le_text(bound: float) -> str:
    """Prometheus' spelling of a bucket bound (the ``le`` label and the hash fields)."""
    return "+Inf" if bound == float("inf") else repr(bound)


# Prometheus name -> label names; the short key is what the hash fields use.
COUNTERS = {
    "submitted": ("gpulane_tasks_submitted_total", ("class", "type")),
    "rejected": ("gpulane_tasks_rejected_total", ("class", "reason")),
    "finished": ("gpulane_tasks_finished_total", ("class", "type", "status")),
    "requeued": ("gpulane_tasks_requeued_total", ("class", "reason")),
    # Model tokens a backend worker's tasks used (kind: prompt | completion).
    "tokens": ("gpulane_tokens_total", ("tenant", "model", "kind")),
    # Device seconds the tasks used, as their workers measured them (a float counter,
    # written by heartbeat.lua from Recorder.use's usage with the minute's bucket).
    "device": ("gpulane_device_seconds_total", ("tenant", "class", "type")),
    # Counted by the scripts themselves (c|fenced|<report>), not through a Recorder;
    # so are a split's parts as submitted and a split task's end as finished (split.lua,
    # lib/parts.lua: no worker reports them).
    "fenced": ("gpulane_reports_fenced_total", ("report",)),
}
HISTOGRAMS = {
    "queue_wait": ("gpulane_queue_wait_seconds", ("class",)),
    "run": ("gpulane_task_run_seconds", ("class", "type")),
    "latency": ("gpulane_task_latency_seconds", ("class",)),
    "batch_size": ("gpulane_batch_size", ("type",)),
    "ttft": ("gpulane_time_to_first_token_seconds", ("backend",)),
    "tbt": ("gpulane_time_between_tokens_seconds", ("backend",)),
    "tokens_per_s": ("gpulane_backend_tokens_per_second", ("backend",)),
}
# Histograms with buckets of their own.
_OTHER_BUCKETS = {
    "batch_size": SIZE_BUCKETS,
    "ttft": TOKEN_BUCKETS,
    "tbt": TOKEN_BUCKETS,
    "tokens_per_s": RATE_BUCKETS,
}


def buckets_of(name: str) -> tuple[float, ...]:
    """The bucket bounds of histogram ``name`` (short name)."""
    return _OTHER_BUCKETS.get(name, BUCKETS)


_LE = {name: tuple(le_text(b) for b in buckets_of(name)) for name in HISTOGRAMS}


@dataclass
class Drained:
    """What a recorder gathered since the last flush, ready for heartbeat.lua."""

    counters: dict[str, int] = field(default_factory=dict)
    floats: dict[str, float] = field(default_factory=dict)
    runs: dict[str, list[float]] = field(default_factory=dict)  # class -> [sum_s, n]
    usage: dict[str, int] = field(default_factory=dict)  # tenant|class|type -> device us

    def __bool__(self) -> bool:
        return bool(self.counters or self.floats or self.runs or self.usage)


class Recorder:
    """Thread-safe local accumulator; the task thread records, the heartbeat drains."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._floats: defaultdict[str, float] = defaultdict(float)
        self._runs: dict[str, list[float]] = {}
        self._usage: Counter[str] = Counter()

    def count(self, name: str, *labels: str, n: int = 1) -> None:
        assert name in COUNTERS, name
        with self._lock:
            self._counters["|".join(("c", name, *labels))] += n

    def observe(self, name: str, seconds: float, *labels: str) -> None:
        assert name in HISTOGRAMS, name
        seconds = max(seconds, 0.0)
        le = _LE[name][bisect.bisect_left(buckets_of(name), seconds)]
        base = "|".join((name, *labels))
        with self._lock:
            self._counters[f"h|{base}|{le}"] += 1
            self._floats[f"s|{base}"] += seconds

    def run_sample(self, cls: str, seconds: float, n: int = 1) -> None:
        """``n`` items of ``cls`` ran this long each: feeds the wait estimates."""
        with self._lock:
            total = self._runs.setdefault(cls, [0.0, 0.0])
            total[0] += seconds * n
            total[1] += n

    def use(self, tenant: str, cls: str, task_type: str, seconds: float) -> None:
        """A task of ``tenant`` (``-``: none) held a device this long: its usage, kept
        to the microsecond (gpulane_device_seconds_total, GET /usage)."""
        us = round(seconds * 1e6)
        if us > 0:
            with self._lock:
                self._usage["|".join((tenant or "-", cls, task_type))] += us

    def drain(self) -> Drained:
        with self._lock:
            out = Drained(dict(self._counters), dict(self._floats), self._runs, dict(self._usage))
            self._counters.clear()
            self._floats.clear()
            self._runs = {}
            self._usage.clear()
        return out

    def restore(self, drained: Drained) -> None:
        """Put back what a failed flush took, so an outage loses no counts."""
        with self._lock:
            self._counters.update(drained.counters)
            for key, value in drained.floats.items():
                self._floats[key] += value
            for cls, (total, n) in drained.runs.items():
                cur = self._runs.setdefault(cls, [0.0, 0.0])
                cur[0] += total
                cur[1] += n
            self._usage.update(drained.usage)
