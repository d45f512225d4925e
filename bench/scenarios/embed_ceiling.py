"""Scenario embed_ceiling: ``POST /v1/embeddings`` at a GPU's speed on a machine with
none. What the dispatch path (client, API, Redis, worker) sustains once the model's
time has left the CPU, and how busy it keeps the card.

The model is ``bench.device_embed`` (:mod:`bench.gl_tasks`): batches of 64, each
holding the worker :data:`~bench.gl_tasks.DEVICE_S` (2 ms) without the CPU, as a
CUDA sync does, then a packed 384-float vector per text, as ``embed`` returns them.
Its own rate is 64 texts per 2 ms, 32,000 texts/s: about all-MiniLM-L6-v2's forward
pass on a data-centre GPU, tokenization left out (on a card that is CPU work too).

gpulane is one ``gpulane api`` process and one worker, as in ``embed_api`` (then two
API processes for (b) again, ``api_workers`` 2); the load
is ``embed_api``'s (:mod:`bench.embed_load`): (a) one call of 2,048 inputs, as floats
(what the peers' rows ask for) and as base64 (what the ``openai`` SDK asks for when
the caller names no format), :data:`CALLS` calls in a row; (b) 32 clients of 1
input; (c) 8 clients of 256. Per row: inputs/s, the card's busy share (batches the
worker ran x 2 ms / the row's wall time; the batches from ``gpulane_batch_size`` on
``/metrics``) and each process's CPU per input, which says where a real card would
wait; then each row again for Redis's time in each script per input (SLOWLOG,
:class:`bench.cmdstats.ScriptTime`): what the pool's one Redis spends on a request.

Each row's inputs/s is also given against the stand-in's own handler called in this
process on batches of 64 (:func:`in_process`, before the rows and after, as
``embed_api`` holds gpulane to ``model.encode``). The other peers are not here: neither
Infinity nor Ray Serve can be handed a model that takes no CPU. No verdicts: the
issue's targets are against in-process ``model.encode`` on a real card (``make
gpu-check``); this is where to look before one is at hand.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from bench import embed_load
from bench.cmdstats import ScriptTime
from bench.embed_load import Row
from bench.gl_tasks import DEVICE_MODEL, DEVICE_S, DEVICE_TYPE, TextArgs, device_embed
from bench.harness import Proc, Stack, batch_counts, cpu_s
from bench.report import Report, Table, axes, figure, grouped_bars, info, save
from dispatcher.contract import vectors
from dispatcher.contract.settings import ReportOverlap, Settings

BATCH = 64  # bench.device_embed's batch size
IN_PROCESS_BATCHES = 100  # the stand-in called in this process: 100 x 2 ms and more
API = {
    "task_modules": json.dumps(["worker.tasks.builtin", "bench.gl_tasks"]),
    "openai_timeout_s": "600",
}
OVERLAP = ReportOverlap(os.environ.get("BENCH_OVERLAP", ReportOverlap.ALWAYS))
# Batch counts unchanged this long: two of a worker's heartbeats, which flush them.
SETTLE_S = 2 * Settings.model_fields["heartbeat_interval_s"].default
CALLS = 5  # row (a): this many calls, one after the other


@dataclass(frozen=True)
class Size:
    load: embed_load.Size
    calls: int
    scripts: embed_load.Size  # the rerun under SLOWLOG (its entries must fit the log)


# Under SLOWLOG a single-input request logs ~24 entries (its scripts' own commands
# too): 1,024 of them keep the rerun short and far inside ScriptTime's 200,000.
SCRIPTS = embed_load.Size(2048, 1024, 16, 256, 0, 0.0, 120.0)
SIZES = {
    "smoke": Size(embed_load.SIZES["smoke"], 1, embed_load.SIZES["smoke"]),
    # (b) at ~1,000 req/s: 4,096 requests take a few seconds, not a fraction of one.
    "quick": Size(embed_load.Size(2048, 4096, 64, 256, 0, 0.0, 120.0), CALLS, SCRIPTS),
    "full": Size(embed_load.Size(2048, 16384, 256, 256, 0, 0.0, 300.0), CALLS, SCRIPTS),
}
PROCESSES = ("client", "api", "redis", "worker")
SCRIPT_NAMES = ("submit", "claim", "finish", "get", "retain")  # a request's records in Redis


@dataclass
class Measured:
    row: Row
    batches: float  # the worker's batches during the row
    cpu_s: dict[str, float]  # per process, during the row
    scripts_us: dict[str, float]  # Redis's time in each script per input (the rerun)

    @property
    def busy(self) -> float:
        """The stand-in card's busy share: its batches x DEVICE_S over the row's time."""
        return self.batches * DEVICE_S / self.row.wall_s

    def cpu_us(self, process: str) -> float:
        return 1e6 * self.cpu_s[process] / self.row.inputs

    def script_us(self, name: str) -> float:
        """Redis's time in script ``name`` per input (all scripts: ``"all"``)."""
        return sum(self.scripts_us.values()) if name == "all" else self.scripts_us.get(name, 0)


def _batches(url: str) -> tuple[float, float]:
    """The stand-in's (batches, items) so far, from the API's ``/metrics``."""
    return batch_counts(httpx.get(f"{url}/metrics", timeout=10).text, DEVICE_TYPE)


def _settled_batches(url: str, timeout_s: float = 30.0) -> tuple[float, float]:
    """:func:`_batches` once they stop moving: a worker adds its batches to Redis with
    its heartbeat (every second), so a read just after a row misses up to a second of
    them, and the next row's window would count them as its own."""
    last, since = _batches(url), time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() - since < SETTLE_S:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the worker's batch counts still moved after {timeout_s} s")
        time.sleep(0.2)
        now = _batches(url)
        if now != last:
            last, since = now, time.monotonic()
    return last


def _cpu(procs: dict[str, Proc]) -> dict[str, float]:
    own = os.times()
    return {"client": own.user + own.system, **{n: cpu_s(p.pid) for n, p in procs.items()}}


def _measure(
    stack: Stack, url: str, procs: dict[str, Proc], run: Callable[[], Row], again: Callable[[], Row]
) -> Measured:
    """``run()``, a row, with the worker's batches and each process's CPU around it;
    then ``again()``, the row at the :data:`SCRIPTS` load, for Redis's time in each script
    (logging every command slows Redis by about a third on single inputs: not during the
    first). The batches' mean size and the scripts' time per input include the row's
    warm-up requests: a handful against its hundreds. It ends with the counts settled,
    where the next row starts (a fresh worker's are at rest too)."""
    count0, items0 = _batches(url)
    cpu0 = _cpu(procs)
    row = run()
    cpu1 = _cpu(procs)
    count1, items1 = _settled_batches(url)
    with ScriptTime(stack.client()) as scripts:
        repeat = again()
        _settled_batches(url)  # and the answers' background retain calls with them
    mean = (items1 - items0) / (count1 - count0) if count1 > count0 else BATCH
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    per_input = {name: us / repeat.inputs for name, us in scripts.us.items()}
    return Measured(row, row.inputs / mean, cpu, per_input)


def _one_call(base: str, texts: list[str], size: Size, fmt: str | None) -> Row:
    """Row (a) ``size.calls`` times, one after the other, as one row (a call takes about
    a quarter of a second: one alone is noise)."""
    load = size.load
    calls = [
        asyncio.run(embed_load.one_call(base, DEVICE_MODEL, texts, load.one_call, load.max_s, fmt))
        for _ in range(size.calls)
    ]
    latencies = [c.latencies_ms[0] for c in calls]
    wall = sum(c.wall_s for c in calls)
    return Row(calls[0].label, len(calls), load.one_call * len(calls), wall, latencies)


def _row(base: str, texts: list[str], size: Size, key: str, load: embed_load.Size) -> Row:
    """Row ``key`` at ``load``: ``a`` (floats), ``a64`` (base64), ``b`` or ``c``."""
    if key.startswith("a"):
        return _one_call(base, texts, size, vectors.BASE64 if key == "a64" else None)
    return asyncio.run(embed_load.rows(base, DEVICE_MODEL, texts, load, key))[key]


def _pool(stack: Stack, api_workers: int) -> tuple[str, dict[str, Proc]]:
    """One API (``api_workers`` processes) and one stand-in worker: (API URL, procs)."""
    api, url = stack.gpulane_api(["interactive", "batch"], api_workers=api_workers, **API)
    # A worker holding a card reports a batch while it runs the next (``auto``): so
    # does the stand-in's, on a machine with no card.
    worker = stack.gpulane_worker("device", wait=False, report_overlap=OVERLAP)
    stack.wait_idle(worker, 60)
    return url, {"api": api, "redis": stack.procs[0], "worker": worker}


def in_process(texts: list[str]) -> float:
    """Texts/s of the stand-in's own handler called in this process on batches of 64,
    as ``embed_api`` holds gpulane to ``model.encode``: the card and the handler's
    packing, no dispatch (a nominal 32,000/s; sleeping 2 ms takes a little more)."""
    batch = [TextArgs(text=t) for t in texts[:BATCH]]
    started = time.perf_counter()
    for _ in range(IN_PROCESS_BATCHES):
        device_embed(batch, [])
    return IN_PROCESS_BATCHES * BATCH / (time.perf_counter() - started)


def measure(size: Size, texts: list[str]) -> dict[str, Measured]:
    """Rows (a) as floats and base64, (b) and (c) on one API process, then (b) again
    on two: single inputs are bounded by the API's time per request, which more
    processes share (``api_workers``; a GPU machine has the cores for them)."""
    out: dict[str, Measured] = {}
    for api_workers, which in ((1, ("a", "a64", "b", "c")), (2, ("b",))):
        with Stack() as stack:
            url, procs = _pool(stack, api_workers)
            for key in which:
                run = partial(_row, f"{url}/v1", texts, size, key)
                got = _measure(
                    stack, url, procs, partial(run, size.load), partial(run, size.scripts)
                )
                if api_workers > 1:
                    got.row.label += f", {api_workers} API processes"
                out[key + ("" if api_workers == 1 else str(api_workers))] = got
    return out


def run(size: str, outdir: Path) -> Report:
    chosen = SIZES[size]
    texts = embed_load.corpus(max(chosen.load.one_call, 512), "short")
    before = in_process(texts)
    measured = measure(chosen, texts)
    limit = (before + in_process(texts)) / 2  # around the rows, as embed_api's limit
    report = Report("embed_ceiling", size)
    body: list[list[Any]] = []
    for got in measured.values():
        s = got.row.summary()
        body.append([s["label"], s["inputs_per_s"], s["inputs_per_s"] / limit, s["p50_ms"]])
        body[-1] += [s["p99_ms"], 100 * got.busy, *(got.cpu_us(p) for p in PROCESSES)]
    columns = ["row", "inputs/s", "vs in-process", "p50 ms", "p99 ms", "card busy %"]
    columns += [f"{p} CPU us/input" for p in PROCESSES]
    title = f"gpulane, short texts, a card of {BATCH / DEVICE_S:,.0f} texts/s"
    report.tables.append(Table(title, columns, body))
    scripts = [
        [m.row.label, *(m.script_us(n) for n in SCRIPT_NAMES), m.script_us("all")]
        for m in measured.values()
    ]
    columns = ["row", *(f"{n}.lua" for n in SCRIPT_NAMES), "all scripts"]
    report.tables.append(
        Table("Redis's time in its scripts, us per input (SLOWLOG)", columns, scripts)
    )
    for got in measured.values():
        report.targets.append(
            info(
                f"/v1/embeddings at GPU speed, {got.row.label}",
                f"the stand-in's handler in-process, same run: {limit:,.0f} texts/s",
                f"{got.row.inputs_per_s:,.0f} inputs/s = {got.row.inputs_per_s / limit:.2f}x, "
                f"card busy {100 * got.busy:.0f} %, "
                f"API {got.cpu_us('api'):,.0f} us CPU per input",
            )
        )
    report.notes.append(
        f"In-process, the stand-in's handler on batches of {BATCH}, texts/s before the rows "
        f"and after: {before:,.0f}, then {2 * limit - before:,.0f}."
    )
    report.notes.append(
        f"Row (a) is {chosen.calls} call(s) one after the other (p50 and p99 over them); "
        "the busy share counts the batches the worker ran during a row, its "
        "warm-up requests included."
    )
    report.charts.append(_chart(measured, outdir))
    report.write(outdir)
    return report


def _chart(measured: dict[str, Measured], outdir: Path) -> str:
    fig, ax = figure(8.0, 3.4)
    ticks = ["1 x 2,048 floats", "1 x 2,048 base64", "32 x 1", "8 x 256", "32 x 1, 2 APIs"]
    series = {p: [m.cpu_us(p) for m in measured.values()] for p in PROCESSES}
    grouped_bars(ax, series, ticks)
    axes(ax, "CPU per input at GPU speed, by process", y="us per input", legend=8)
    return save(fig, outdir, "embed_ceiling.png")
