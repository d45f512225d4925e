"""Device-time usage for billing and quotas: ``GET /usage`` and ``/stats``' figures.

Workers measure the device time each task used (a batch's call time shared by its
items; a backend worker's slot time, ``docs/design.md`` §4 "Device time") and fold it
into Redis with every heartbeat (``heartbeat.lua``): the pool-wide counter
``gpulane_device_seconds_total{tenant,class,type}`` and the bucket of the minute the
beat fell in, ``gpulane:usage:<minute>``, in whole microseconds so that sums are
exact. A minute that has ended gets no more writes, so a read of whole past minutes
is final: a billing job that asks ``since=<the last until>`` counts each minute once.
"""

from __future__ import annotations

import math
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field
from redis.asyncio import Redis

from dispatcher.api.errors import ApiError
from dispatcher.api.exporter import Recorded
from dispatcher.contract import keys

__all__ = ["UsageReport", "device_stats", "parse_instant", "read_usage"]

MINUTE_S = 60
_READ_BATCH = 500  # buckets per pipeline


class UsageRow(BaseModel):
    tenant: str = Field(description="Tenant name (`default` on an open API).")
    cls: str = Field(alias="class")
    type: str
    device_seconds: float


class UsageReport(BaseModel):
    """What ``GET /usage`` answers."""

    since: str = Field(description="Start of the first minute counted (ISO 8601, UTC).")
    until: str = Field(description="End of the last minute counted: pass it as the next since.")
    complete: bool = Field(
        description="Every minute counted has ended: the figures will not change."
    )
    resolution_s: int = MINUTE_S
    device_seconds: float = Field(description="All tenants together.")
    tenants: dict[str, float] = Field(description="Device seconds per tenant.")
    usage: list[UsageRow] = Field(description="Per tenant, class and task type.")


def parse_instant(value: str | None, name: str) -> float | None:
    """Epoch seconds from Unix seconds or an ISO 8601 time (UTC when it names no
    zone); None when absent; 422 naming the parameter otherwise."""
    if value is None:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise _invalid(name, f"{name} must be Unix seconds or an ISO 8601 time") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = when.timestamp()
    if not math.isfinite(seconds) or not 0 <= seconds < 1e11:
        raise _invalid(name, f"{name} is out of range")
    return seconds


def _invalid(name: str, message: str) -> ApiError:
    return ApiError(422, "invalid_request", message + ".", field=name)


def _iso(minute: int) -> str:
    return datetime.fromtimestamp(minute * MINUTE_S, UTC).isoformat().replace("+00:00", "Z")


async def read_usage(
    client: Redis, retention_s: int, since: float | None, until: float | None
) -> UsageReport:
    """The usage of the whole minutes from ``since``'s to ``until``'s (exclusive; both
    rounded down to their minute). Defaults: until, through the current minute (not
    complete yet); since, one hour before until. A since older than what is kept is a
    422: a silently partial bill would be data loss."""
    now_s, now_us = await client.time()
    now = now_s + now_us / 1e6
    current = math.floor(now / MINUTE_S)
    end = current + 1 if until is None else math.floor(until / MINUTE_S)
    first = end - 60 if since is None else math.floor(since / MINUTE_S)
    if first > end:
        raise _invalid("since", "since must not be after until")
    kept_from = current - math.ceil(retention_s / MINUTE_S) + 1
    if first < kept_from:
        raise _invalid(
            "since",
            f"since is older than the usage kept (usage_retention_s {retention_s} s): "
            f"minutes from {_iso(kept_from)} on are kept",
        )
    minutes = await client.zrangebyscore(keys.USAGE_MINUTES, first, end - 1)
    rows: defaultdict[tuple[str, str, str], int] = defaultdict(int)
    for at in range(0, len(minutes), _READ_BATCH):
        pipe = client.pipeline(transaction=False)
        for minute in minutes[at : at + _READ_BATCH]:
            pipe.hgetall(keys.usage(int(_text(minute))))
        for bucket in await pipe.execute():
            for field, value in bucket.items():
                parts = _text(field).split("|")
                if len(parts) == 4 and parts[0] == "u":
                    rows[(parts[1], parts[2], parts[3])] += int(value)
    tenants: defaultdict[str, int] = defaultdict(int)
    for (tenant, _, _), us in rows.items():
        tenants[tenant] += us
    return UsageReport(
        since=_iso(first),
        until=_iso(end),
        complete=end <= current,
        device_seconds=sum(rows.values()) / 1e6,
        tenants={t: us / 1e6 for t, us in sorted(tenants.items())},
        usage=[
            UsageRow.model_validate(
                {"tenant": t, "class": c, "type": ty, "device_seconds": us / 1e6}
            )
            for (t, c, ty), us in sorted(rows.items())
        ],
    )


def device_stats(recorded: Recorded, tenant: str | None) -> dict[str, dict[str, Any]]:
    """Device seconds used since the metrics began: tenant -> {"total", "classes":
    {class: {type: seconds}}}; only ``tenant``'s own unless None (an admin key, or an
    open API)."""
    out: dict[str, dict[str, Any]] = {}
    for (who, cls, task_type), seconds in recorded.counters.get("device", {}).items():
        if tenant is not None and who != tenant:
            continue
        entry = out.setdefault(who, {"total": 0.0, "classes": {}})
        entry["total"] = round(entry["total"] + seconds, 6)
        per_class = entry["classes"].setdefault(cls, {})
        per_class[task_type] = round(per_class.get(task_type, 0.0) + seconds, 6)
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else value
