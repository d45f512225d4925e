"""`gpulane up --workers auto` on a host with 2 fake GPUs: one worker per card, each
claiming its card through Redis; status lines name each worker's device; a worker
that exits after a GPU fault is restarted; one whose card is gone crash-loops and is
reported, not restarted forever."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from support.up import Up, up_env

from dispatcher.contract import keys
from testkit import fake_gpu_env, wait_for


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    environment = up_env(
        tmp_path, task_modules=json.dumps(["worker.tasks.builtin", "gl_test_tasks"])
    )
    environment.update(fake_gpu_env(2, switches=tmp_path / "switches"))
    (tmp_path / "switches").mkdir()
    yield environment


def _redis(up: Up) -> redis.Redis:
    match = re.search(r"redis (unix://\S+|redis://\S+)", up.output())
    assert match, up.output()
    return redis.Redis.from_url(match.group(1))


def test_up_runs_one_claiming_worker_per_gpu_and_restarts_them(
    env: dict[str, str], tmp_path: Path
) -> None:
    up = Up(env, "--workers", "auto")
    try:
        url = up.url()
        started = re.findall(r"started (\S+\.gpu(\d)) \((gpu\d [^)]*GPU-\S+)\), pid", up.output())
        assert [(name.split(".")[-1], index) for name, index, _ in started] == [
            ("gpu0", "0"),
            ("gpu1", "1"),
        ], up.output()
        assert all("NVIDIA Fake H100 80GB HBM3" in device for _, _, device in started)
        with httpx.Client(base_url=url, timeout=10) as http:
            workers = {w["name"]: w for w in http.get("/workers").json()["workers"]}
            assert {w["device"]["index"] for w in workers.values()} == {0, 1}
            client = _redis(up)
            claims = {k.decode(): client.get(k) for k in client.scan_iter(keys.gpu_claim("*", "*"))}
            assert sorted(v.decode() for v in claims.values() if v) == sorted(workers)

            # A fatal CUDA error: the worker exits 71, `up` says why and restarts it.
            task = http.post("/tasks", json={"type": "test.cuda_fault"}).json()
            wait_for(
                lambda: http.get(f"/tasks/{task['id']}").json()["status"] == "succeeded",
                30,
                what="the faulted task to succeed on its second attempt",
            )
            wait_for(
                lambda: re.search(
                    r"exited with status 71 \(unhealthy: its GPU faulted", up.output()
                ),
                10,
                what="up to report the unhealthy exit",
            )
            wait_for(lambda: "restarted " in up.output(), 10, what="the restart")
            wait_for(
                lambda: http.get("/health").json()["serving"] == 2, 20, what="both serving again"
            )

            # The card dies: its worker leaves unhealthy, and restarts fail at once (no
            # such GPU any more) until `up` gives up on it and says so.
            name1 = next(n for n, w in workers.items() if w["device"]["index"] == 1)
            (tmp_path / "switches" / "lost-1").touch()
            wait_for(
                lambda: "not restarting it" in up.output(),
                90,
                interval_s=0.2,
                what="up to give up on the worker of the lost card",
            )
            lines = [line for line in up.output().splitlines() if f"{name1} (gpu1 " in line]
            exits = [int(m.group(1)) for m in map(re.compile(r"status (\d+)").search, lines) if m]
            # Unhealthy (71) while the card died, then "no such GPU" (2) until given up;
            # how many of each `up` saw depends on how quickly each exit came.
            first_no_card = exits.index(2)
            assert exits[first_no_card - 1] == 71, up.output()
            assert set(exits[first_no_card:]) == {2}, up.output()
            assert "not restarting it" in lines[-1], up.output()
            states = {w["name"]: w["state"] for w in http.get("/workers").json()["workers"]}
            assert states.get(name1) is None or states[name1] == "unhealthy"
            assert any(s in ("idle", "busy") for n, s in states.items() if n != name1)
    finally:
        code = up.stop()
    assert code == 0, up.output()
