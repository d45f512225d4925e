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
import re
from collections import defaultdict
from typing import Any

from pydantic import BaseModel, Field
from redis.asyncio import Redis

from dispatcher.api.errors import ApiError
from dispatcher.api.exporter import Recorded
from dispatcher.contract import keys
from dispatcher.contract.jobs import iso_ms
from dispatcher.contract.scripts import as_text

__all__ = ["INSTANT_PATTERN", "UsageReport", "device_stats", "parse_instant", "read_usage"]

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
    partial: bool = Field(
        description="The span asked for starts before the usage kept (usage_retention_s): "
        "`since` says where the figures really start."
    )
    resolution_s: int = MINUTE_S
    device_seconds: float = Field(description="All tenants together.")
    tenants: dict[str, float] = Field(description="Device seconds per tenant.")
    usage: list[UsageRow] = Field(description="Per tenant, class and task type.")


# The form since and until take (the OpenAPI schema says it too): Unix seconds.
INSTANT_PATTERN = r"^[0-9]{1,11}(\.[0-9]{1,6})?$"
_INSTANT = re.compile(INSTANT_PATTERN)


def parse_instant(value: str | None, name: str) -> float | None:
    """Epoch seconds from Unix seconds (``INSTANT_PATTERN``); None when absent; 422
    naming the parameter otherwise."""
    if value is None:
        return None
    if not _INSTANT.fullmatch(value):
        raise _invalid(name, f"{name} must be Unix seconds (digits, an optional fraction)")
    return float(value)


def _invalid(name: str, message: str) -> ApiError:
    return ApiError(422, "invalid_request", message + ".", field=name)


def _iso(minute: int) -> str:
    return str(iso_ms(minute * MINUTE_S * 1000))  # as task records write times


async def read_usage(
    client: Redis, retention_s: int, since: float | None, until: float | None
) -> UsageReport:
    """The usage of the whole minutes from ``since``'s to ``until``'s (exclusive; both
    rounded down to their minute). Defaults: until, through the current minute (not
    complete yet); since, one hour before until. A since older than what is kept starts
    at what is kept, and the reply says so (``partial``, its ``since``): never a silently
    partial bill."""
    now_s, now_us = await client.time()
    now = now_s + now_us / 1e6
    current = math.floor(now / MINUTE_S)
    end = current + 1 if until is None else math.floor(until / MINUTE_S)
    first = end - 60 if since is None else math.floor(since / MINUTE_S)
    first = min(first, end)  # since after until: an empty span, said as such
    kept_from = current - math.ceil(retention_s / MINUTE_S) + 1
    partial = first < kept_from  # asked for more than is kept: the reply says where it starts
    first = max(first, min(kept_from, end))
    minutes = await client.zrangebyscore(keys.USAGE_MINUTES, first, end - 1)
    rows: defaultdict[tuple[str, str, str], int] = defaultdict(int)
    for at in range(0, len(minutes), _READ_BATCH):
        pipe = client.pipeline(transaction=False)
        for minute in minutes[at : at + _READ_BATCH]:
            pipe.hgetall(keys.usage(int(as_text(minute))))
        for bucket in await pipe.execute():
            for field, value in bucket.items():
                parts = as_text(field).split("|")
                if len(parts) == 4 and parts[0] == "u":
                    rows[(parts[1], parts[2], parts[3])] += int(value)
    tenants: defaultdict[str, int] = defaultdict(int)
    for (tenant, _, _), us in rows.items():
        tenants[tenant] += us
    return UsageReport(
        since=_iso(first),
        until=_iso(end),
        complete=end <= current,
        partial=partial,
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
