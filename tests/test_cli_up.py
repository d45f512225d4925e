"""`gpulane up`, `gpulane submit` and `gpulane status` as a person runs them."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis import Redis
from support.cpus import cpu_set
from support.pdf import make_pdf
from support.up import Up, up_env

from dispatcher.contract import cpus, keys
from dispatcher.ops.embedded_redis import EmbeddedRedis
from testkit import REPO, RedisServer, free_port, run_cli, wait_for


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    yield up_env(tmp_path)


def _redis_servers(data_dir: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-af", "redis-server"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if str(data_dir) in line]


def test_up_serves_tasks_and_two_instances_do_not_collide(
    env: dict[str, str], tmp_path: Path
) -> None:
    first = Up(env, "--workers", "2")
    second = Up(env, "--workers", "1")
    try:
        url1, url2 = first.url(), second.url()
        assert url1 != url2  # the second moved to a free port
        assert (tmp_path / "gpulane" / "up.json").exists()
        assert (tmp_path / "gpulane-2" / "up.json").exists()  # and to its own data dir
        with httpx.Client(base_url=url1, timeout=10) as http:
            workers = http.get("/workers").json()["workers"]
            assert len(workers) == 2 and all(w["device"]["kind"] == "cpu" for w in workers)
            # Each CPU worker runs on its own share of the CPUs, all of them used.
            held = [cpu_set(w["device"]["cpus"]) for w in workers]
            assert set.union(*held) == set(cpus.allowed()), held
            if len(cpus.allowed()) >= 2:
                assert not held[0] & held[1], held
            task = http.post("/tasks", json={"type": "sleep", "args": {"seconds": 0.3}}).json()
            pdf = make_pdf(["alpha", "beta"])
            doc = http.post("/tasks", files={"file": ("x.pdf", pdf, "application/pdf")}).json()
            for task_id in (task["id"], doc["id"]):
                wait_for(
                    lambda t=task_id: http.get(f"/tasks/{t}").json()["status"] == "succeeded",
                    20,
                    what="task to succeed",
                )
            assert http.get(f"/tasks/{doc['id']}").json()["result"]["pages"] == 2
        with httpx.Client(base_url=url2, timeout=10) as http:
            (alone,) = http.get("/workers").json()["workers"]
            assert cpu_set(alone["device"]["cpus"]) == set(cpus.allowed())  # all of them
            assert http.get(f"/tasks/{task['id']}").status_code == 404  # separate Redis
    finally:
        codes = (first.stop(), second.stop())
    assert codes == (0, 0), first.output() + second.output()
    assert "gpulane up: stopped" in first.output()
    assert _redis_servers(tmp_path) == []
    assert not (tmp_path / "gpulane" / "up.json").exists()


def test_submit_wait_and_status(env: dict[str, str], tmp_path: Path) -> None:
    up = Up(env, "--workers", "1")
    try:
        up.url()
        # No --url: the command finds the running `gpulane up` through its data dir.
        done = run_cli(
            "submit",
            "--type",
            "sleep",
            "--args",
            '{"seconds": 0.8}',
            "--class",
            "interactive",
            "--wait",
            env=env,
        )
        assert done.returncode == 0, done.stderr
        assert "sleep (interactive): queued" in done.stdout
        summary = json.loads(done.stdout[done.stdout.index("{") :])
        assert summary["status"] == "succeeded" and summary["result"]["slept_s"] >= 0.8

        pdf = tmp_path / "letter.pdf"
        pdf.write_bytes(make_pdf(["Dear reader", "Regards"]))
        doc = run_cli("submit", str(pdf), "--wait", env=env)
        assert doc.returncode == 0, doc.stderr
        assert json.loads(doc.stdout[doc.stdout.index("{") :])["result"]["pages"] == 2

        failed = run_cli("submit", "--type", "nope", env=env)
        assert failed.returncode == 3 and "unknown_task_type" in failed.stderr

        status = run_cli("status", env=env)
        assert status.returncode == 0, status.stderr
        assert "interactive" in status.stdout and "batch" in status.stdout
        assert "cpu0" in status.stdout
    finally:
        assert up.stop() == 0, up.output()


def test_explicit_busy_data_dir_is_refused(env: dict[str, str], tmp_path: Path) -> None:
    data = tmp_path / "shared"
    first = Up(env, "--workers", "1", "--data-dir", str(data))
    try:
        first.url()
        second = run_cli("up", "--data-dir", str(data), env=env)
        assert second.returncode == 1
        assert "in use by another `gpulane up`" in second.stderr
    finally:
        assert first.stop() == 0


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (entry.partition(b"=") for entry in raw.split(b"\0") if entry)
    return {key.decode(): value.decode() for key, _, value in pairs}


def test_up_flags_reach_its_children(
    env: dict[str, str], tmp_path: Path, private_redis: RedisServer
) -> None:
    """`--redis-url`, `--host`, `--port`, `--data-dir` given as flags (nothing in the
    environment): the API and the workers use them too, not their defaults."""
    data, port = tmp_path / "flags", free_port()
    up = Up(
        env,
        *("--workers", "1", "--redis-url", private_redis.url),
        *("--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data)),
    )
    try:
        assert up.url() == f"http://127.0.0.1:{port}", up.output()
        pids = [int(p) for p in re.findall(r"\), pid (\d+)", up.output())]
        assert len(pids) == 2, up.output()  # the API and the worker; no private Redis
        for pid in pids:
            child = _environ(pid)
            assert child["GPULANE_REDIS_URL"] == private_redis.url
            assert child["GPULANE_HOST"] == "127.0.0.1"
            assert child["GPULANE_PORT"] == str(port)
            assert child["GPULANE_DATA_DIR"] == str(data)
        # The worker registered in the Redis given, as `up` said it would use.
        workers = private_redis.client().zrange(keys.WORKERS, 0, -1)
        assert len(workers) == 1, workers
        assert not (tmp_path / "gpulane").exists()  # the default data dir: untouched
    finally:
        assert up.stop() == 0, up.output()


@pytest.mark.parametrize("given", ["flag", "env"])
def test_an_explicit_busy_port_is_refused(env: dict[str, str], given: str) -> None:
    """A port that was asked for (flag, environment or file) is honoured exactly or not
    at all; only the default port moves to a free one (see the first test)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        if given == "env":
            done = run_cli("up", env={**env, "GPULANE_PORT": str(port)})
        else:
            done = run_cli("up", "--port", str(port), env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"port {port} on 127.0.0.1 is in use" in done.stderr
    assert "Traceback" not in done.stderr


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def test_up_killed_leaves_nothing_running(env: dict[str, str], tmp_path: Path) -> None:
    """SIGKILL the supervisor: its redis-server, API and workers end by themselves."""
    up = Up(env, "--workers", "1")
    try:
        up.url()
        pids = [int(p) for p in re.findall(r"\), pid (\d+)", up.output())]
        pids.append(int((tmp_path / "gpulane" / "redis" / "redis.pid").read_text()))
        assert len(pids) == 3 and all(_alive(p) for p in pids), up.output()
        up.process.send_signal(signal.SIGKILL)
        up.process.wait(10)
        wait_for(lambda: not any(_alive(p) for p in pids), 30, what="children to end")
        assert _redis_servers(tmp_path) == []
    finally:
        up.stop()


def test_second_up_stops_a_stale_private_redis(env: dict[str, str], tmp_path: Path) -> None:
    """A redis-server left on the data directory (by an `up` whose children outlived
    it) is stopped, its AOF kept, and the new `up` runs its own."""
    stale = EmbeddedRedis(tmp_path / "gpulane" / "redis")
    stale.start()
    assert stale.process is not None
    Redis(unix_socket_path=str(stale.socket)).set("kept", "1")
    up = Up(env, "--workers", "1")
    try:
        url = up.url()
        assert f"stopped a stale private redis-server (pid {stale.process.pid})" in up.output()
        assert stale.process.wait(10) == 0  # SIGTERM: a clean exit, AOF flushed
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
        fresh = int((tmp_path / "gpulane" / "redis" / "redis.pid").read_text())
        assert fresh != stale.process.pid and _alive(fresh)
        assert Redis(unix_socket_path=str(stale.socket)).get("kept") == b"1"
    finally:
        assert up.stop() == 0, up.output()
        stale.stop()
    assert _redis_servers(tmp_path) == []


def test_children_start_when_the_supervisor_is_pid_1() -> None:
    """In a container `gpulane up` may be pid 1: its children must still start (the
    die-with-parent hook compares against the supervisor's pid, not against 1)."""
    script = (
        "import os, subprocess, sys\n"
        "from dispatcher.ops.supervisor import _child_setup\n"
        "assert os.getpid() == 1\n"
        "sys.exit(subprocess.run(['true'], preexec_fn=_child_setup()).returncode)\n"
    )
    done = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
