"""Redis Sentinel for tests and benchmarks: a redis-sentinel process on a loopback port,
monitoring one master, with short failure detection so a failover takes seconds."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import redis

from testkit.procs import free_port
from testkit.waiting import wait_redis

__all__ = ["SentinelServer"]


class SentinelServer:
    """One redis-sentinel; its config file lives in ``directory`` (Sentinel rewrites it)."""

    def __init__(
        self,
        directory: Path,
        master: str,
        master_port: int,
        *,
        quorum: int = 2,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
    ) -> None:
        self.directory = directory
        self.port = free_port()
        self.master = master
        self.lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f"dir {directory}",
            f"sentinel monitor {master} 127.0.0.1 {master_port} {quorum}",
            f"sentinel down-after-milliseconds {master} {down_after_ms}",
            f"sentinel failover-timeout {master} {failover_timeout_ms}",
            f"sentinel parallel-syncs {master} 1",
        ]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)

    def start(self) -> SentinelServer:
        binary = shutil.which("redis-sentinel") or "/usr/bin/redis-sentinel"
        self.directory.mkdir(parents=True, exist_ok=True)
        conf = self.directory / "sentinel.conf"
        conf.write_text("\n".join(self.lines) + "\n")
        log = (self.directory / "sentinel.log").open("wb")
        self.process = subprocess.Popen([binary, str(conf)], stdout=log, stderr=subprocess.STDOUT)
        wait_redis(self.client(), what=f"redis-sentinel on port {self.port}")
        return self

    def state(self) -> dict[str, Any]:
        """SENTINEL MASTER <name>: what this sentinel knows (num-slaves, ...)."""
        info = self.client().sentinel_master(self.master)
        assert isinstance(info, dict), info
        return info

    def master_port(self) -> int:
        host_port = self.client().sentinel_get_master_addr_by_name(self.master)
        assert isinstance(host_port, tuple), host_port
        return int(host_port[1])

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
