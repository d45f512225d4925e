"""Redis failover under load, with Sentinel: a master, one replica and three sentinels
(all started here, on loopback), the API and two workers configured with the
sentinels and ``min_replica_acks = 1``. The master is SIGKILLed while 300 submits are
under way, and restarted once the sentinels promoted the replica (as systemd would):
they make it a replica of the new master, so one replica can confirm writes again. Every task that got a 202 (or its replay) ends on the new master, none runs
twice, clients see only 202/200/503 (never a 500), and the time from the kill to the
first 202 of a request sent after it is written to bench/results/failover.md.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from dispatcher.contract import keys
from dispatcher.contract.settings import Settings
from testkit import REPO, TEST_TASKS, ApiServer, RedisServer, WorkerProcess, wait_for, worker_env
from testkit.procs import publish_catalog
from testkit.sentinel import SentinelServer

pytestmark = pytest.mark.slow

MASTER = "gpulane"
TASKS = 300
KILL_AFTER = 100  # accepted submits before the master dies
LIVENESS = {"heartbeat_interval_s": 0.5, "lease_ttl_s": 3.0}
ACKS = {"min_replica_acks": 1, "replica_ack_timeout_s": 1.0}


@dataclass
class Cluster:
    master: RedisServer
    replica: RedisServer
    sentinels: list[SentinelServer]
    workers: list[WorkerProcess] = field(default_factory=list)
    api: ApiServer | None = None

    def addresses(self) -> list[str]:
        return [s.address for s in self.sentinels]

    def stop(self) -> None:
        for proc in self.workers:
            proc.kill()
        if self.api is not None:
            self.api.stop()
        for server in [*self.sentinels, self.master, self.replica]:
            server.kill()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    master = RedisServer(tmp_path / "master").start()
    replica = RedisServer(tmp_path / "replica", replicaof=f"127.0.0.1 {master.port}")
    sentinels = [SentinelServer(tmp_path / f"s{i}", MASTER, master.port) for i in range(3)]
    made = Cluster(master, replica, sentinels)
    try:
        replica.start()
        wait_for(
            lambda: replica.client().info("replication").get("master_link_status") == "up",
            10,
            what="the replica to sync",
        )
        for sentinel in sentinels:
            sentinel.start()
        # A failover needs every sentinel to know the replica and the other sentinels.
        wait_for(
            lambda: all(
                s.state().get("num-slaves") == 1 and s.state().get("num-other-sentinels") == 2
                for s in sentinels
            ),
            30,
            what="the sentinels to discover each other and the replica",
        )
        yield made
    finally:
        made.stop()


def _start_pool(cluster: Cluster) -> httpx.Client:
    sentinels = cluster.addresses()
    settings = Settings(redis_sentinels=sentinels, redis_sentinel_master=MASTER, **LIVENESS, **ACKS)
    publish_catalog(cluster.master.client())
    cluster.api = ApiServer(settings).start()
    for i in range(2):
        env = worker_env(
            cluster.master.url,  # ignored but for credentials: the sentinels name the master
            redis_sentinels=json.dumps(sentinels),
            redis_sentinel_master=MASTER,
            log_format="json",
            **LIVENESS,
            **ACKS,
        )
        args = ["--gpu", "none", "--tasks", f"worker.tasks.builtin,{TEST_TASKS}"]
        cluster.workers.append(WorkerProcess(f"ha{i}", env, args))
    client = cluster.master.client()
    wait_for(
        lambda: all(client.hget(keys.worker(w.name), "state") == b"idle" for w in cluster.workers),
        20,
        what="both workers to serve",
    )
    return httpx.Client(base_url=cluster.api.url, timeout=30)


@dataclass
class Load:
    """What the submitting clients saw."""

    codes: Counter[int] = field(default_factory=Counter)
    ids: dict[int, str] = field(default_factory=dict)  # submit number -> task id
    accepted_after_kill: list[float] = field(default_factory=list)  # seconds after kill
    killed_at: float | None = None  # monotonic
    lock: threading.Lock = field(default_factory=threading.Lock)

    def accepted(self) -> int:
        with self.lock:
            return len(self.ids)


def _submit(http: httpx.Client, n: int, load: Load) -> None:
    """One task, resubmitted with its Idempotency-Key after each 503 (as documented)."""
    body = {"type": "sleep", "args": {"seconds": 0.02}}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        sent = time.monotonic()
        try:
            reply = http.post("/tasks", json=body, headers={"Idempotency-Key": f"ha-{n}"})
        except httpx.TransportError:
            time.sleep(0.1)
            continue
        with load.lock:
            load.codes[reply.status_code] += 1
            if reply.status_code in (200, 202):
                load.ids[n] = reply.json()["id"]
                if load.killed_at is not None and sent > load.killed_at:
                    load.accepted_after_kill.append(time.monotonic() - load.killed_at)
                return
        if reply.status_code != 503:
            return  # anything else is a failure the test reports
        time.sleep(0.1)


def _runs_per_task(workers: list[WorkerProcess]) -> Counter[str]:
    """How many times each task started, from the workers' JSON logs."""
    starts: Counter[str] = Counter()
    for proc in workers:
        for line in proc.output().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("message") == "task started":
                starts[entry["task"]] += 1
    return starts


def _write_result(load: Load, took_s: float, failover_s: float) -> None:
    first = min(load.accepted_after_kill)
    lines = [
        "# Redis failover under load (tests/test_sentinel.py)",
        "",
        "Master + 1 replica + 3 sentinels on loopback (`down-after-milliseconds 1000`,",
        "`failover-timeout 3000`), API and 2 workers with `min_replica_acks = 1`;",
        f"the master SIGKILLed after {KILL_AFTER} of {TASKS} accepted submits (8 clients,",
        "each resubmitting with its Idempotency-Key after a 503), and restarted as soon",
        "as the sentinels had promoted the replica: until it is back as a replica, no",
        "write can get its one replica ack, so submits answer 503 and workers wait.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| kill → first `202` of a request sent after the kill | {first:.2f} s |",
        f"| kill → sentinels name the new master | {failover_s:.2f} s |",
        f"| answers | {dict(sorted(load.codes.items()))} |",
        f"| all {TASKS} tasks final on the new master, after the kill | {took_s:.1f} s |",
        "| tasks run twice | 0 |",
        "",
    ]
    if os.environ.get("GPULANE_UPDATE_RESULTS") == "1":  # else a test run leaves no diff
        (REPO / "bench" / "results" / "failover.md").write_text("\n".join(lines))
    print("\n".join(lines))


def test_master_killed_under_load_loses_nothing(cluster: Cluster) -> None:
    http = _start_pool(cluster)
    load = Load()
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_submit, http, n, load) for n in range(TASKS)]
        wait_for(lambda: load.accepted() >= KILL_AFTER, 60, what="submits before the kill")
        cluster.master.kill()
        load.killed_at = time.monotonic()
        probe = cluster.sentinels[0]
        wait_for(
            lambda: probe.master_port() == cluster.replica.port,
            30,
            what="the sentinels to fail over",
        )
        failover_s = time.monotonic() - load.killed_at
        # Restarted as a supervisor would: the sentinels turn it into a replica of the
        # new master, and with it min_replica_acks = 1 can be met again.
        cluster.master.start()
        for future in futures:
            future.result()
    assert set(load.codes) <= {200, 202, 503}, load.codes  # never a 500
    assert len(load.ids) == TASKS, f"{TASKS - len(load.ids)} submits never accepted"
    assert load.accepted_after_kill, "no submit was accepted after the kill"
    new_master = cluster.replica.client()
    finals = {b"finished", b"failed", b"canceled"}
    wait_for(
        lambda: all(new_master.hget(keys.job(i), "status") in finals for i in load.ids.values()),
        90,
        what="every accepted task to end on the new master",
    )
    took_s = time.monotonic() - load.killed_at
    statuses = Counter(new_master.hget(keys.job(i), "status") for i in load.ids.values())
    assert statuses == {b"finished": TASKS}, statuses
    runs = _runs_per_task(cluster.workers)
    assert set(load.ids.values()) <= set(runs), "a finished task never started?"
    twice = {task: n for task, n in runs.items() if n > 1}
    assert not twice, f"ran more than once with no worker dead: {twice}"
    assert all(w.alive() for w in cluster.workers)
    _write_result(load, took_s, failover_s)
