"""``gpulane up``: the whole stack on one machine, kept running.

Starts a private redis-server (unless a Redis URL is given), the API, and one worker
per GPU (``cpu_workers`` CPU workers where there is none); restarts a process that
exits, with capped backoff, and stops restarting one that crash-loops; on Ctrl-C or
SIGTERM stops the workers (a running task may finish within the shutdown grace), then
the API, then Redis. Each GPU worker is started with ``--gpu <UUID>`` and still claims
its card through Redis like any other worker, so a restarted worker waits for its
predecessor's claim, and workers from elsewhere on the host cannot double-book a card.
Status lines name each worker's device, and explain the exit statuses that mean
something (a GPU fault, a stuck task).

Two ``gpulane up`` on one machine do not collide: Redis listens on a socket in the
data directory, the data directory is locked (a second instance using the default
one moves to ``<dir>-2``...) and a busy default port moves to the next free one.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

import httpx

from dispatcher.contract import cpus as cpus_mod
from dispatcher.contract.connect import describe as describe_redis
from dispatcher.contract.exits import EXIT_OK, describe
from dispatcher.contract.settings import Settings
from dispatcher.ops.embedded_redis import EmbeddedRedis

__all__ = ["Supervisor", "UpError", "read_up_file"]

# A process that exits within HEALTHY_AFTER_S of its start failed to start (bad config,
# import error, a driver that will not initialise); CRASH_LIMIT such exits in a row and
# it is given up on and reported. An exit after a healthy run (a crash mid-task, an
# operator's kill) is restarted at once and resets the count.
HEALTHY_AFTER_S = 2.0
CRASH_LIMIT = 5
UP_FILE = "up.json"


class UpError(RuntimeError):
    """`gpulane up` cannot start; the message says why and what to do."""


def say(message: str) -> None:
    print(f"gpulane up: {message}", flush=True)


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    label: str = ""
    pass_fds: tuple[int, ...] = ()
    cpus: list[int] | None = None  # pinned to these (a CPU worker's share); None: all
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    quick_exits: int = 0
    restart_at: float | None = None
    given_up: bool = False

    def start(self) -> None:
        # Own session: a Ctrl-C in the terminal reaches only the supervisor, which then
        # stops each child once, in order (a second signal would cut the grace short).
        self.process = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            pass_fds=self.pass_fds,
            preexec_fn=_child_setup(self.cpus),  # noqa: PLW1509 - the supervisor runs no threads
        )
        self.started_at = time.monotonic()
        self.restart_at = None

    def poll_exit(self) -> int | None:
        """The exit status if the process ended since the last look."""
        if self.process is None or self.restart_at is not None or self.given_up:
            return None
        return self.process.poll()

    def schedule_restart(self, now: float) -> bool:
        """Plan a restart with capped backoff; False when it crash-loops (given up)."""
        if now - self.started_at >= HEALTHY_AFTER_S:
            self.quick_exits = 0
            self.restart_at = now
            return True
        self.quick_exits += 1
        if self.quick_exits >= CRASH_LIMIT:
            self.given_up = True
            return False
        # 0.5, 1, 2, 4 s: CRASH_LIMIT quick exits end it before any longer delay.
        self.restart_at = now + 0.5 * 2 ** (self.quick_exits - 1)
        return True


def _prepare_child(parent: int, cpus: list[int] | None) -> None:
    """Run in the child between fork and exec (built by :func:`_child_setup`): pinned
    to ``cpus`` when given, before anything in it counts its CPUs; and, on Linux, sent
    SIGTERM if the supervisor (pid ``parent``) dies without stopping it (even by
    SIGKILL)."""
    if cpus is not None:
        # Unpinned is slower under load, not wrong: a CPU gone since (hot-unplugged,
        # a cpuset narrowed) must not stop a worker from starting.
        with contextlib.suppress(OSError):
            cpus_mod.pin(cpus)
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        # The supervisor died before prctl took effect: the child was re-parented. (Not
        # `getppid() == 1`: the supervisor may itself be pid 1, in a container.)
        if os.getppid() != parent:
            os._exit(1)


def _child_setup(cpus: list[int] | None = None) -> Callable[[], None]:
    """The preexec hook for a child of this process: dies with it (pid taken now),
    pinned to ``cpus`` when given."""
    return functools.partial(_prepare_child, os.getpid(), cpus)


def _cpu_label(share: list[int] | None) -> str:
    """A CPU worker's device in the status lines: ``cpu 0-3``, or ``cpu`` unpinned."""
    return f"cpu {cpus_mod.describe(share)}" if share else "cpu"


def _terminate(children: list[Child], within_s: float) -> None:
    """SIGTERM the running ones, wait up to ``within_s``, then SIGKILL stragglers."""
    running = [c.process for c in children if c.process and c.process.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + within_s
    for process in running:
        try:
            process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _lock(directory: Path) -> IO[str] | None:
    directory.mkdir(parents=True, exist_ok=True)
    handle = (directory / "gpulane.lock").open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _listen(host: str, port: int) -> socket.socket | None:
    """A listening socket on host:port, or None when the port is taken. The supervisor
    holds it and the API inherits it: no window where another process grabs the port,
    and the port stays ours while the API restarts."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        return None
    sock.set_inheritable(True)
    return sock


def read_up_file(data_dir: Path) -> dict[str, Any] | None:
    """What a running `gpulane up` wrote about itself (its URL), if it is alive."""
    try:
        info: dict[str, Any] = json.loads((data_dir / UP_FILE).read_text())
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, KeyError):
        return None
    return info


class Supervisor:
    def __init__(self, settings: Settings, workers: str, backends: list[str] | None = None) -> None:
        self.settings = settings
        self.workers_spec = workers
        self.backends = backends or []  # one backend worker per URL, beside the others
        self.children: list[Child] = []
        self.redis: EmbeddedRedis | None = None
        self.listener: socket.socket | None = None
        self.stopping = False
        self._lock_handle: IO[str] | None = None
        self.data_dir = settings.data_dir

    # -- start ---------------------------------------------------------------------

    def _claim_data_dir(self) -> None:
        explicit = "data_dir" in self.settings.model_fields_set
        candidates = (
            [self.data_dir]
            if explicit
            else [
                self.data_dir.with_name(f"{self.data_dir.name}{suffix}")
                for suffix in ("", *(f"-{n}" for n in range(2, 10)))
            ]
        )
        for candidate in candidates:
            self._lock_handle = _lock(candidate)
            if self._lock_handle is not None:
                self.data_dir = candidate
                return
        raise UpError(
            f"data directory {self.data_dir} is in use by another `gpulane up`; "
            "pass --data-dir to use another one"
        )

    def _bind(self) -> tuple[socket.socket, int]:
        host, port = self.settings.host, self.settings.port
        sock = _listen(host, port)
        if sock is not None:
            return sock, port
        if "port" in self.settings.model_fields_set:
            # A port that was set (flag, environment, file) is honoured exactly or not at
            # all: clients were told it. Only the default moves.
            raise UpError(f"port {port} on {host} is in use; set another (--port, GPULANE_PORT)")
        for candidate in range(port + 1, port + 100):
            sock = _listen(host, candidate)
            if sock is not None:
                say(f"port {port} is busy; using {candidate}")
                return sock, candidate
        raise UpError(f"no free port near {port}; pass --port")

    def _devices(self) -> list[dict[str, Any]]:
        out = subprocess.run(
            [sys.executable, "-m", "worker.gpu.devices"],
            capture_output=True,
            text=True,
            check=False,
        )
        try:
            devices: list[dict[str, Any]] = json.loads(out.stdout or "[]")
        except ValueError:
            devices = []
        return devices

    def _worker_children(self, env: dict[str, str]) -> list[Child]:
        gpus = self._devices()
        if not gpus:
            count = (
                self.settings.cpu_workers if self.workers_spec == "auto" else int(self.workers_spec)
            )
            return self._cpu_workers(env, count)
        count = len(gpus) if self.workers_spec == "auto" else int(self.workers_spec)
        # More workers than GPUs: they share cards, ceil(count / GPUs) per card. Each
        # worker still claims its slot through Redis (`--gpu <UUID>`), so `up` and any
        # other worker on this host (another `up`, a container) agree on who has which.
        per_gpu = max(-(-count // len(gpus)), self.settings.per_gpu)
        children = []
        for i in range(count):
            gpu = gpus[i % len(gpus)]
            label = f"gpu{gpu['index']}" if count <= len(gpus) else f"gpu{gpu['index']}.{i}"
            argv = ["--gpu", str(gpu["uuid"]), "--per-gpu", str(per_gpu)]
            device = f"gpu{gpu['index']} {gpu['name']} {gpu['uuid']}"
            children.append(self._worker(env, label, argv, device))
        return children

    def _cpu_workers(self, env: dict[str, str], count: int) -> list[Child]:
        """``count`` CPU workers, each pinned to its share of this process' CPUs
        (``cpu_pinning``; why: :mod:`dispatcher.contract.cpus`)."""
        pinned = self.settings.cpu_pinning
        shares = cpus_mod.shares(cpus_mod.allowed(), count) if pinned else [None] * count
        return [
            self._worker(env, f"cpu{i}", ["--gpu", "none"], _cpu_label(share), share)
            for i, share in enumerate(shares)
        ]

    def _worker(
        self,
        env: dict[str, str],
        label: str,
        gpu_args: list[str],
        device: str,
        cpus: list[int] | None = None,
    ) -> Child:
        name = f"{socket.gethostname().split('.')[0]}.{label}"
        argv = [sys.executable, "-m", "dispatcher.ops.cli", "worker", "--name", name, *gpu_args]
        return Child(name, argv, env, label=device, cpus=cpus)

    def _start(self) -> str:
        self._claim_data_dir()
        # The children read their settings from the environment: what `up` was given
        # as flags (`--redis-url`, `--host`...) reaches them only through it. The port
        # and data directory are the ones taken, which may have moved.
        env = {**os.environ, **self.settings.environment("redis_url", "host")}
        if not self.settings.redis_remote:
            self.redis = EmbeddedRedis(self.data_dir / "redis", preexec_fn=_child_setup())
            stale = self.redis.stop_stale()
            if stale:
                say(f"stopped a stale private redis-server (pid {stale}) left in {self.data_dir}")
            self.redis.start()
            env["GPULANE_REDIS_URL"] = self.redis.url
            say(f"redis {self.redis.url} (private, AOF on, data in {self.data_dir / 'redis'})")
        else:
            say(f"redis {describe_redis(self.settings)}")
        self.listener, port = self._bind()
        env["GPULANE_DATA_DIR"] = str(self.data_dir)
        env["GPULANE_PORT"] = str(port)
        host = self.settings.host
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        fd = self.listener.fileno()
        api = [sys.executable, "-m", "dispatcher.ops.cli", "api", "--fd", str(fd)]
        self.children = [
            Child("api", api, env, label=url, pass_fds=(fd,)),
            *self._worker_children(env),
            *(
                self._worker(env, f"backend{i}", ["--backend", url], url)
                for i, url in enumerate(self.backends)
            ),
        ]
        for child in self.children:
            child.start()
            pid = child.process.pid if child.process else "?"
            say(f"started {child.name} ({child.label}), pid {pid}")
        (self.data_dir / UP_FILE).write_text(json.dumps({"url": url, "pid": os.getpid()}))
        return url

    def _wait_ready(self, url: str, timeout_s: float = 60.0) -> None:
        expected = len(self.children) - 1
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stopping:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                health = httpx.get(f"{url}/health", timeout=1).json()
                if health.get("status") == "ok" and health.get("serving", 0) >= expected:
                    say(f"ready: {url}  (dashboard {url}/, API docs {url}/docs); Ctrl-C stops")
                    return
            self._watch_once()
            time.sleep(0.2)
        if not self.stopping:
            say(f"API at {url}, but not all {expected} workers reported yet; still starting")

    # -- run -----------------------------------------------------------------------

    def _watch_once(self) -> None:
        now = time.monotonic()
        for child in self.children:
            code = child.poll_exit()
            if code is not None and not self.stopping:
                why = describe(code)
                ended = f"{child.name} ({child.label}) exited with status {code}"
                ended += f" ({why})" if why else ""
                if child.schedule_restart(now):
                    delay = (child.restart_at or now) - now
                    say(f"{ended}; restarting in {delay:.1f} s")
                else:
                    say(
                        f"{ended}, {CRASH_LIMIT} times in a row within {HEALTHY_AFTER_S:g} s "
                        "of starting; not restarting it (see its log above)"
                    )
            if child.restart_at is not None and now >= child.restart_at and not self.stopping:
                child.start()
                pid = child.process.pid if child.process else "?"
                say(f"restarted {child.name} ({child.label}), pid {pid}")
        if self.redis is not None and not self.redis.alive() and not self.stopping:
            say("redis-server exited; restarting it (AOF keeps the queues)")
            self.redis.start()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            url = self._start()
            self._wait_ready(url)
            while not self.stopping:
                self._watch_once()
                time.sleep(0.2)
        finally:
            self._shutdown()
        return EXIT_OK

    # -- stop ----------------------------------------------------------------------

    def _shutdown(self) -> None:
        say(
            "stopping: workers finish their running task (grace "
            f"{self.settings.shutdown_grace_s:g} s), then the API and redis"
        )
        # The API answers status polls while the workers drain; Redis goes last.
        workers = [c for c in self.children if c.name != "api"]
        _terminate(workers, self.settings.shutdown_grace_s + 5)
        _terminate([c for c in self.children if c.name == "api"], 10)
        if self.redis is not None:
            self.redis.stop()
        if self.listener is not None:
            self.listener.close()
        (self.data_dir / UP_FILE).unlink(missing_ok=True)
        if self._lock_handle is not None:
            self._lock_handle.close()
        say("stopped")
