"""What one task costs Redis itself: CPU (INFO cpu, the server's own user + system
time) and memory (used_memory) per task, driving the scripts directly so nothing but
Redis work is measured. Feeds the capacity model in docs/design.md §10.

    python -m bench.redis_cost [--tasks 5000]   # writes bench/results/redis_cost.md
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from dispatcher.api.store import Submission, submit_options
from dispatcher.contract.jobs import encode_call
from dispatcher.contract.reap import lease_options
from dispatcher.contract.scripts import SyncScripts, options
from dispatcher.contract.settings import Settings
from testkit import REPO, RedisServer

SETTINGS = Settings(redis_url="redis://unused")
BATCH = 64  # records a batch, as the embed type takes them


def _mem(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def _cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _submit(s: SyncScripts, n: int, payload: bytes) -> None:
    cfg = SETTINGS.classes["batch"]
    for _ in range(n):
        sub = Submission("echo", "batch", {}, timeout_s=60, tenant="t")
        opts = submit_options(sub, cfg, workers=1, run_s=0.001, settings=SETTINGS)
        s.run("submit", opts, encode_call("echo", {"pad": "x" * 64}), payload)


def _run_all(s: SyncScripts, n: int, batch: int = 1) -> None:
    """Claim and finish every task, ``batch`` a claim (a batched type's records: one
    claim.lua and one finish.lua call for them all, as a worker makes)."""
    claim = options(worker="w", classes=SETTINGS.class_names, aging={}, was_idle=False,
                    device="{}", redeliver=False, batch={"echo": batch})  # fmt: skip
    result = json.dumps({"ok": True})
    done = 0
    for _ in range(0, n, batch):
        reports = [
            options(id=task[0].decode(), worker="w", attempt=int(task[3]), status="finished",
                    error="", progress="", ttl_s=3600, **{"class": task[1].decode()})
            for task in s.run("claim", claim)
        ]  # fmt: skip
        s.run("finish", "[" + ",".join(reports) + "]", *[result] * len(reports))
        done += len(reports)
    assert done == n, f"{done} of {n} tasks claimed: the figures would be per a wrong count"


def measure(tasks: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp), appendfsync="everysec").start()
        try:
            client = server.client()
            s = SyncScripts(client)
            rq: dict[str, Any] = {"fields": {}, "queues": [], "execution": None}  # RQ registry
            reg = options(**lease_options(SETTINGS), worker="w", info={}, catalog={}, rq=rq)
            s.run("register", reg)
            mem0, cpu0, t0 = (
                client.info("memory")["used_memory"],
                _cpu_s(client),
                time.perf_counter(),
            )
            _submit(s, tasks, b"")
            mem1, cpu1, t1 = (
                client.info("memory")["used_memory"],
                _cpu_s(client),
                time.perf_counter(),
            )
            _run_all(s, tasks)
            mem2, cpu2 = _mem(client), _cpu_s(client)
            _submit(s, 200, b"\0" * 100_000)  # uploads: held in Redis until the task ends
            mem3 = _mem(client)
            _run_all(s, 200)
            _submit(s, tasks, b"")
            cpu3 = _cpu_s(client)
            _run_all(s, tasks, BATCH)
            cpu4 = _cpu_s(client)
        finally:
            server.kill()
    return {
        "submit_cpu_us": (cpu1 - cpu0) / tasks * 1e6,
        "claim_finish_cpu_us": (cpu2 - cpu1) / tasks * 1e6,
        "batched_cpu_us": (cpu4 - cpu3) / tasks * 1e6,
        "queued_bytes": (mem1 - mem0) / tasks,
        "final_bytes": (mem2 - mem0) / tasks,
        "upload_overhead_bytes": (mem3 - mem2) / 200 - 100_000,
        "submit_wall_us": (t1 - t0) / tasks * 1e6,
    }


def report(m: dict[str, float], tasks: int) -> str:
    total = m["submit_cpu_us"] + m["claim_finish_cpu_us"]
    return "\n".join([
        "# Redis cost per task (bench/redis_cost.py)",
        "",
        f"Command: `python -m bench.redis_cost --tasks {tasks}`; Redis 7.0, AOF everysec, one",
        "client driving the scripts directly (no HTTP, no worker): Redis' own CPU",
        "(INFO cpu, user + sys) and memory (used_memory) per task. Shared 2-core machine:",
        "CPU figures include Redis' background ticks; read them as upper bounds.",
        "",
        "| measure | per task |",
        "|---|---|",
        f"| Redis CPU, submit (submit.lua) | {m['submit_cpu_us']:.0f} µs |",
        f"| Redis CPU, claim + finish | {m['claim_finish_cpu_us']:.0f} µs |",
        f"| Redis CPU, whole lifecycle (heartbeats excluded) | {total:.0f} µs |",
        f"| Redis CPU, claim + finish of a batched type's record, {BATCH} a batch | "
        f"{m['batched_cpu_us']:.0f} µs |",
        f"| → one Redis core at 100 % | ≈ {1e6 / total:,.0f} tasks/s |",
        f"| memory, queued record (small args) | {m['queued_bytes']:.0f} B |",
        f"| memory, final record kept for result_ttl_s | {m['final_bytes']:.0f} B |",
        f"| memory overhead of an upload beyond its bytes | {m['upload_overhead_bytes']:.0f} B |",
        "",
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=5000)
    args = parser.parse_args()
    text = report(measure(args.tasks), args.tasks)
    (REPO / "bench" / "results" / "redis_cost.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
