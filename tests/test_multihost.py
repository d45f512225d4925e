"""gpulane across hosts: a Redis host, an API host and two worker hosts, each a network
namespace, joined by a bridge (testkit.netns). Normal flow, a partition of a busy
worker host longer than a lease (its task runs again on the other host; when the link
heals its late report is fenced and it rejoins), and a degraded network (netem delay
50 ms, loss 1 % between the workers and Redis), measured against the clean network
into bench/results/multihost.md.

The test process itself is on no host: it observes Redis through a Unix socket and
talks to the API through a Unix socket it hands to the API process (both outside the
network namespaces), so the only network traffic is between the hosts.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from dispatcher.contract import keys
from testkit import (
    CLI,
    REPO,
    TEST_TASKS,
    http_ok,
    publish_catalog,
    redis_answers,
    redis_argv,
    wait_for,
)
from testkit.netns import Hosts, netns_unavailable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable())),
]

HOSTS = ["redis", "api", "w1", "w2"]
LIVENESS = {"GPULANE_HEARTBEAT_INTERVAL_S": "0.5", "GPULANE_LEASE_TTL_S": "3.0"}
FINAL = {b"finished", b"failed", b"canceled"}
PASSWORD = "gl13-multihost"  # Redis listens beyond loopback (on the test's bridge)


@dataclass
class Pool:
    hosts: Hosts
    tmp: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests" / "support")])
        env["GPULANE_REDIS_URL"] = f"redis://:{PASSWORD}@{self.hosts.address['redis']}:6379/0"
        env["GPULANE_LOG_FORMAT"] = "text"
        return {**env, **LIVENESS}

    def spawn(self, name: str, host: str, argv: list[str], **kwargs: Any) -> None:
        self.logs[name] = self.tmp / f"{name}.log"
        out = self.logs[name].open("wb")
        self.procs[name] = subprocess.Popen(
            self.hosts.command(host, argv), stdout=out, stderr=subprocess.STDOUT, **kwargs
        )

    def output(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[Pool, redis.Redis, httpx.Client]]:
    hosts = Hosts(f"gl13-{os.getpid()}", HOSTS)
    made = Pool(hosts, tmp_path)
    try:
        hosts.build()
        sock = tmp_path / "redis.sock"
        binary = shutil.which("redis-server") or "redis-server"
        argv = redis_argv(binary, 6379, tmp_path, bind=hosts.address["redis"],
                          unixsocket=str(sock), unixsocketperm="700", requirepass=PASSWORD)  # fmt: skip
        made.spawn("redis", "redis", argv)
        r = redis.Redis(unix_socket_path=str(sock), password=PASSWORD, socket_timeout=5)
        wait_for(lambda: sock.exists() and redis_answers(r), 10, what="redis on its host")
        publish_catalog(r)
        api_sock = tmp_path / "api.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(api_sock))
        listener.listen(128)
        fd = listener.fileno()
        cli = CLI
        made.spawn("api", "api", [*cli, "api", "--fd", str(fd)], env=made.env(), pass_fds=[fd])
        listener.close()
        for host in ("w1", "w2"):
            argv = [*cli, "worker", "--name", host, "--gpu", "none", "--tasks",
                    f"worker.tasks.builtin,{TEST_TASKS}"]  # fmt: skip
            made.spawn(host, host, argv, env=made.env())
        wait_for(
            lambda: all(r.hget(keys.worker(w), "state") == b"idle" for w in ("w1", "w2")),
            30,
            what="both worker hosts to serve",
        )
        transport = httpx.HTTPTransport(uds=str(api_sock))
        with httpx.Client(transport=transport, base_url="http://api", timeout=30) as http:
            wait_for(lambda: http_ok("/health", http), 20, what="the API host")
            yield made, r, http
    finally:
        made.stop()
        hosts.cleanup()


def _run_batch(r: redis.Redis, http: httpx.Client, n: int, seconds: float) -> dict[str, Any]:
    """Submit n tasks, wait for all; throughput and latency from the records."""
    body = {"type": "sleep", "args": {"seconds": seconds}}
    start = time.monotonic()
    ids = [http.post("/tasks", json=body).json()["id"] for _ in range(n)]
    wait_for(
        lambda: all(r.hget(keys.job(i), "status") in FINAL for i in ids),
        120,
        what=f"{n} tasks to end",
    )
    took = time.monotonic() - start
    rows = [r.hmget(keys.job(i), "status", "created_ms", "ended_ms", "worker_name") for i in ids]
    latency = sorted((int(row[2]) - int(row[1])) / 1000 for row in rows)
    return {
        "statuses": {row[0] for row in rows},
        "workers": {row[3] for row in rows},
        "rate": n / took,
        "p50": statistics.median(latency),
        "p95": latency[int(0.95 * (len(latency) - 1))],
    }


def _fenced(r: redis.Redis) -> int:
    return sum(int(v) for k, v in r.hgetall(keys.METRICS).items() if k.startswith(b"c|fenced|"))


def test_hosts_flow_partition_fencing_and_netem(
    pool: tuple[Pool, redis.Redis, httpx.Client], tmp_path: Path
) -> None:
    made, r, http = pool
    # Normal flow: submitted on the API host, run on both worker hosts.
    clean = _run_batch(r, http, 40, 0.05)
    assert clean["statuses"] == {b"finished"}
    assert clean["workers"] == {b"w1", b"w2"}

    # Partition: cut the busy worker host's link for longer than a lease. The task runs
    # to its end on the cut-off host meanwhile (each run appends a line to `ends`); its
    # report waits for the link.
    ends = tmp_path / "ends"
    args = {"path": str(ends), "tag": "ended", "seconds": 2}
    task = http.post("/tasks", json={"type": "test.record", "args": args}).json()["id"]
    busy = wait_for(lambda: r.hget(keys.job(task), "worker_name"), 10, what="a start").decode()
    other = "w2" if busy == "w1" else "w1"
    fenced_before = _fenced(r)
    made.hosts.cut(busy)
    cut_at = time.monotonic()
    try:
        wait_for(lambda: r.hget(keys.job(task), "worker_name") == other.encode(), 15,
                 what="the task to run again on the other host")  # fmt: skip
        rerun_s = time.monotonic() - cut_at
        record = r.hgetall(keys.job(task))
        assert record[b"attempts"] == b"2"
        wait_for(  # both runs ended, the stale one while cut off
            lambda: ends.exists() and len(ends.read_text().split()) == 2, 15, what="two runs"
        )
    finally:
        made.hosts.heal(busy)
    wait_for(lambda: _fenced(r) > fenced_before, 30, what="the stale report to be fenced")
    wait_for(lambda: r.hget(keys.job(task), "status") in FINAL, 30, what="the rerun to end")
    final = r.hgetall(keys.job(task))
    assert (final[b"status"], final[b"worker_name"], final[b"attempts"]) == (
        b"finished",
        other.encode(),
        b"2",
    )
    wait_for(
        lambda: (
            r.zscore(keys.WORKERS, busy) is not None
            and r.hget(keys.worker(busy), "state") == b"idle"
        ),
        20,
        what="the partitioned worker to rejoin",
    )
    assert made.procs[busy].poll() is None

    # Degraded network between the workers and Redis.
    how = _degrade(made, r)
    degraded = _run_batch(r, http, 40, 0.05)
    assert degraded["statuses"] == {b"finished"}
    assert len(degraded["workers"]) == 2
    _write_result(clean, degraded, rerun_s, how)


def _degrade(made: Pool, r: redis.Redis) -> str:
    """50 ms delay and 1 % loss between each worker host and Redis: tc netem where the
    kernel has it; else the workers are restarted behind testkit.slowlink, a relay in
    their own namespace that delays every chunk 50 ms each way and 1 % of them 200 ms
    more (a TCP retransmission)."""
    if made.hosts.netem_available("w1"):
        for host in ("w1", "w2"):
            made.hosts.degrade(host, "delay 50ms loss 1%")
        return "`tc netem delay 50ms loss 1%` on both worker hosts' links"
    redis_at = f"{made.hosts.address['redis']}:6379"
    for host in ("w1", "w2"):
        made.procs[host].terminate()
        made.procs[host].wait(30)
        relay = [sys.executable, "-m", "testkit.slowlink", "127.0.0.1:6380", redis_at,
                 "--delay-ms", "50", "--loss", "0.01"]  # fmt: skip
        made.spawn(f"{host}-link", host, relay, env=made.env())
        env = {**made.env(), "GPULANE_REDIS_URL": f"redis://:{PASSWORD}@127.0.0.1:6380/0"}
        argv = [*CLI, "worker", "--name", f"{host}s",
                "--gpu", "none", "--tasks", f"worker.tasks.builtin,{TEST_TASKS}"]  # fmt: skip
        made.spawn(f"{host}s", host, argv, env=env)
    wait_for(
        lambda: all(r.hget(keys.worker(w), "state") == b"idle" for w in ("w1s", "w2s")),
        60,
        what="the workers behind the slow links to serve",
    )
    return (
        "this kernel has no `sch_netem`, so the workers ran behind `testkit.slowlink`, a "
        "relay in each worker host that delays every chunk 50 ms each way and 1 % of "
        "them 200 ms more (a TCP retransmission)"
    )


def _write_result(
    clean: dict[str, Any], degraded: dict[str, Any], rerun_s: float, how: str
) -> None:
    lines = [
        "# Several hosts (tests/test_multihost.py)",
        "",
        "Four network namespaces on one bridge: Redis, API, two worker hosts (lease 3 s,",
        "heartbeat 0.5 s). 40 `sleep` tasks of 50 ms submitted at once on the API host.",
        f"Degraded: {how}.",
        "Latency = submit → end, Redis clock.",
        "",
        "| network | tasks/s | p50 latency | p95 latency |",
        "|---|---|---|---|",
        f"| clean | {clean['rate']:.1f} | {clean['p50']:.2f} s | {clean['p95']:.2f} s |",
        f"| delay 50 ms, loss 1 % | {degraded['rate']:.1f} | {degraded['p50']:.2f} s "
        f"| {degraded['p95']:.2f} s |",
        "",
        f"Partition of a busy worker host: its task started again on the other host "
        f"{rerun_s:.1f} s after the cut (lease 3 s); after the heal its late report was "
        "fenced and it rejoined.",
        "",
    ]
    if os.environ.get("GPULANE_UPDATE_RESULTS") == "1":  # else a test run leaves no diff
        (REPO / "bench" / "results" / "multihost.md").write_text("\n".join(lines))
    print("\n".join(lines))
