"""Process helpers shared by the tests and the benchmarks (repository only, not
installed): real redis-server, API and worker processes, and waiting on conditions."""

from testkit.procs import (
    CLI,
    FAKE_NVML,
    REPO,
    TEST_TASKS,
    ApiServer,
    RedisServer,
    WorkerProcess,
    fake_gpu_env,
    foreground,
    free_port,
    publish_catalog,
    redis_argv,
    run_cli,
    worker_env,
)
from testkit.waiting import WaitTimeout, http_ok, redis_answers, wait_for, wait_redis

__all__ = [
    "CLI",
    "FAKE_NVML",
    "REPO",
    "TEST_TASKS",
    "ApiServer",
    "RedisServer",
    "WaitTimeout",
    "WorkerProcess",
    "fake_gpu_env",
    "foreground",
    "free_port",
    "http_ok",
    "publish_catalog",
    "redis_answers",
    "redis_argv",
    "run_cli",
    "wait_for",
    "wait_redis",
    "worker_env",
]
