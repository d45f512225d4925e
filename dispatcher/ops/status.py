"""Terminal views for `gpulane status` and `gpulane submit --wait` (rich tables)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from dispatcher.client import Client, NotFound, Unauthorized

__all__ = ["pool_view", "show_status"]

_PRESSURE_STYLE = {"ok": "green", "high": "yellow", "full": "bold red"}


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _bytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f}G"


def _device(device: dict[str, Any] | None) -> str:
    if not device:
        return "-"
    if device.get("kind") != "gpu":
        return "cpu"
    util = device.get("utilization")
    used, total = device.get("memory_used_bytes"), device.get("memory_total_bytes")
    index = device.get("index")
    label = f"gpu{index}" if index is not None else str(device.get("uuid", "gpu"))
    parts = [f"{label} {device.get('name', '')}"]
    if util is not None:
        parts.append(f"{util * 100:.0f}%")
    if total:
        parts.append(f"{_bytes(used)}/{_bytes(total)}")
    if device.get("temperature_c") is not None:
        parts.append(f"{device['temperature_c']:.0f}°C")
    if device.get("power_w") is not None:
        parts.append(f"{device['power_w']:.0f}W")
    return " ".join(parts)


def pool_view(queues: dict[str, Any], workers: dict[str, Any] | None) -> Group:
    classes = Table(title="classes (priority order)", title_justify="left")
    for column in (
        "class",
        "depth",
        "running",
        "workers",
        "busy",
        "oldest wait",
        "est. wait",
        "pressure",
    ):
        classes.add_column(column, justify="left" if column in ("class", "pressure") else "right")
    for c in queues["classes"]:
        style = _PRESSURE_STYLE.get(c["pressure"], "")
        classes.add_row(
            c["name"],
            str(c["depth"]),
            str(c["running"]),
            str(c["workers"]),
            str(c["busy_workers"]),
            _seconds(c["oldest_wait_s"]),
            _seconds(c["estimated_wait_s"]),
            f"[{style}]{c['pressure']}[/]",
        )
    parts: list[Any] = [classes]
    if workers is not None:
        table = Table(title=f"workers ({len(workers['workers'])} live)", title_justify="left")
        for column in (
            "name",
            "host",
            "state",
            "device",
            "classes",
            "current task",
            "done",
            "failed",
        ):
            table.add_column(column, justify="right" if column in ("done", "failed") else "left")
        for w in workers["workers"]:
            table.add_row(
                w["name"],
                w["host"] or "-",
                w["state"],
                _device(w["device"]),
                ",".join(w["classes"]),
                _current(w),
                str(w["tasks_done"]),
                str(w["tasks_failed"]),
            )
        parts.append(table)
    return Group(*parts)


def _fetch(client: Client) -> Group:
    queues = client.queues()
    try:
        workers: dict[str, Any] | None = client.workers()
    except (NotFound, Unauthorized):
        workers = None  # not an admin key: classes only
    return pool_view(queues, workers)


def show_status(client: Client, watch: bool, interval_s: float = 1.0) -> None:
    console = Console()
    if not watch:
        console.print(_fetch(client))
        return
    with Live(_fetch(client), console=console, refresh_per_second=4, screen=False) as live:
        while True:
            time.sleep(interval_s)
            live.update(_fetch(client))


def _current(worker: dict[str, Any]) -> str:
    """The task it runs, and how many more its batch holds."""
    current = worker.get("current_task")
    if not current:
        return "-"
    extra = len(worker.get("current_batch") or []) - 1
    return f"{current} (+{extra} in batch)" if extra > 0 else str(current)
