"""Scenario 1, overhead: no-op tasks through the whole path, against plain RQ.

Two identical ``redis-server`` instances (same binary, same configuration) run side by
side, one per system, so command counts never mix; latency samples alternate between
the systems so both see the same machine load.

- Submit->start latency on an idle worker. gpulane: ``POST /tasks`` to ``gpulane api``
  returned -> the ``bench.stamp`` handler began in an idle ``gpulane worker``. Plain
  RQ: ``Queue.enqueue`` returned -> the same no-op began in an idle ``SimpleWorker``
  (JSON serializer). Both handlers return ``time.time()`` at entry (same host clock).
- Throughput: a queue of no-ops filled first, then 1 (or 4) fresh workers started on
  it, for every system alike (:func:`window_rate`): tasks per second between handler
  starts, over the span every worker was running.
- Redis commands per task: ``INFO commandstats`` deltas (Lua-internal commands
  included) at saturation (heartbeats, leases, metrics and the API's maintenance
  amortized in) and for one isolated task on an idle worker (submit, dequeue, start,
  finish, park again; windows hit by a periodic heartbeat are discarded), plus one
  lifecycle recorded with ``MONITOR`` to split client round trips from Lua-internal
  commands and list them.
- Celery beside RQ in the throughput table (when ``scripts/bench-peers-venv.sh`` has
  made ``.venv-peers``; else its cells say so): a third identical ``redis-server`` as
  broker and result backend, the queue filled with N ``bench.celery.stamp`` no-ops
  first, then 1 (or 4) ``celery worker --pool solo -c 1 --prefetch-multiplier 1``
  (``task_acks_late=True``) started on it, timed as the others are.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from rq import Queue

from bench import celery_tasks, cmdstats, peers
from bench.glside import (
    RQ_FUNC,
    Submitter,
    gl_done,
    gl_results,
    rq_done,
    rq_fill,
    rq_queue,
    rq_results,
)
from bench.harness import Proc, Stack
from bench.report import Report, Table, axes, cdf, figure, grouped_bars, judged, p50_p99, save
from dispatcher.contract import keys
from dispatcher.contract.jobs import FINAL_STATUSES
from testkit import wait_for

CLASSES = ["interactive", "batch"]
TYPE = "bench.stamp"
RQ_QUEUE = "plain"
NAMES = {"gpulane": "gpulane", "rq": "plain RQ", "celery": "Celery"}  # in the chart
FINAL = {status.encode() for status in FINAL_STATUSES}


@dataclass(frozen=True)
class Size:
    latency: int  # samples per system
    windows: int  # isolated command-count windows per system
    tasks_1: int  # saturation run, 1 worker
    tasks_4: int  # saturation run, 4 workers
    background_s: float  # idle window measuring background commands per second


SIZES = {
    "smoke": Size(latency=5, windows=2, tasks_1=100, tasks_4=150, background_s=0.3),
    "quick": Size(latency=120, windows=10, tasks_1=2000, tasks_4=4000, background_s=2.0),
    "full": Size(latency=1000, windows=30, tasks_1=10_000, tasks_4=15_000, background_s=5.0),
}


@dataclass
class Systems:
    """Everything the scenario drives: one stack per system and their clients."""

    gl: Stack
    rq: Stack
    http: httpx.Client
    gl_client: redis.Redis
    rq_client: redis.Redis
    queue: Queue
    workers: list[Proc]  # the latency and command-count workers, one per system


# -- latency ------------------------------------------------------------------------
def _gl_sample(sys_: Systems) -> tuple[float, float]:
    t0 = time.time()
    reply = sys_.http.post("/tasks", json={"type": TYPE})
    t1 = time.time()
    key = keys.job(reply.json()["id"])
    wait_for(lambda: sys_.gl_client.hget(key, "status") in FINAL, 10, "a no-op", interval_s=0.005)
    started = gl_results(sys_.gl_client, [reply.json()["id"]])[0]["t"]
    return started - t1, started - t0


def _rq_sample(sys_: Systems) -> tuple[float, float]:
    t0 = time.time()
    job = sys_.queue.enqueue(RQ_FUNC)
    t1 = time.time()
    wait_for(lambda: rq_done(sys_.rq_client, [job.id]), 10, "an RQ no-op", interval_s=0.005)
    started = float(job.return_value(refresh=True)["t"])  # type: ignore[index]
    return started - t1, started - t0


def latency(sys_: Systems, n: int) -> dict[str, dict[str, list[float]]]:
    """Alternating samples; ms from submit returned ('ret') and from submit called ('call')."""
    out: dict[str, dict[str, list[float]]] = {s: {"ret": [], "call": []} for s in ("gpulane", "rq")}
    for _ in range(n):
        for name, sample in (("gpulane", _gl_sample), ("rq", _rq_sample)):
            time.sleep(0.015)  # the worker is parked again (idle) before the next submit
            ret, call = sample(sys_)
            out[name]["ret"].append(ret * 1000)
            out[name]["call"].append(call * 1000)
    return out


# -- commands per isolated task -----------------------------------------------------
def _isolated(
    client: redis.Redis, submit: Any, done: Any, background: set[str]
) -> Counter[str] | None:
    cmdstats.reset(client)
    task_id = submit()
    time.sleep(0.1)
    stats = cmdstats.read(client)
    if not done(task_id) or any(stats[c] for c in background):
        return None  # not finished in the window, or a heartbeat landed in it
    return stats


def isolated_counts(sys_: Systems, n: int) -> dict[str, list[Counter[str]]]:
    gl_bg = cmdstats.BACKGROUND
    out: dict[str, list[Counter[str]]] = {"gpulane": [], "rq": []}
    tries = 0
    while min(len(v) for v in out.values()) < n and tries < n * 6:
        tries += 1
        if len(out["gpulane"]) < n:
            got = _isolated(
                sys_.gl_client,
                lambda: sys_.http.post("/tasks", json={"type": TYPE}).json()["id"],
                lambda i: gl_done(sys_.gl_client, [i]),
                gl_bg,
            )
            if got is not None:
                out["gpulane"].append(got)
        if len(out["rq"]) < n:
            got = _isolated(
                sys_.rq_client,
                lambda: sys_.queue.enqueue(RQ_FUNC).id,
                lambda i: rq_done(sys_.rq_client, [i]),
                set(),
            )
            if got is not None:
                out["rq"].append(got)
    return out


def traces(sys_: Systems) -> dict[str, cmdstats.Monitor]:
    """One clean lifecycle per system recorded with MONITOR."""
    out: dict[str, cmdstats.Monitor] = {}
    for _ in range(10):
        if "gpulane" not in out:
            with cmdstats.Monitor(sys_.gl.client()) as mon:
                sys_.http.post("/tasks", json={"type": TYPE})
                time.sleep(0.1)
            names = {label.split(" ")[0].lower() for _, label in mon.lines}
            labels = {label for _, label in mon.lines}
            clean = not (names & cmdstats.BACKGROUND) and not any(
                lbl.startswith(("EVALSHA heartbeat", "EVALSHA reap")) for lbl in labels
            )
            if clean:
                out["gpulane"] = mon
        if "rq" not in out:
            with cmdstats.Monitor(sys_.rq.client()) as mon:
                sys_.queue.enqueue(RQ_FUNC)
                time.sleep(0.1)
            out["rq"] = mon
        if len(out) == 2:
            break
    return out


# -- throughput at saturation -------------------------------------------------------
def window_rate(stamps: list[dict[str, Any]]) -> dict[str, Any]:
    """Tasks/s between handler starts (``{"t", "w"}``: when, which worker process) over
    the span every worker that took tasks was running: workers boot one by one on a
    full queue, so from the moment the last of them began its first task to the moment
    the first of them began its last. On one worker: its first start to its last. A
    worker that began a single task (booted as the queue ran dry) bounds no span."""
    by_worker: dict[Any, list[float]] = {}
    for r in stamps:
        by_worker.setdefault(r["w"], []).append(r["t"])
    spans = [ts for ts in by_worker.values() if len(ts) > 1] or list(by_worker.values())
    begin = max(min(ts) for ts in spans)
    end = min(max(ts) for ts in spans)
    inside = [r["t"] for r in stamps if begin <= r["t"] <= end]
    rate = (len(inside) - 1) / (end - begin) if end > begin else float("nan")
    return {"rate": rate, "workers_seen": len(spans), "window_tasks": len(inside)}


def _running(procs: list[Proc]) -> bool:
    """True; a worker that exited (died booting, say) fails the run with its log
    instead of leaving a wait to run to its deadline."""
    for proc in procs:
        proc.check()
    return True


def _stop(procs: list[Proc]) -> None:
    """SIGTERM them all first: the workers wind down together, not one by one."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.stop()


def _saturate(
    client: redis.Redis,
    queue_key: str,
    fill: Any,
    start: Any,
    done: Any,
    results: Any,
    done_reads: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """Fill the queue, then start the workers on it (as Celery's are: no system's
    workers share the machine with its submitter), and time their starts.
    ``done_reads``: what one ``done`` poll sends (command, count; default an HGET per
    task), left out of the command counts."""
    counting = cmdstats.Counting()
    cmdstats.reset(client)
    t0 = time.monotonic()
    ids = fill()
    procs: list[Proc] = start()

    def drained() -> bool:
        counting.add("llen")
        return _running(procs) and not client.llen(queue_key)

    def finished() -> bool:
        counting.add(*(done_reads or ("hget", len(ids))))
        return _running(procs) and bool(done(ids))

    wait_for(drained, 60 + len(ids) / 50, "the queue to drain", interval_s=0.05)
    wait_for(finished, 30, "the last tasks", interval_s=0.02)
    wall = time.monotonic() - t0
    stats = counting.net(cmdstats.read(client))
    _stop(procs)
    return {"n": len(ids), "stats": stats, "wall_s": wall, **window_rate(results(ids))}


def saturation(sys_: Systems, n: int, workers: int) -> dict[str, dict[str, Any]]:
    """gpulane and plain RQ, one after the other: ``n`` no-ops queued, then ``workers``
    fresh workers started on them (the latency workers are stopped by then)."""
    submitter = Submitter(sys_.gl_client, CLASSES)
    gl = _saturate(
        sys_.gl_client,
        keys.queue("batch"),
        lambda: submitter.fill(n, TYPE, {}, "batch"),
        lambda: [sys_.gl.gpulane_worker(f"gw{workers}-{i}", wait=False) for i in range(workers)],
        lambda ids: gl_done(sys_.gl_client, ids),
        lambda ids: gl_results(sys_.gl_client, ids),
    )
    rq = _saturate(
        sys_.rq_client,
        f"rq:queue:{RQ_QUEUE}",
        lambda: rq_fill(sys_.queue, n),
        lambda: [
            sys_.rq.rq_worker(f"rq{workers}-{i}", RQ_QUEUE, wait=False) for i in range(workers)
        ],
        lambda ids: rq_done(sys_.rq_client, ids),
        lambda ids: rq_results(sys_.rq_client, ids),
    )
    return {"gpulane": gl, "rq": rq}


# -- Celery (from the peers venv) ----------------------------------------------------
def _celery_fill(stack: Stack, n: int) -> list[str]:
    """N Celery no-ops enqueued by ``python -m bench.celery_tasks fill`` in the peers venv."""
    env = {**stack.env(), **peers.OFFLINE, "BENCH_CELERY_URL": stack.url}
    argv = [str(peers.PYTHON), "-m", "bench.celery_tasks", "fill", str(n)]
    out = subprocess.run(argv, env=env, cwd=peers.REPO, capture_output=True, text=True, check=True)
    ids: list[str] = json.loads(out.stdout)
    return ids


def _celery_stamps(client: redis.Redis, ids: list[str]) -> list[dict[str, Any]] | None:
    """Every task's result (``{"t", "w"}``) once all are stored, else None."""
    records = []
    for raw in client.mget(celery_tasks.results_keys(ids)):
        if raw is None:
            return None
        records.append(json.loads(raw))
    failed = [r for r in records if r["status"] != "SUCCESS"]
    if failed:
        raise RuntimeError(f"{len(failed)} Celery no-ops failed: {failed[0]!r}")
    return [r["result"] for r in records]


def celery_saturation(stack: Stack, n: int, workers: int) -> dict[str, Any]:
    """A queue of ``n`` no-ops, then ``workers`` solo workers started on it; tasks/s
    over the span every worker was running (see the module docstring)."""
    client = stack.client()
    env = {**stack.env(), **peers.OFFLINE, "BENCH_CELERY_URL": stack.url}
    env["PATH"] = peers.peer_env()["PATH"]
    argv = celery_tasks.worker_argv
    return _saturate(
        client,
        celery_tasks.QUEUE,
        lambda: _celery_fill(stack, n),
        lambda: [
            stack.spawn(f"celery{i}", argv(peers.VENV, f"celery{i}"), env) for i in range(workers)
        ],
        lambda ids: _celery_stamps(client, ids) is not None,
        lambda ids: _celery_stamps(client, ids),
        done_reads=("mget", 1),
    )


def background_rate(client: redis.Redis, seconds: float) -> float:
    cmdstats.reset(client)
    time.sleep(seconds)
    return sum(cmdstats.read(client).values()) / seconds


# -- the run ------------------------------------------------------------------------
def _start(gl: Stack, rq: Stack) -> Systems:
    _, url = gl.gpulane_api(CLASSES)
    workers = [gl.gpulane_worker("gw0"), rq.rq_worker("rq0", RQ_QUEUE)]
    rq_client = rq.client()
    return Systems(
        gl=gl,
        rq=rq,
        http=httpx.Client(base_url=url, timeout=30),
        gl_client=gl.client(),
        rq_client=rq_client,
        queue=rq_queue(rq_client, RQ_QUEUE),
        workers=workers,
    )


def measure(size: Size) -> dict[str, Any]:
    with ExitStack() as stacks:
        gl, rq = stacks.enter_context(Stack()), stacks.enter_context(Stack())
        celery = stacks.enter_context(Stack()) if peers.installed() else None
        sys_ = _start(gl, rq)
        # Warm both paths (script loading, imports on first call) before measuring.
        for _ in range(3):
            _gl_sample(sys_)
            _rq_sample(sys_)
        data: dict[str, Any] = {"latency": latency(sys_, size.latency)}
        data["isolated"] = isolated_counts(sys_, size.windows)
        data["traces"] = traces(sys_)
        data["bg"] = {
            "gpulane": background_rate(sys_.gl_client, size.background_s),
            "rq": background_rate(sys_.rq_client, size.background_s),
        }
        _stop(sys_.workers)  # every system's saturation workers start on a full queue
        data["sat1"] = saturation(sys_, size.tasks_1, 1)
        if celery is not None:
            data["sat1"]["celery"] = celery_saturation(celery, size.tasks_1, 1)
        data["sat4"] = saturation(sys_, size.tasks_4, 4)
        if celery is not None:
            data["sat4"]["celery"] = celery_saturation(celery, size.tasks_4, 4)
        sys_.http.close()
        return data


def run(size: str, outdir: Path) -> Report:
    data = measure(SIZES[size])
    report = Report("overhead", size)
    _latency_section(report, data)
    _throughput_section(report, data)
    _commands_section(report, data)
    report.charts.append(_chart(data, outdir))
    report.write(outdir)
    return report


# -- report -------------------------------------------------------------------------
def _latency_section(report: Report, data: dict[str, Any]) -> None:
    lat = data["latency"]
    rows = []
    for name, label in (("gpulane", "gpulane (HTTP POST /tasks)"), ("rq", "plain RQ (enqueue)")):
        ret, call = lat[name]["ret"], lat[name]["call"]
        rows.append([label, *p50_p99(ret), *p50_p99(call), len(ret)])
    report.tables.append(
        Table(
            "Submit -> handler start on an idle worker (ms)",
            "system | p50 from submit returned | p99 | p50 from submit called | p99 | n",
            rows,
            "'From submit returned' is the DESIGN metric (negative: the worker started the task "
            "before the client had read the reply). 'From submit called' adds the submit "
            "round trip itself (HTTP for gpulane, one Redis pipeline for RQ).",
        )
    )
    g50, g99 = p50_p99(lat["gpulane"]["ret"])
    base = "RQ here: p50 {:.2f} ms, p99 {:.2f} ms".format(*p50_p99(lat["rq"]["ret"]))
    report.targets += [
        judged("POST returned -> started, p50", base, g50, "<= 1.5 ms"),
        judged("POST returned -> started, p99", base, g99, "<= 5 ms"),
    ]


def _throughput_section(report: Report, data: dict[str, Any]) -> None:
    rows = []
    for workers, key in ((1, "sat1"), (4, "sat4")):
        gl, rq = data[key]["gpulane"], data[key]["rq"]
        cel = data[key].get("celery")
        celery_cells = (
            [cel["rate"], gl["rate"] / cel["rate"]] if cel else [peers.NOT_INSTALLED, "n/a"]
        )
        rows.append(
            [workers, gl["rate"], rq["rate"], gl["rate"] / rq["rate"], *celery_cells, gl["n"]]
        )
    report.tables.append(
        Table(
            "No-op tasks per second, saturated queue",
            "workers | gpulane /s | plain RQ /s | gpulane / RQ | Celery /s | gpulane / Celery | "
            "tasks per run",
            rows,
            "Every system alike: the queue filled first, then its 1 (or 4) workers "
            "started on it; tasks/s between handler starts over the span every worker that "
            "took tasks was running (on 1 worker: its first start to its last). gpulane runs "
            "with leases, heartbeats and metrics on (defaults: 1 s heartbeat, 3 s lease). "
            "Plain RQ: SimpleWorker. Celery (peers venv): solo pool, prefetch 1, acks late, "
            "Redis broker and results. Workers timed (a worker that began a single task is "
            "left out) / tasks in that span, 1 then "
            "4 workers: "
            + "; ".join(
                f"{NAMES[name]} {data['sat1'][name]['workers_seen']}/"
                f"{data['sat1'][name]['window_tasks']}, {data['sat4'][name]['workers_seen']}/"
                f"{data['sat4'][name]['window_tasks']}"
                for name in data["sat4"]
            )
            + ".",
        )
    )
    gl, rq = data["sat1"]["gpulane"]["rate"], data["sat1"]["rq"]["rate"]
    report.targets.append(
        judged(
            "no-op tasks/s, 1 worker",
            f"plain RQ here: {rq:,.0f}/s",
            gl / rq,
            ">= 1.0x RQ",
            f"{gl:,.0f}/s = {gl / rq:.2f}x",
        )
    )


TXN = ("multi", "exec", "watch")


def _median_counter(windows: list[Counter[str]]) -> Counter[str]:
    """The window whose total is the median (a real lifecycle, not a blend)."""
    if not windows:
        return Counter()
    ordered = sorted(windows, key=lambda c: sum(c.values()))
    return ordered[len(ordered) // 2]


def _per_task(stats: Counter[str], n: int) -> tuple[float, float, float]:
    total = sum(stats.values()) / n
    return total, stats["evalsha"] / n, sum(stats[c] for c in TXN) / n


def _commands_section(report: Report, data: dict[str, Any]) -> None:
    iso = {k: _median_counter(v) for k, v in data["isolated"].items()}
    rows = []
    cases = [("isolated task, idle worker (median window)", iso["gpulane"], 1, iso["rq"], 1)]
    for workers, key in ((1, "sat1"), (4, "sat4")):
        gl, rq = data[key]["gpulane"], data[key]["rq"]
        cases.append(
            (f"saturation, {workers} worker(s)", gl["stats"], gl["n"], rq["stats"], rq["n"])
        )
    for label, gstats, gn, rstats, rn in cases:
        g_total, g_eval, _ = _per_task(gstats, gn)
        r_total, _, r_txn = _per_task(rstats, rn)
        rows.append([label, g_total, g_eval, r_total, r_total - r_txn, g_total / r_total])
    n_windows = {k: len(v) for k, v in data["isolated"].items()}
    report.tables.append(
        Table(
            "Redis commands per task (INFO commandstats, Lua-internal commands included)",
            "case | gpulane | of which EVALSHA | plain RQ | RQ without MULTI/EXEC/WATCH | "
            "gpulane / RQ",
            rows,
            f"Clean isolated windows: gpulane {n_windows['gpulane']}, RQ {n_windows['rq']}. "
            "Saturation rows include the workers' start-up (they start on the full queue). "
            f"Background with nothing to do: gpulane {data['bg']['gpulane']:.1f} commands/s "
            f"(API maintenance, worker heartbeat and reaper), RQ {data['bg']['rq']:.1f}/s.",
        )
    )
    _trace_tables(report, data, iso)
    g_total = sum(iso["gpulane"].values())
    r_total = sum(iso["rq"].values())
    report.targets.append(
        judged(
            "Redis commands per task, whole lifecycle",
            f"plain RQ here: {r_total}",
            g_total,
            "<= 30",
            f"{g_total}",
        )
    )


def _trace_tables(report: Report, data: dict[str, Any], iso: dict[str, Counter[str]]) -> None:
    traces: dict[str, cmdstats.Monitor] = data["traces"]
    rows = []
    for name in ("gpulane", "rq"):
        if name in traces:
            client, lua = traces[name].counts
            rows.append([name, client, lua, client + lua])
    report.tables.append(
        Table(
            "One isolated lifecycle recorded with MONITOR",
            "system | client round trips (commands sent) | Lua-internal | total",
            rows,
        )
    )
    names = sorted(
        set(iso["gpulane"]) | set(iso["rq"]), key=lambda c: -(iso["gpulane"][c] + iso["rq"][c])
    )
    report.tables.append(
        Table(
            "Isolated lifecycle by command (median window)",
            "command | gpulane | plain RQ",
            [[c.upper(), iso["gpulane"][c], iso["rq"][c]] for c in names],
        )
    )
    for name, mon in traces.items():
        listing = "\n".join(("    lua: " if lua else "") + label for lua, label in mon.lines)
        report.notes.append(
            f"{name} lifecycle (MONITOR):\n\n<details><summary>{len(mon.lines)} commands"
            f"</summary>\n\n```\n{listing}\n```\n</details>\n"
        )


def _chart(data: dict[str, Any], outdir: Path) -> str:
    fig, (left, right) = figure(9.0, 3.4, ncols=2)
    for name, label in (("gpulane", "gpulane"), ("rq", "plain RQ")):
        cdf(left, data["latency"][name]["ret"], label=label)
    axes(
        left,
        "Submit->start, idle worker",
        "submit returned -> handler start (ms)",
        "fraction of tasks",
        legend=10,
    )
    sat = ("sat1", "sat4")
    bars = {
        label: [data[k][name]["rate"] for k in sat]
        for name, label in NAMES.items()
        if all(name in data[k] for k in sat)
    }
    grouped_bars(right, bars, ["1 worker", "4 workers"])
    axes(right, "Throughput, saturated", y="no-op tasks / s", legend=10)
    return save(fig, outdir, "overhead.png")
