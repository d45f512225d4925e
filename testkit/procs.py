"""Real processes for tests and benchmarks: redis-server on a free loopback port, the API
in a thread, worker processes started with the `gpulane worker` command, and the
helpers around them (free ports, the `gpulane` command line); waiting on a condition
is testkit.waiting's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import redis
import uvicorn

from dispatcher.api.app import create_app
from dispatcher.api.guard import server_options
from dispatcher.contract.settings import Settings
from testkit.waiting import wait_for, wait_redis

REPO = Path(__file__).resolve().parents[1]
TEST_TASKS = "gl_test_tasks"  # tests/support/gl_test_tasks.py, loaded by workers


# SIGINT back to its default, then the command itself (same pid: exec).
_RESET_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def foreground(argv: list[str]) -> list[str]:
    """``argv`` as a command a test interrupts as a person would with Ctrl-C: with
    SIGINT at its default, as in a terminal's foreground job. A shell ignores SIGINT
    in what it starts in the background (``make test &``, a detached CI job), a child
    inherits that, and Python then never turns SIGINT into KeyboardInterrupt: the
    command would run on and exit 0. Through an exec, not a ``preexec_fn``: the tests
    that need it run threads (the API, a pty reader), and forking those to run Python
    in the child can deadlock."""
    return [sys.executable, "-c", _RESET_SIGINT, *argv]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_argv(binary: str, port: int, directory: Path, **overrides: str) -> list[str]:
    """redis-server as gpulane runs it (AOF on, noeviction) on a loopback port, with
    ``overrides`` as extra or replacing ``--name value`` options."""
    args = {
        "port": str(port),
        "bind": "127.0.0.1",
        "dir": str(directory),
        "appendonly": "yes",
        "appendfsync": "everysec",
        "save": "",
        "maxmemory-policy": "noeviction",
        **overrides,
    }
    argv = [binary]
    for key, value in args.items():
        argv += [f"--{key.replace('_', '-')}", value]
    return argv


def publish_catalog(client: redis.Redis, *modules: str) -> None:
    """Publish the built-in task types (and those of ``modules``), as a worker does
    when it registers: for an API tested or measured without workers."""
    import importlib

    import worker.tasks.builtin  # noqa: F401 - registers the built-ins
    from dispatcher.contract import keys
    from worker.registry import REGISTRY

    for module in modules:
        importlib.import_module(module)
    # Exactly these modules' types: the registry is process-wide, and a module another
    # test imported earlier must not leak its types into this catalog.
    wanted = {"worker.tasks.builtin", "worker.tasks.document", *modules}  # built-ins
    for name in REGISTRY.names():
        spec = REGISTRY.get(name)
        if spec is not None and spec.handler.__module__ in wanted:
            client.hset(keys.CATALOG, name, json.dumps(spec.catalog_entry()))


class RedisServer:
    """A redis-server of our own, AOF on, that tests may stop, kill and restart;
    ``overrides`` are extra options (``replicaof="127.0.0.1 6379"``)."""

    def __init__(self, directory: Path, port: int | None = None, **overrides: str) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.overrides = overrides
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (make test installs it)"
        self.directory.mkdir(parents=True, exist_ok=True)
        argv = redis_argv(
            binary, self.port, self.directory, **{"appendfsync": "always", **self.overrides}
        )
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_redis(self.client(), what=f"redis-server on port {self.port}")
        return self

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()


class ApiServer:
    """The real app under uvicorn in a thread, on a free port: real HTTP."""

    def __init__(self, settings: Settings) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            create_app(settings),
            host="127.0.0.1",
            port=self.port,
            log_config=None,
            access_log=False,
            lifespan="on",
            **server_options(settings),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ApiServer:
        self.thread.start()
        wait_for(lambda: self.server.started, 15, what="the API to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


FAKE_NVML = REPO / "tests" / "support" / "fake_nvml"  # a pynvml with fake GPUs


def fake_gpu_env(
    gpus: int, switches: Path | None = None, memory_gib: list[float] | None = None
) -> dict[str, str]:
    """Environment for a worker that sees ``gpus`` fake GPUs through the fake pynvml
    (see its docstring); ``switches`` is the folder of lost-/hang-/used- switch files,
    ``memory_gib`` each card's total memory (default 80 GiB)."""
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAKE_NVML), str(REPO), str(REPO / "tests" / "support")]),
        "GPULANE_FAKE_NVML": str(gpus),
    }
    if switches is not None:
        env["GPULANE_FAKE_NVML_DIR"] = str(switches)
    if memory_gib is not None:
        env["GPULANE_FAKE_NVML_MEMORY_GIB"] = ",".join(f"{g:g}" for g in memory_gib)
    return env


def worker_env(redis_url: str, **settings: Any) -> dict[str, str]:
    env = dict(os.environ)
    env["GPULANE_REDIS_URL"] = redis_url
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests" / "support")])
    for key, value in settings.items():
        env[f"GPULANE_{key.upper()}"] = str(value)
    return env


# The `gpulane` command as a subprocess argv (the console script may not be on PATH).
CLI = [sys.executable, "-m", "dispatcher.ops.cli"]


def run_cli(
    *args: str, env: dict[str, str], timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """``gpulane ARGS`` run to its end from the repository, its output captured as text:
    a command as a person types it, its exit code and output to check (never raises on
    a failing exit; a hang past ``timeout_s`` fails the test)."""
    return subprocess.run(
        [*CLI, *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


class WorkerProcess:
    """One `gpulane worker` process."""

    def __init__(self, name: str, env: dict[str, str], args: list[str]) -> None:
        self.name = name
        argv = [*CLI, "worker", "--name", name, *args]
        self.log = REPO / ".test-logs" / f"{name}.log"
        self.log.parent.mkdir(exist_ok=True)
        self._log_handle = self.log.open("wb")
        self.process = subprocess.Popen(
            argv, env=env, cwd=REPO, stdout=self._log_handle, stderr=subprocess.STDOUT
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def terminate(self, timeout_s: float = 15) -> int:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        finally:
            self._log_handle.close()
