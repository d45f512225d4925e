"""The private redis-server ``gpulane up`` starts when no Redis URL is given.

It listens on a Unix socket inside the data directory only (no TCP port: two
instances on one machine cannot collide, and nothing on the network reaches it),
with AOF on and ``noeviction``, so queued tasks survive a restart of the stack.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

__all__ = ["EmbeddedRedis", "RedisNotFound"]

_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS


class RedisNotFound(RuntimeError):
    pass


def _running(pid: int) -> bool:
    """Alive and not a zombie (Linux /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _is_redis_in(pid: int, directory: Path) -> bool:
    """A live redis-server whose working directory (its `dir`) is ``directory``."""
    comm = Path(f"/proc/{pid}/comm").read_text().strip()
    cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    return _running(pid) and comm.startswith("redis-server") and cwd == directory.resolve()


class EmbeddedRedis:
    def __init__(self, directory: Path, preexec_fn: Callable[[], None] | None = None) -> None:
        self.directory = directory
        self.pidfile = directory / "redis.pid"
        self.preexec_fn = preexec_fn
        self.socket = directory / "redis.sock"
        if len(str(self.socket)) > _MAX_SOCKET_PATH:
            self.socket = Path(tempfile.mkdtemp(prefix="gpulane-")) / "redis.sock"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def _config(self) -> str:
        return "\n".join(
            [
                "port 0",
                f"unixsocket {self.socket}",
                f'pidfile "{self.pidfile}"',
                "unixsocketperm 700",
                f'dir "{self.directory}"',
                "appendonly yes",
                "appendfsync everysec",
                "maxmemory-policy noeviction",
                'save ""',
                f'logfile "{self.directory / "redis.log"}"',
                "",
            ]
        )

    def start(self, timeout_s: float = 15.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisNotFound(
                "redis-server is not on PATH: install it (apt-get install redis-server, "
                "brew install redis), or point GPULANE_REDIS_URL at a Redis you run."
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        conf = self.directory / "redis.conf"
        conf.write_text(self._config())
        # Own session: a terminal's Ctrl-C must not stop Redis before the workers
        # have handed their tasks back; the supervisor stops it last.
        self.process = subprocess.Popen(
            [binary, str(conf)],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=self.preexec_fn,  # noqa: PLW1509 - the supervisor runs no threads
        )
        deadline = time.monotonic() + timeout_s
        client = Redis(unix_socket_path=str(self.socket), socket_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited at start; see {self.directory / 'redis.log'}"
                    )
                try:
                    if client.ping():
                        return
                except RedisError:
                    time.sleep(0.05)
            raise RuntimeError(f"redis-server did not answer within {timeout_s:g} s")
        finally:
            client.close()

    def stop_stale(self, timeout_s: float = 10.0) -> int | None:
        """Stop a redis-server an earlier, killed `gpulane up` left running on this
        directory (its pidfile names a live redis-server whose config is ours). The
        caller holds the data directory's lock, so no live `up` owns it. SIGTERM first,
        so it flushes its AOF. Returns the pid stopped, or None."""
        try:
            pid = int(self.pidfile.read_text().strip())
            ours = _is_redis_in(pid, self.directory)
        except (OSError, ValueError):
            return None
        if not ours:
            return None  # gone, or a recycled pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        self.pidfile.unlink(missing_ok=True)
        return pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM: redis-server flushes the AOF and exits."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
