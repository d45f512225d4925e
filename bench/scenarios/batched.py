"""Scenario batched: the dispatcher's cost per item of batched inference, and bulk submit.

What a request's items cost when they travel together (``docs/design.md`` §4):

- drain: a class queue filled first through the real API with N items of a batched
  type (``bench.batch_noop``: a small result; ``bench.batch_vector``: a 384-float
  vector, an embedding's size, as JSON numbers; ``bench.batch_packed``: the same vector
  packed, base64 of float32, as ``embed`` gives it to ``/v1/embeddings``), submitted
  as bulk ``POST /tasks`` requests of up to 10,000 (packed into chunks of the type's
  batch size, 64); then one worker drains it. Items/s from the first chunk's start to
  the last one's end (Redis clock). ``bench.batch_device`` waits 2 ms a batch without
  the CPU, as a GPU's forward pass would hold the worker: the device's busy share is
  chunks x 2 ms over the drain's time, what is left being the dispatcher's serial work
  per batch (a GPU proxy on a machine without one).
- Redis commands per item over the whole life of those items: ``CONFIG RESETSTAT``
  before the first submit, ``INFO commandstats`` once the last chunk ended, divided
  by N (commands inside scripts counted, as in the overhead scenario; the bench's own
  completion polls subtracted).
- bulk submit: one ``gpulane api`` process, one request of 10,000 tasks, for an
  unbatched type (``bench.stamp``: 10,000 records) and a batched one (157 chunks);
  tasks/s = 10,000 / the request's wall time as the client sees it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from bench import cmdstats
from bench.gl_tasks import DEVICE_S
from bench.harness import Stack, batch_counts
from bench.report import Report, Table, Target, axes, figure, judged, save
from dispatcher.contract import keys
from testkit import wait_for

CLASS = "batch"


@dataclass(frozen=True)
class Drained:
    """A drained type: its task type, its row in the table, its bar in the chart, and
    the worker's settings for it."""

    task_type: str
    row: str
    bar: str
    settings: dict[str, str] = field(default_factory=dict)  # the worker's
    api: dict[str, str] = field(default_factory=dict)  # the API's


DEVICE_ROW = "bench.batch_device (2 ms device wait a batch, packed)"
# The API chunks nothing of the type (its batch size there is 1): a record per item.
RECORDS = {"types": json.dumps({"bench.batch_device": {"batch_max_size": 1}})}
TYPES = {
    "batch_noop": Drained("bench.batch_noop", "bench.batch_noop", "no-op"),
    "batch_vector": Drained("bench.batch_vector", "bench.batch_vector (384 floats)", "384 floats"),
    "batch_packed": Drained(
        "bench.batch_packed", "bench.batch_packed (384 float32, base64)", "384, packed"
    ),
    # The GPU proxy twice: each report inline with the next claim, then in flight while
    # the next batch runs (report_overlap; a GPU worker's default, `auto`).
    "batch_device": Drained(
        "bench.batch_device",
        f"{DEVICE_ROW}, reports inline",
        "2 ms device, inline",
        {"report_overlap": "never"},
    ),
    "batch_device_overlap": Drained(
        "bench.batch_device",
        f"{DEVICE_ROW}, reports overlapped",
        "2 ms device, overlapped",
        {"report_overlap": "always"},
    ),
    # Single submits batched across clients: a record per item (the API chunks nothing,
    # its batch size for the type being 1), 64 records a batch on the worker.
    "batch_device_records": Drained(
        "bench.batch_device",
        f"{DEVICE_ROW}, a record per item (single submits), reports overlapped",
        "2 ms device, records",
        {"report_overlap": "always"},
        RECORDS,
    ),
    # The same with each record's own log lines (DEBUG), as every record logged two at
    # INFO before a batch's lines named its tasks (worker/tasklog.py): what they cost.
    "batch_device_records_lines": Drained(
        "bench.batch_device",
        f"{DEVICE_ROW}, a record per item, reports overlapped, each record's log lines",
        "records, their lines",
        {"report_overlap": "always", "log_level": "DEBUG"},
        RECORDS,
    ),
}
# The same-run baseline: the no-op with batching off (API and worker), a task per item.
OFF = {"types": json.dumps({"bench.batch_noop": {"batch_max_size": 1}})}
# The API publishes these types' catalog at start, so it admits them with no worker up.
API = {"task_modules": '["worker.tasks.builtin","bench.gl_tasks"]'}
PER_REQUEST = 10_000


@dataclass(frozen=True)
class Size:
    items: int  # drained per type
    bulk: int  # tasks in the one bulk request
    rounds: int  # bulk requests timed (the median is reported)


SIZES = {
    "smoke": Size(items=640, bulk=500, rounds=1),
    "quick": Size(items=40_000, bulk=10_000, rounds=3),
    "full": Size(items=200_000, bulk=10_000, rounds=5),
}


def _fill(http: httpx.Client, task_type: str, n: int) -> list[str]:
    """Queue ``n`` items through bulk submits; the chunks' ids, in order."""
    chunks: list[str] = []
    for start in range(0, n, PER_REQUEST):
        tasks = [
            {"type": task_type, "args": {"n": i}} for i in range(start, min(n, start + PER_REQUEST))
        ]
        response = http.post("/tasks", json=tasks)
        response.raise_for_status()
        for item in response.json()["ids"]:
            chunk = item.rpartition(".")[0] or item
            if not chunks or chunks[-1] != chunk:
                chunks.append(chunk)
    return chunks


def _drained(client: redis.Redis, chunks: list[str], polls: list[int]) -> bool:
    polls[0] += 1
    return client.hget(keys.job(chunks[-1]), "status") in (b"finished", b"failed")


def _span(client: redis.Redis, chunks: list[str]) -> tuple[float, int]:
    """(seconds from the first start to the last end, failed chunks) on Redis' clock."""
    pipe = client.pipeline(transaction=False)
    for chunk in chunks:
        pipe.hmget(keys.job(chunk), "started_ms", "ended_ms", "status")
    rows = pipe.execute()
    starts = [int(s) for s, _, _ in rows if s]
    ends = [int(e) for _, e, _ in rows if e]
    failed = sum(1 for *_, status in rows if status != b"finished")
    return (max(ends) - min(starts)) / 1000, failed


def drain(
    stack: Stack, http: httpx.Client, task_type: str, n: int, **settings: Any
) -> dict[str, Any]:
    client = stack.client()
    cmdstats.reset(client)
    chunks = _fill(http, task_type, n)
    worker = stack.gpulane_worker(f"w-{task_type}", wait=False, **settings)
    polls = [0]
    wait_for(lambda: _drained(client, chunks, polls), 600, f"{n} items of {task_type}")
    stats = cmdstats.read(client)
    stats["hget"] -= polls[0]
    wait_for(lambda: all(s for s in _span_ready(client, chunks)), 60, "every chunk ended")
    seconds, failed = _span(client, chunks)
    batches = wait_for(lambda: _batches(http, task_type, n), 30, "the batch metrics")
    worker.stop()
    return {
        "items": n,
        "chunks": len(chunks),
        "batches": batches,
        "seconds": seconds,
        "items_per_s": n / seconds if seconds > 0 else 0.0,
        "commands_per_item": sum(stats.values()) / n,
        "failed": failed,
    }


def _batches(http: httpx.Client, task_type: str, n: int) -> int | None:
    """The batches (claims run) that ran the drain's ``n`` items, once the worker's
    metrics (flushed each heartbeat) count them all: ``gpulane_batch_size``'s count, its
    sum at least ``n`` (more if a batch ran twice)."""
    count, items = batch_counts(http.get("/metrics").text, task_type)
    return int(count) if items >= n else None


def _span_ready(client: redis.Redis, chunks: list[str]) -> list[bool]:
    pipe = client.pipeline(transaction=False)
    for chunk in chunks:
        pipe.hget(keys.job(chunk), "ended_ms")
    return [bool(v) for v in pipe.execute()]


def bulk_rate(
    http: httpx.Client, task_type: str, n: int, rounds: int, distinct: bool = False
) -> dict[str, Any]:
    """Tasks/s of one bulk request of ``n`` tasks (the median of ``rounds``): the same
    task ``n`` times (the API checks it once), or ``distinct`` ones (each checked)."""
    tasks = [{"type": task_type, "args": {"n": i} if distinct else {}} for i in range(n)]
    body = httpx.Request("POST", "/", json=tasks).content  # encoded once, outside the timing
    headers = {"content-type": "application/json"}
    seconds = []
    for _ in range(rounds):
        began = time.perf_counter()
        response = http.post("/tasks", content=body, headers=headers)
        seconds.append(time.perf_counter() - began)
        response.raise_for_status()
        assert response.json()["count"] == n
    seconds.sort()
    median = seconds[len(seconds) // 2]
    return {"tasks": n, "seconds": median, "tasks_per_s": n / median}


def measure(size: Size) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for name, drained in TYPES.items():
        with Stack() as stack:
            _, url = stack.gpulane_api([CLASS, "interactive"], **API, **drained.api)
            with httpx.Client(base_url=url, timeout=120) as http:
                data[name] = drain(stack, http, drained.task_type, size.items, **drained.settings)
    with Stack() as stack:  # a task per item: an eighth of the items keeps it short
        _, url = stack.gpulane_api([CLASS, "interactive"], **API, **OFF)
        with httpx.Client(base_url=url, timeout=120) as http:
            data["batch_off"] = drain(stack, http, "bench.batch_noop", size.items // 8, **OFF)
    with Stack() as stack:
        _, url = stack.gpulane_api([CLASS, "interactive"], **API)
        with httpx.Client(base_url=url, timeout=120) as http:
            bulk_rate(http, "bench.stamp", 10, 1)  # warm the API's first-request paths
            data["bulk_unbatched"] = bulk_rate(http, "bench.stamp", size.bulk, size.rounds)
            data["bulk_batched"] = bulk_rate(http, "bench.batch_noop", size.bulk, size.rounds)
            data["bulk_distinct"] = bulk_rate(
                http, "bench.batch_noop", size.bulk, size.rounds, distinct=True
            )
    return data


def run(size: str, outdir: Path) -> Report:
    data = measure(SIZES[size])
    report = Report("batched", size)
    noop, vector = data["batch_noop"], data["batch_vector"]
    cells = ("items", "chunks", "seconds", "items_per_s", "commands_per_item", "failed")
    rows = [
        [name, *(d[k] for k in cells)]
        for name, d in (
            *((drained.row, data[name]) for name, drained in TYPES.items()),
            ("bench.batch_noop, batching off (a task per item)", data["batch_off"]),
        )
    ]
    report.tables.append(
        Table(
            "One worker drains a filled queue (bulk-submitted: chunks of 64, or a record "
            "per item where the row says so)",
            "type | items | records | s | items/s | Redis commands per item | failed records",
            rows,
        )
    )
    bulk = [
        ["bench.stamp (unbatched: a record per task)", *_bulk_row(data["bulk_unbatched"])],
        ["bench.batch_noop (chunks of 64)", *_bulk_row(data["bulk_batched"])],
        ["bench.batch_noop, distinct args (each task checked)", *_bulk_row(data["bulk_distinct"])],
    ]
    report.tables.append(
        Table(
            "One bulk POST /tasks, one API process",
            "type | tasks | s (median) | tasks/s",
            bulk,
        )
    )
    report.targets += [
        judged("batched no-op, one worker",
               f"3,643 items/s (issue); batching off this run: "
               f"{data['batch_off']['items_per_s']:,.0f}/s", noop["items_per_s"],
               ">= 20,000 items/s", digits=0),
        judged("batched, 384-float result, one worker", "1,864 items/s", vector["items_per_s"],
               ">= 10,000 items/s", digits=0),
        judged("Redis commands per batched item (batch 64)", "13.2", noop["commands_per_item"],
               "<= 3"),
        Target("bulk submit, one API process, one request of 10,000 tasks", "-",
               ">= 20,000 tasks/s",
               f"{data['bulk_unbatched']['tasks_per_s']:,.0f} tasks/s (unbatched), "
               f"{data['bulk_batched']['tasks_per_s']:,.0f} (batched), "
               f"{data['bulk_distinct']['tasks_per_s']:,.0f} (batched, distinct args)",
               data["bulk_unbatched"]["tasks_per_s"] >= 20_000),
    ]  # fmt: skip
    report.notes.append(
        _busy_note(
            data["batch_device"],
            data["batch_device_overlap"],
            data["batch_device_records"],
            data["batch_device_records_lines"],
        )
    )
    report.charts.append(_chart(data, outdir))
    report.write(outdir)
    return report


def _chart(data: dict[str, Any], outdir: Path) -> str:
    fig, (left, right) = figure(9.0, 3.2, ncols=2)
    drained = [data[name]["items_per_s"] for name in TYPES]
    labels = [drained.bar for drained in TYPES.values()]
    _bars(left, labels, drained, "items/s", "One worker drains batched items")
    bulk = [data["bulk_unbatched"]["tasks_per_s"], data["bulk_distinct"]["tasks_per_s"]]
    _bars(right, ["unbatched", "batched, distinct"], bulk, "tasks/s", "One bulk POST of 10,000")
    return save(fig, outdir, "batched.png")


def _busy_note(
    inline: dict[str, Any],
    overlapped: dict[str, Any],
    records: dict[str, Any],
    lines: dict[str, Any],
) -> str:
    """How much of the drain a GPU would be busy: reports inline and overlapped, and
    overlapped with a record per item, without and with each record's log lines."""

    def busy(d: dict[str, Any]) -> str:
        share = d["batches"] * DEVICE_S / d["seconds"] if d["seconds"] else 0.0
        serial = (d["seconds"] / d["batches"] - DEVICE_S) * 1000
        return (
            f"busy {share:.0%} ({d['batches']} batches x {DEVICE_S * 1000:g} ms in "
            f"{d['seconds']:.2f} s; {serial:.2f} ms a batch the device waits on)"
        )

    return (
        f"bench.batch_device, the GPU proxy: the device would be {busy(inline)} with each "
        f"report inline with the next claim, and {busy(overlapped)} with the report in "
        "flight while the next batch runs (report_overlap); "
        f"{busy(records)} with a record per item, 64 records a batch (single submits "
        f"batched across clients), and {busy(lines)} when each record also logs its two "
        "lines. What the device waits on is the worker's serial dispatch work per "
        "batch: claim, decode, and (inline) report."
    )


def _bulk_row(d: dict[str, Any]) -> list[Any]:
    return [d["tasks"], d["seconds"], d["tasks_per_s"]]


def _bars(ax: Any, names: list[str], values: list[float], unit: str, title: str) -> None:
    """Two measured bars against the 20,000/s target line."""
    ax.bar(names, values, color=["tab:blue", "tab:orange"])
    ax.axhline(20_000, color="grey", linestyle="--", linewidth=1)
    axes(ax, title, y=unit)
