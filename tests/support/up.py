"""A `gpulane up` process under test, its output captured to a file."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

from testkit import CLI, REPO, wait_for


class Up:
    """A `gpulane up` process, its output captured to a file."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.log = Path(env["XDG_DATA_HOME"]) / f"up-{len(args)}-{os.urandom(3).hex()}.log"
        self._out = self.log.open("wb")
        self.process = subprocess.Popen(
            [*CLI, "up", *args],
            env=env,
            cwd=REPO,
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def url(self) -> str:
        def ready() -> str | None:
            assert self.process.poll() is None, self.output()
            match = re.search(r"ready: (http://\S+)", self.output())
            return match.group(1) if match else None

        return str(wait_for(ready, 60, interval_s=0.1, what="gpulane up to be ready"))

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        finally:
            self._out.close()


def up_env(data_home: Path, **settings: object) -> dict[str, str]:
    """The environment of a `gpulane up` under test: no GPULANE_* settings inherited, its
    default data dir under ``data_home``, fast leases, and ``settings`` as GPULANE_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULANE_")}
    env["XDG_DATA_HOME"] = str(data_home)  # default data dir: data_home/gpulane
    defaults = {"heartbeat_interval_s": 0.2, "lease_ttl_s": 1, "shutdown_grace_s": 5}
    for key, value in {**defaults, **settings}.items():
        env[f"GPULANE_{key.upper()}"] = str(value)
    return env
