"""Processes a benchmark run needs, each started fresh and stopped at the end.

- :class:`Redis`: a private ``redis-server`` on a free loopback port (AOF on with
  ``appendfsync everysec``, ``noeviction``: how gpulane runs in production).
- :func:`gpulane_worker`, :func:`rq_worker`, :func:`gpulane_api`: real processes
  started with the same commands an operator types (``gpulane worker``,
  ``rq worker -w rq.worker.SimpleWorker``, ``gpulane api``).
- :class:`Stack`: owns everything started, so one ``with`` block stops it all.

Process logs go to a temporary directory (kept only when a run fails).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.contract import keys
from dispatcher.contract.settings import ClassConfig
from testkit import CLI, free_port, http_ok, redis_argv, wait_for, wait_redis

REPO = Path(__file__).resolve().parents[1]
BENCH_TASKS = "bench.gl_tasks"  # gpulane task module loaded by the bench workers


def bench_gpu() -> str:
    """The workers' ``--gpu``: none (the CPU) unless BENCH_GPU says (gpu-check: auto)."""
    return os.environ.get("BENCH_GPU", "none")


def bench_device() -> str:
    """Where the bench runs a model in-process: the GPU when the workers have one."""
    return "cpu" if bench_gpu() == "none" else "cuda"


# Class limits raised so admission never refuses during a benchmark.
# Benchmarks measure dispatch, never admission: classes that never refuse.
OPEN_CLASS = {"max_queued": 10_000_000, "max_wait_s": 1e9, "reject_without_workers": False}
UNLIMITED = ClassConfig(**OPEN_CLASS)


def classes_json(names: list[str]) -> str:
    """``GPULANE_CLASSES`` value: these classes, in this priority order, never refusing."""

    return json.dumps({name: OPEN_CLASS for name in names})


class Proc:
    """A child process with its log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logdir: Path) -> None:
        self.name = name
        self.log = logdir / f"{name}.log"
        self._handle = self.log.open("wb")
        self.process = subprocess.Popen(
            argv, env=env, cwd=REPO, stdout=self._handle, stderr=subprocess.STDOUT
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def check(self) -> None:
        """Fail the run with the process' log when it has exited (a wait on something it
        should do would otherwise run to its deadline, or forever)."""
        if not self.alive():
            raise RuntimeError(f"{self.name} exited:\n{self.tail()}")

    def terminate(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (if not sent yet), wait, then SIGKILL."""
        self.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        self._handle.close()

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def bench_key(tenant: str) -> str:
    """The bearer key of a bench tenant (:func:`tenants_json`)."""
    return f"bench-key-{tenant}"


def tenants_json(weights: dict[str, float], admins: tuple[str, ...] = ()) -> str:
    """``GPULANE_TENANTS`` for bench tenants (``name -> weight``, keys :func:`bench_key`),
    their rate and in-flight limits out of the way; ``admins`` get admin keys."""
    return json.dumps(
        [
            {
                "name": name,
                "key_sha256": hashlib.sha256(bench_key(name).encode()).hexdigest(),
                "weight": weight,
                "rate": 1e6,
                "burst": 1_000_000,
                "max_in_flight": 1_000_000,
                "admin": name in admins,
            }
            for name, weight in weights.items()
        ]
    )


class Stack:
    """Redis plus the processes of one benchmark; ``with Stack() as s:`` stops them all."""

    def __init__(self, **redis_args: str) -> None:
        self.logdir = Path(tempfile.mkdtemp(prefix="gpulane-bench-"))
        self.port = free_port()
        self.procs: list[Proc] = []
        self._redis_args = redis_args
        self._failed = False

    # -- lifecycle ---------------------------------------------------------------
    def __enter__(self) -> Stack:
        self._start_redis()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._failed = kind is not None
        self.close()

    def close(self) -> None:
        """Stop every process: all but Redis at once, then Redis."""
        redis_proc, others = self.procs[0], self.procs[1:]
        for proc in others:
            proc.terminate()
        for proc in [*others, redis_proc]:
            proc.stop()
        self.procs.clear()
        if self._failed:
            print(f"bench: process logs kept in {self.logdir}", file=sys.stderr)
        else:
            shutil.rmtree(self.logdir, ignore_errors=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=30, **kwargs)

    def _start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/ensure-redis.sh)")
        argv = redis_argv(binary, self.port, self.logdir, **self._redis_args)
        self.procs.append(Proc("redis", argv, dict(os.environ), self.logdir))
        wait_redis(self.client(), "redis-server")

    # -- processes ---------------------------------------------------------------
    def env(self, **settings: Any) -> dict[str, str]:
        env = dict(os.environ)
        env["GPULANE_REDIS_URL"] = self.url
        env["PYTHONPATH"] = str(REPO)
        env.setdefault("GPULANE_LOG_LEVEL", "INFO")
        for key, value in settings.items():
            env[f"GPULANE_{key.upper()}"] = str(value)
        return env

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> Proc:
        proc = Proc(name, argv, env, self.logdir)
        self.procs.append(proc)
        return proc

    def gpulane_worker(
        self,
        name: str,
        serve: list[str] | None = None,
        wait: bool = True,
        tasks: str = f"worker.tasks.builtin,{BENCH_TASKS}",
        **settings: Any,
    ) -> Proc:
        """``gpulane worker`` (CPU device, built-ins plus the bench tasks) serving the
        classes ``serve`` (default: all); ``settings`` become ``GPULANE_*`` variables."""
        proc = self.spawn(name, self.worker_argv(name, serve, tasks), self.env(**settings))
        if wait:
            self.wait_registered(proc)
        return proc

    @staticmethod
    def worker_argv(
        name: str,
        serve: list[str] | None = None,
        tasks: str = f"worker.tasks.builtin,{BENCH_TASKS}",
    ) -> list[str]:
        """The ``gpulane worker`` command line :meth:`gpulane_worker` runs."""
        argv = [*CLI, "worker", "--gpu", bench_gpu(), "--name", name]
        argv += ["--tasks", tasks]
        if serve:
            argv += ["--classes", ",".join(serve)]
        return argv

    def _wait_worker(
        self, proc: Proc, ready: Callable[[redis.Redis], bool], what: str, timeout_s: float = 30
    ) -> None:
        """Until ``ready(client)``; a worker that exits meanwhile fails the run with its log."""
        client = self.client()

        def check() -> bool:
            proc.check()
            return ready(client)

        wait_for(check, timeout_s, f"worker {proc.name} {what}")

    def wait_registered(self, proc: Proc) -> None:
        self._wait_worker(
            proc, lambda c: c.zscore(keys.WORKERS, proc.name) is not None, "to register"
        )

    def wait_idle(self, proc: Proc, timeout_s: float = 30) -> None:
        """Until worker ``proc`` is parked, ready for work: past registering, its task
        modules loaded (a model, a backend's server answering)."""
        self._wait_worker(
            proc,
            lambda c: c.hget(keys.worker(proc.name), "state") == b"idle",
            "to be idle",
            timeout_s,
        )

    def rq_worker(self, name: str, queue: str, wait: bool = True) -> Proc:
        """Plain RQ: ``rq worker -w rq.worker.SimpleWorker -S JSONSerializer`` on ``queue``."""
        argv = [sys.executable, "-m", "rq.cli", "worker", "--url", self.url, "--name", name]
        argv += ["-w", "rq.worker.SimpleWorker", "-S", "rq.serializers.JSONSerializer", queue]
        proc = self.spawn(name, argv, self.env())
        if wait:
            self.wait_rq(proc)
        return proc

    def wait_rq(self, proc: Proc) -> None:
        self._wait_worker(
            proc, lambda c: bool(c.exists(f"rq:worker:{proc.name}")), "(RQ) to register"
        )

    def gpulane_api(self, classes: list[str], **settings: Any) -> tuple[Proc, str]:
        """``gpulane api`` (uvicorn, one process) on a free port; returns (proc, base URL)."""
        port = free_port()
        env = self.env(port=port, classes=classes_json(classes), **settings)
        argv = [*CLI, "api"]
        proc = self.spawn("api", argv, env)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _http_ok(proc, f"{url}/health"), 30, "the API")
        return proc, url


def _http_ok(proc: Proc, url: str) -> bool:
    proc.check()
    return http_ok(url)


def rss_mb(pid: int) -> dict[str, float]:
    """VmRSS and its anonymous part (RssAnon) of a process, in MB (10^6 bytes)."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024 / 1e6
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process and its children (uvicorn workers) used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    children = Path(f"/proc/{pid}/task/{pid}/children")
    kids = children.read_text().split() if children.exists() else []
    return own + sum(cpu_s(int(kid)) for kid in kids if Path(f"/proc/{kid}").exists())


def batch_counts(metrics: str, task_type: str) -> tuple[float, float]:
    """The workers' batches of ``task_type`` so far and the items in them, from the
    text of the API's ``/metrics`` (``gpulane_batch_size``'s count and sum; a worker
    adds its own there with each heartbeat)."""
    values = {
        sample.name.removeprefix("gpulane_batch_size_"): sample.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "gpulane_batch_size"
        for sample in family.samples
        if sample.labels.get("type") == task_type
    }
    return values.get("count", 0.0), values.get("sum", 0.0)
