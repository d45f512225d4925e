"""Scenario 8, embed: embedding throughput and latency of one worker, with and without
dynamic batching, against the model called in-process (the limit on this machine).

The model is the ``embed`` task's (all-MiniLM-L6-v2, ``gpulane[models]``) on the
worker's device: the CPU here (``--gpu none``). Texts are generated sentences of 8-40
words, the same list for every configuration. Three measurements:

- limit: this process loads the model and calls ``model.encode(texts)`` on batches of
  64 (the ``embed`` batch size) in the texts' order, as the worker takes them off the
  queue, until every text is embedded, no worker running; once before and once after
  the worker runs (a shared machine drifts), the mean is the limit;
- saturated throughput: a queue filled with N ``embed`` tasks (``submit.lua``, as the
  API makes them) before one worker (model loaded, idle, warmed by one untimed drain
  of the same texts) drains it, with batching off
  (``GPULANE_TYPES='{"embed": {"batch_max_size": 1}}'``) and on (the type's own
  ``Batch(max_size=64, max_wait_ms=5)``); tasks/s from the first start to the last
  end (Redis clock);
- latency at 50 % load: Poisson arrivals at half the batching-off throughput measured
  just before, submit to end (Redis clock), for both configurations.

Each worker is started fresh and measured only once its model is loaded (``idle``).
Not run on a GPU yet: on one, the worker loads the model on ``cuda``.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench.glside import Submitter, gl_done, records
from bench.harness import Stack, bench_device
from bench.report import Report, Table, axes, figure, grouped_bars, judged, p50_p99, save
from dispatcher.contract import keys
from dispatcher.contract.jobs import encode_call
from dispatcher.contract.scripts import source
from testkit import wait_for

CLASS = "batch"
BATCH = 64
TASKS = "worker.tasks.builtin,worker.tasks.embed"
CONFIGS = {"batching off": {"embed": {"batch_max_size": 1}}, "batching on": {}}
WORDS = [
    *("the", "a", "queue", "worker", "model", "batch", "latency", "token", "vector"),
    *("search", "index", "query", "document", "gpu", "memory", "cache", "request"),
    *("answer", "system", "fast", "slow", "data", "user", "time", "small", "large"),
    *("running", "tasks", "over", "under", "between", "network", "storage", "sentence"),
]


@dataclass(frozen=True)
class Size:
    tasks: int  # saturated queue
    load_s: float  # length of the 50 % load phase
    limit_texts: int  # texts embedded in-process


SIZES = {
    "smoke": Size(tasks=32, load_s=1.0, limit_texts=64),
    # 10 batches: at 3 (192 tasks), runs a minute apart read 0.73x and 0.84x.
    "quick": Size(tasks=640, load_s=8.0, limit_texts=640),
    "full": Size(tasks=4096, load_s=30.0, limit_texts=4096),
}


def texts(n: int, seed: int = 12) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(8, 40))) for _ in range(n)]


_WARMED: set[int] = set()  # corpora in_process_limit has passed over once


def in_process_limit(corpus: list[str], whole: bool = False) -> float:
    """Texts/s of ``model.encode`` at ``batch_size`` :data:`BATCH` in this process.

    ``whole``: one call over the corpus, as a client holding all its texts writes it
    (sentence-transformers sorts them by length, so each batch of 64 holds like
    lengths and pads little; ``/v1/embeddings`` packs a request's inputs the same
    way). Otherwise one call per 64 texts in the corpus's order: what a worker draining
    a queue of single texts, first come first served, can batch. Texts of mixed
    lengths run at about twice the rate whole (2 CPU cores)."""
    from worker.tasks import embed

    encode = {"batch_size": BATCH, "normalize_embeddings": True, "show_progress_bar": False}
    if "model" not in embed._loaded:  # loaded once per process: the limit is measured twice
        embed.load_model(bench_device())
    model = embed._loaded["model"]
    seen = hash(tuple(corpus))
    if seen not in _WARMED:
        # The first sight of each padded shape builds its kernels: without one untimed
        # pass over a new corpus, its first limit read ~15 % under the later ones.
        model.encode(corpus, **encode)
        _WARMED.add(seen)
    else:
        model.encode(corpus[:BATCH], **encode)  # the model's threads awake again
    call = len(corpus) if whole else BATCH  # texts per model.encode call
    started = time.perf_counter()
    for i in range(0, len(corpus), call):
        model.encode(corpus[i : i + call], **encode)
    return len(corpus) / (time.perf_counter() - started)


def _fill(submitter: Submitter, corpus: list[str]) -> list[str]:
    """Enqueue one task per text in one MULTI: the worker finds the queue full, not
    trickling in (a trickle would measure how fast this process submits)."""
    script = submitter.client.register_script(source("submit"))
    pipe = submitter.client.pipeline(transaction=True)
    for text in corpus:  # options per task: they carry its new id
        opts = submitter.options("embed", CLASS)
        script(keys=[], args=[opts, encode_call("embed", {"text": text}), b""], client=pipe)
    ids = [reply[1].decode() for reply in pipe.execute()]
    assert len(set(ids)) == len(corpus), "submits were replayed, not accepted"
    return ids


def _start(stack: Stack, name: str, types: dict[str, Any]) -> None:
    proc = stack.gpulane_worker(name, tasks=TASKS, types=json.dumps(types))
    stack.wait_idle(proc, 180)  # the model loaded


def _batch_stats(client: redis.Redis) -> tuple[float, float]:
    """(batches, tasks) recorded so far for embed (flushed once per heartbeat)."""
    raw: dict[bytes, bytes] = client.hgetall(keys.METRICS)  # type: ignore[assignment]
    count = sum(float(v) for k, v in raw.items() if k.startswith(b"h|batch_size|embed|"))
    return count, float(raw.get(b"s|batch_size|embed", b"0"))


def _saturated(stack: Stack, submitter: Submitter, corpus: list[str]) -> dict[str, float]:
    client = stack.client()
    before = _batch_stats(client)
    ids = _fill(submitter, corpus)
    wait_for(lambda: gl_done(client, ids), 600, "the embed queue to drain", interval_s=0.05)
    rows = records(client, ids)
    assert all(r["status"] == "finished" for r in rows), "an embed task failed"
    first = min(r["started_ms"] for r in rows)
    last = max(r["ended_ms"] for r in rows)
    # The batch sizes reach the metrics hash with the workers' next heartbeat.
    after = wait_for(
        lambda: s if (s := _batch_stats(client))[1] - before[1] >= len(ids) else None,
        10,
        "the batch sizes in the metrics",
    )
    batches = after[0] - before[0]
    return {
        "rate": len(ids) / ((last - first) / 1000),
        "mean_batch": (after[1] - before[1]) / batches if batches else float("nan"),
    }


def _loaded(
    stack: Stack, submitter: Submitter, corpus: list[str], rate: float, span_s: float
) -> dict[str, float]:
    """Poisson arrivals at ``rate``/s for ``span_s``: latency percentiles (ms)."""
    client = stack.client()
    rng = random.Random(7)
    ids: list[str] = []
    start = time.monotonic()
    due = 0.0
    while due < span_s:
        pause = start + due - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        ids.append(submitter.submit("embed", {"text": corpus[len(ids) % len(corpus)]}, CLASS))
        due += rng.expovariate(rate)
    wait_for(lambda: gl_done(client, ids), 600, "the loaded phase to drain", interval_s=0.05)
    lat = [r["ended_ms"] - r["created_ms"] for r in records(client, ids)]
    p50, p99 = p50_p99(lat)
    return {"tasks": len(ids), "p50": p50, "p99": p99, "max": max(lat)}


def measure(size: Size) -> dict[str, Any]:
    corpus = texts(max(size.tasks, size.limit_texts))
    before = in_process_limit(corpus[: size.limit_texts])
    out: dict[str, Any] = {}
    load_rate = None
    for name, types in CONFIGS.items():
        with Stack() as stack:
            _start(stack, f"embed-{name.split()[-1]}", types)
            submitter = Submitter(stack.client(), [CLASS])
            # One untimed drain first, as the limit gets one untimed pass: a fresh
            # worker's first batches build their shapes' kernels and fault in their
            # memory, 2-4x slower for ~3 batches after this process ran the model.
            _saturated(stack, submitter, corpus[: size.tasks])
            sat = _saturated(stack, submitter, corpus[: size.tasks])
            load_rate = load_rate or 0.5 * sat["rate"]  # half of batching off's capacity
            out[name] = {**sat, "load_rate": load_rate}
            out[name].update(_loaded(stack, submitter, corpus, load_rate, size.load_s))
    after = in_process_limit(corpus[: size.limit_texts])  # the machine drifts: both ends
    out["limits"] = [before, after]
    out["limit"] = (before + after) / 2
    return out


def run(size: str, outdir: Path) -> Report:
    data = measure(SIZES[size])
    off, on, limit = data["batching off"], data["batching on"], data["limit"]
    configs = {"batching off": off, "batching on": on}
    report = Report("embed", size)
    in_process = ["in-process model.encode, batches of 64 (limit)", limit, BATCH, 1.0]
    report.tables.append(
        Table(
            "Embedding throughput, one CPU worker, saturated queue",
            "configuration | texts/s | mean batch | x limit | x batching off",
            [[*in_process, limit / off["rate"]]]
            + [[n, d["rate"], d["mean_batch"], d["rate"] / limit, d["rate"] / off["rate"]]
               for n, d in configs.items()],
        )
    )  # fmt: skip
    report.tables.append(
        Table(
            f"Latency at 50 % load ({off['load_rate']:.1f} tasks/s, Poisson), submit to end",
            "configuration | tasks | p50 ms | p99 ms | max ms",
            [[n, *(d[k] for k in ("tasks", "p50", "p99", "max"))] for n, d in configs.items()],
        )
    )
    ratio_limit, p99_ratio = on["rate"] / limit, on["p99"] / off["p99"]
    report.targets += [
        judged("embed throughput, batching on vs in-process encode", f"{limit:.0f}/s", ratio_limit,
               ">= 0.85x", f"{on['rate']:.0f}/s = {ratio_limit:.2f}x"),
        judged("embed throughput, batching on vs off", f"{off['rate']:.0f}/s",
               on["rate"] / off["rate"], ">= 3x"),
        judged("embed p99 at 50 % load, batching on vs off", f"{off['p99']:.0f} ms", p99_ratio,
               "<= 2x", f"{on['p99']:.0f} ms = {p99_ratio:.2f}x"),
    ]  # fmt: skip
    report.notes.append(f"Device: {bench_device()} (`BENCH_GPU` sets the workers' `--gpu`).")
    report.notes.append(
        "In-process limit before / after the workers ran: "
        + " / ".join(f"{x:.1f}" for x in data["limits"])
        + " texts/s."
    )
    report.charts.append(_chart(data, outdir))
    report.write(outdir)
    return report


def _chart(data: dict[str, Any], outdir: Path) -> str:
    fig, (left, right) = figure(9.0, 3.2, ncols=2)
    names = ["limit", "batching off", "batching on"]
    rates = [data["limit"], data["batching off"]["rate"], data["batching on"]["rate"]]
    left.bar(names, rates, color=["grey", "tab:orange", "tab:blue"])
    axes(left, "Saturated throughput, one worker", y="texts/s")
    configs = ["batching off", "batching on"]
    grouped_bars(right, {key: [data[c][key] for c in configs] for key in ("p50", "p99")}, configs)
    axes(right, "Latency at 50 % load", y="ms", legend=8)
    return save(fig, outdir, "embed.png")
