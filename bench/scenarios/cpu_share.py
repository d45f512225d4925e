"""Scenario cpu_share: ``gpulane up`` on a host with no GPU, its CPU workers pinned each
to its own share of the CPUs (``cpu_pinning``, the default) against the same workers
unpinned, and against one worker, on ``/v1/embeddings``.

Why it matters: a model on the CPU runs as many threads as its process may use CPUs.
Two workers that may each use every core run twice the threads the host has, and
OpenMP's threads wait on each other at every operator (``dispatcher.contract.cpus``).

Each system is a whole ``gpulane up --workers N`` (its API and N ``embed`` workers,
on the bench's Redis), started, loaded with :mod:`bench.embed_load`'s rows, and
stopped, one at a time: (a) one call of 2,048 short texts and (b) 32 concurrent
clients of 1 input, judged in inputs/s against in-process ``model.encode`` at batch
64 on the same texts, measured before the first system and after each (each system
is held to the mean of the two around it: this machine drifts 10-30 % within
minutes). The systems run in alternating order, ``rounds`` times (pinned, unpinned,
one; then one, unpinned, pinned), and each row reports the mean of its rounds.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import embed_load
from bench.embed_load import Row
from bench.harness import Stack, bench_device, classes_json
from bench.report import Report, Table, axes, figure, grouped_bars, info, judged, save
from bench.scenarios.embed_api import API, MODEL
from dispatcher.contract.workers import NOT_SERVING
from testkit import CLI, free_port, wait_for

__all__ = ["SIZES", "run"]


@dataclass(frozen=True)
class Size:
    load: str  # embed_load's size
    rows: str  # embed_load.rows' ``which``
    rounds: int


SIZES = {
    "smoke": Size("smoke", "b", 1),  # smoke's one call (64 inputs) is one worker's batch
    "quick": Size("quick", "ab", 2),
    "full": Size("quick", "ab", 4),
}


@dataclass(frozen=True)
class System:
    name: str
    workers: int
    pinning: bool


SYSTEMS = (
    System("2 workers, pinned (default)", 2, True),
    System("2 workers, unpinned", 2, False),
    System("1 worker", 1, True),
)
ROWS = {"a": "1 call of 2,048", "b": "32 clients x 1", "l": "1 client x 32, one at a time"}
LONE = (32, 8)  # inputs a request (one chunk: one worker's batch), requests


async def _lone(base_url: str, texts: list[str]) -> embed_load.Row:
    """A lone client's requests, one at a time, each one worker's batch: what pinning
    costs a pool with nothing else to do (one worker's share of the cores, not all)."""
    inputs, requests = LONE
    return await embed_load.closed_loop(
        base_url, MODEL, texts, clients=1, per_request=inputs, requests=requests, max_s=120
    )


@contextmanager
def _up(stack: Stack, system: System, round_no: int) -> Iterator[tuple[str, list[str]]]:
    """``gpulane up`` serving ``system`` on the stack's Redis; yields its ``/v1`` URL
    and each worker's ``cpus`` once every worker is serving (its model loaded)."""
    port = free_port()
    tag = f"up-{system.workers}-{'pinned' if system.pinning else 'unpinned'}-{round_no}"
    env = stack.env(
        port=port,
        classes=classes_json(["interactive", "batch"]),
        cpu_pinning=str(system.pinning).lower(),
        **API,
    )
    argv = [*CLI, "up", "--workers", str(system.workers), "--redis-url", stack.url]
    argv += ["--port", str(port), "--data-dir", str(stack.logdir / tag)]
    proc = stack.spawn(tag, argv, env)
    url = f"http://127.0.0.1:{port}"

    def serving() -> list[dict[str, Any]] | None:
        proc.check()
        try:
            workers: list[dict[str, Any]] = httpx.get(f"{url}/workers").json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None  # the API not up yet
        ready = [w for w in workers if w["state"] not in NOT_SERVING]
        return workers if len(ready) == system.workers == len(workers) else None

    try:
        workers = wait_for(serving, 240, interval_s=0.5, what=f"{system.name} serving")
        yield f"{url}/v1", sorted(str(w["device"]["cpus"]) for w in workers)
    finally:
        proc.stop(60)  # its workers finish, deregister and exit first


@dataclass(frozen=True)
class Measured:
    """One row of one round, and the in-process rate it is held to (the mean of the
    rates measured just before and just after its system)."""

    row: Row
    limit: float

    @property
    def ratio(self) -> float:
        return self.row.inputs_per_s / self.limit

    @property
    def p50_ms(self) -> float:
        return float(self.row.summary()["p50_ms"])


Runs = dict[str, dict[str, list[Measured]]]  # system -> row key -> one a round


def measure(size: Size) -> dict[str, Any]:
    load = embed_load.SIZES[size.load]
    texts = embed_load.corpus(max(load.one_call, load.encode_texts, 512), "short")
    order = [s for r in range(size.rounds) for s in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1])]
    runs: Runs = {s.name: {k: [] for k in size.rows + "l"} for s in SYSTEMS}
    cpus: dict[str, list[str]] = {}
    limits = [embed_load.in_process(texts[: load.encode_texts])]
    with Stack() as stack:
        for i, system in enumerate(order):
            with _up(stack, system, i) as (base_url, held):
                rows = asyncio.run(embed_load.rows(base_url, MODEL, texts, load, size.rows))
                rows["l"] = asyncio.run(_lone(base_url, texts))
                cpus[system.name] = held
            limits.append(embed_load.in_process(texts[: load.encode_texts]))
            for key, row in rows.items():
                runs[system.name][key].append(Measured(row, (limits[-2] + limits[-1]) / 2))
    return {"runs": runs, "cpus": cpus, "limits": limits, "order": order}


def _mean(measured: list[Measured], of: Callable[[Measured], float]) -> float:
    return statistics.fmean(of(m) for m in measured) if measured else float("nan")


def _ratio(m: Measured) -> float:
    return m.ratio


def _p50(m: Measured) -> float:
    return m.p50_ms


def _rate(m: Measured) -> float:
    return m.row.inputs_per_s


def run(size: str, outdir: Path) -> Report:
    chosen = SIZES[size]
    data = measure(chosen)
    runs: Runs = data["runs"]
    report = Report("cpu_share", size)
    pinned, unpinned, one = (s.name for s in SYSTEMS)
    for key in chosen.rows:
        what, mine = ROWS[key], _mean(runs[pinned][key], _ratio)
        others = (
            f"unpinned {_mean(runs[unpinned][key], _ratio):.2f}x, "
            f"1 worker {_mean(runs[one][key], _ratio):.2f}x"
        )
        name = f"`up`, 2 CPU workers pinned, {what}, vs in-process encode"
        # One call of 2,048 keeps both workers busy: the pool's throughput, judged.
        report.targets.append(
            judged(name, others, mine, ">= 0.9x")
            if key == "a"
            else info(name, others, f"{mine:.2f}x")
        )
    lone = {n: _mean(runs[n]["l"], _p50) for n in (pinned, unpinned, one)}
    report.targets.append(
        info(
            f"p50 of a lone request of {LONE[0]} inputs (one worker's batch), pinned",
            f"unpinned {lone[unpinned]:.0f} ms, 1 worker {lone[one]:.0f} ms",
            f"{lone[pinned]:.0f} ms",
        )
    )
    body = []
    for name, by_row in runs.items():
        for key, measured in by_row.items():
            each = ", ".join(f"{m.ratio:.2f}x" for m in measured)
            ratio, p50 = _mean(measured, _ratio), _mean(measured, _p50)
            body.append([name, ROWS[key], _mean(measured, _rate), ratio, each, p50])
    columns = ["system", "row", "inputs/s", "vs in-process", "each round", "p50 ms"]
    report.tables.append(Table("`gpulane up` on the CPU, /v1/embeddings (means)", columns, body))
    held = "; ".join(f"{name}: {', '.join(c)}" for name, c in data["cpus"].items())
    report.notes += [
        f"Each worker's `cpus` (GET /workers): {held}.",
        "In-process model.encode, inputs/s, before the first system and after each: "
        + ", ".join(f"{x:,.0f}" for x in data["limits"])
        + ".",
        "Order: " + ", then ".join(s.name for s in data["order"]) + ".",
        f"Device: {bench_device()}; each system is a whole `gpulane up`, one at a time.",
    ]
    report.charts.append(_chart(runs, chosen.rows, outdir))
    report.write(outdir)
    return report


def _chart(runs: Runs, rows: str, outdir: Path) -> str:
    """Each system's mean ratio to in-process encode, per row; 1.0 as a line."""
    fig, ax = figure(7.0, 3.4)
    bars = {name: [_mean(by_row[k], _ratio) for k in rows] for name, by_row in runs.items()}
    grouped_bars(ax, bars, [ROWS[k] for k in rows])
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="in-process")
    axes(ax, "`gpulane up` on the CPU: /v1/embeddings", y="x in-process encode", legend=8)
    return save(fig, outdir, "cpu_share.png")
