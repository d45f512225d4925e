"""Per-class task counts and latency percentiles for ``GET /stats`` (the dashboard).

The ``gpulane:metrics`` hash holds every observation since the metrics began, and
percentiles over all of that stop moving after a day of traffic. A
:class:`LatencyWindow` therefore remembers what the latency histograms held at a few
earlier moments of the last minutes, so /stats reports the percentiles of the tasks
that finished since then, and falls back to all-time figures only when none did.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from dispatcher.api.exporter import Histogram, Recorded
from dispatcher.contract.jobs import FINAL, TaskStatus

__all__ = ["LatencyWindow", "class_stats", "latency_by_class", "quantile", "token_stats"]

QUANTILES = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
PUBLIC_FINAL = tuple(str(s) for s in TaskStatus if s in FINAL)  # in the enum's order


def quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile``: find the bucket holding rank ``q * count``
    and interpolate linearly inside it. Beyond the last finite bound the answer is that
    bound (nothing better is known). None without observations."""
    total = cumulative[-1][1] if cumulative else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, at_or_below in cumulative:
        if at_or_below >= rank and at_or_below > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (at_or_below - below)
        lower, below = bound, at_or_below
    return lower


def latency_by_class(recorded: Recorded) -> dict[str, Histogram]:
    """The latency histogram of each class (its only label)."""
    return {labels[0]: hist for labels, hist in recorded.histograms.get("latency", {}).items()}


@dataclass(frozen=True)
class _Sample:
    at: float  # monotonic seconds
    latency: dict[str, Histogram]


class LatencyWindow:
    """Latency histograms as they were at moments of the last ``span_s`` seconds.

    Fed by each /stats call (the dashboard polls every second), so it costs nothing
    when nobody watches; a sample is kept at most every ``spacing_s`` so memory stays
    at ``span_s / spacing_s`` small dicts per API replica.
    """

    def __init__(self, span_s: float = 300.0, spacing_s: float = 5.0) -> None:
        self.span_s = span_s
        self.spacing_s = spacing_s
        self._samples: deque[_Sample] = deque()

    def since(
        self, now: float, latency: dict[str, Histogram]
    ) -> tuple[dict[str, Histogram], float] | None:
        """Record ``latency`` as of ``now``; return what was observed since the oldest
        sample still inside the span, and that sample's age. None before there is one,
        and after Redis lost its counts (a reset: start over)."""
        while self._samples and now - self._samples[0].at > self.span_s:
            self._samples.popleft()
        base = self._samples[0] if self._samples else None
        if not self._samples or now - self._samples[-1].at >= self.spacing_s:
            self._samples.append(_Sample(now, latency))
        if base is None or now <= base.at:
            return None
        delta = {
            cls: hist.minus(base.latency.get(cls, Histogram())) for cls, hist in latency.items()
        }
        if any(n < 0 for hist in delta.values() for n in hist.buckets.values()):
            self._samples.clear()
            self._samples.append(_Sample(now, latency))
            return None
        return delta, now - base.at


def _percentiles(hist: Histogram, window_s: float | None) -> dict[str, Any]:
    cumulative = hist.cumulative()
    out: dict[str, Any] = {}
    for key, q in QUANTILES:
        value = quantile(q, cumulative)
        out[key] = round(value, 6) if value is not None else None
    out["count"] = int(hist.count)
    out["window_s"] = round(window_s, 1) if window_s is not None else None
    return out


def _sum_by(series: dict[tuple[str, ...], float], cls: str, position: int) -> dict[str, int]:
    """Totals of one class's counter series, keyed by the label at ``position``."""
    out: dict[str, int] = {}
    for labels, value in series.items():
        if labels[0] == cls:
            out[labels[position]] = out.get(labels[position], 0) + int(value)
    return out


def class_stats(
    cls: str,
    recorded: Recorded,
    recent: tuple[dict[str, Histogram], float] | None,
) -> dict[str, Any]:
    """One class's entry of ``GET /stats``."""
    counters = recorded.counters
    finished = dict.fromkeys(PUBLIC_FINAL, 0)
    finished.update(_sum_by(counters.get("finished", {}), cls, 2))
    latency = latency_by_class(recorded).get(cls, Histogram())
    window_s: float | None = None
    if recent is not None and recent[0].get(cls, Histogram()).count > 0:
        latency, window_s = recent[0][cls], recent[1]
    return {
        "name": cls,
        "submitted": sum(_sum_by(counters.get("submitted", {}), cls, 1).values()),
        "rejected": _sum_by(counters.get("rejected", {}), cls, 1),
        "finished": finished,
        "requeued": sum(_sum_by(counters.get("requeued", {}), cls, 1).values()),
        "latency_s": _percentiles(latency, window_s),
    }


def token_stats(recorded: Recorded, tenant: str | None) -> dict[str, dict[str, dict[str, int]]]:
    """Model tokens used through backend workers: tenant -> model -> {prompt,
    completion}; only ``tenant``'s own unless None (an admin key, or an open API)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for (who, model, kind), value in recorded.counters.get("tokens", {}).items():
        if tenant is not None and who != tenant:
            continue
        entry = out.setdefault(who, {}).setdefault(model, {"prompt": 0, "completion": 0})
        entry[kind] = entry.get(kind, 0) + int(value)
    return out
