"""Chaos: workers SIGKILLed at random under `gpulane up` while 300 tasks run."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
from support.up import Up, up_env

from dispatcher.contract import keys
from dispatcher.contract.jobs import FINAL_STATUSES
from testkit import RedisServer, wait_for

TASKS = 300


def _kill_random_worker(client: redis.Redis, rng: random.Random) -> bool:
    live = [m.decode() for m in client.zrange(keys.WORKERS, 0, -1)]
    pids = [int(p) for p in (client.hget(keys.worker(n), "pid") for n in live) if p]
    if not pids:
        return False
    try:
        os.kill(rng.choice(pids), signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


class Killer(threading.Thread):
    """SIGKILLs a random live worker every 1-2 s until stopped."""

    def __init__(self, client: redis.Redis, seed: int) -> None:
        super().__init__(daemon=True)
        self.client, self.rng = client, random.Random(seed)
        self.kills = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(1.0, 2.0)):
            self.kills += _kill_random_worker(self.client, self.rng)


def _unfinished(client: redis.Redis, ids: list[str]) -> int:
    pipe = client.pipeline(transaction=False)
    for task_id in ids:
        pipe.hget(keys.job(task_id), "status")
    return sum(s is None or s.decode() not in FINAL_STATUSES for s in pipe.execute())


@pytest.mark.slow
def test_random_sigkills_lose_nothing(tmp_path: Path, private_redis: RedisServer) -> None:
    server = private_redis
    env = up_env(tmp_path, redis_url=server.url, max_attempts=10, shutdown_grace_s=2)
    up = Up(env, "--workers", "4")
    client = server.client()
    rng = random.Random(3)
    killer = Killer(client, seed=7)
    try:
        with httpx.Client(base_url=up.url(), timeout=10) as http:
            started = time.monotonic()
            killer.start()
            ids = [
                http.post("/tasks", json={"type": "sleep",
                                          "args": {"seconds": rng.uniform(0.2, 0.6)}}).json()["id"]
                for _ in range(TASKS)
            ]  # fmt: skip
            wait_for(lambda: _unfinished(client, ids) == 0, 300, interval_s=0.5,
                     what="every task to end")  # fmt: skip
            killer.stop.set()
            elapsed = time.monotonic() - started
            records = [http.get(f"/tasks/{t}").json() for t in ids]
    finally:
        killer.stop.set()
        assert up.stop() == 0, up.output()[-3000:]
    statuses = {r["status"] for r in records}
    twice = sum(r["attempts"] > 1 for r in records)
    print(
        f"\nchaos: {TASKS} tasks, {killer.kills} SIGKILLs in {elapsed:.0f} s; "
        f"{twice} ran more than once; statuses {statuses}"
    )
    assert statuses == {"succeeded"}, [r for r in records if r["status"] != "succeeded"][:3]
    assert twice >= 1  # kills did land on running tasks, which ran again
