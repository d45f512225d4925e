"""What an operator reads in a terminal: the real `gpulane status` command against a
running stack, and a worker's JSON log lines."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from conftest import WorkerFactory, submit, wait_status
from support.observe import json_lines

from testkit import REPO, ApiServer, foreground, free_port, wait_for

GPULANE = str(Path(sys.executable).parent / "gpulane")  # the installed console script


def _env() -> dict[str, str]:
    # Wide and plain: rich would wrap a table to a pipe's default 80 columns.
    return {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}


def test_status_shows_classes_and_workers(api: ApiServer, start_worker: WorkerFactory) -> None:
    worker = start_worker("status-worker")
    done = subprocess.run(
        [GPULANE, "status", "--url", api.url],
        env=_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "classes (priority order)" in out and "workers (1 live)" in out
    assert out.index("interactive") < out.index("batch")  # priority order
    row = next(line for line in out.splitlines() if worker.name in line)
    assert "cpu" in row and "interactive,batch" in row
    assert "idle" in row or "starting" in row


class Terminal:
    """A pseudo-terminal for a command: rich draws its live display only on a tty."""

    def __init__(self, argv: list[str]) -> None:
        master, slave = pty.openpty()
        env = {**_env(), "TERM": "xterm", "LINES": "60"}
        # foreground: Ctrl-C (interrupt) reaches it from any test run.
        self.process = subprocess.Popen(
            foreground(argv), env=env, cwd=REPO, stdin=slave, stdout=slave, stderr=slave
        )
        os.close(slave)
        self._master = master
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # the command exited and closed its side
                return
            if not chunk:
                return
            self._chunks.append(chunk)

    @property
    def screen(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def interrupt(self, timeout_s: float = 15) -> int:
        self.process.send_signal(signal.SIGINT)
        code = self.process.wait(timeout_s)
        self._reader.join(5)
        os.close(self._master)
        return code


def test_status_watch_refreshes_until_interrupted(
    api: ApiServer, http: httpx.Client, start_worker: WorkerFactory
) -> None:
    worker = start_worker("watched-worker")
    term = Terminal([GPULANE, "status", "--watch", "--url", api.url])
    try:
        wait_for(lambda: worker.name in term.screen, 20, what="the first frame")
        # A task started after the first frame shows up in a later one.
        task = submit(http, "sleep", {"seconds": 3})
        wait_status(http, task["id"], {"running"})
        wait_for(lambda: task["id"][:8] in term.screen, 20, what="a refreshed frame")
    finally:
        code = term.interrupt()
    assert code == 0  # Ctrl-C is how --watch ends: not an error
    assert "Traceback" not in term.screen


def test_status_says_when_the_api_is_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [GPULANE, "status", "--url", url],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 3
    assert f"cannot read {url}" in done.stderr and "Traceback" not in done.stderr


def test_worker_logs_one_json_line_per_transition(
    http: httpx.Client, start_worker: WorkerFactory
) -> None:
    worker = start_worker("json-logger", log_format="json")
    task = submit(http, "echo", {"hello": "logs"}, cls="interactive")
    wait_status(http, task["id"], {"succeeded"})

    def succeeded_line() -> dict | None:
        for entry in json_lines(worker.log):  # every line must be JSON
            if entry.get("message") == "task succeeded" and entry.get("task") == task["id"]:
                return entry
        return None

    line = wait_for(succeeded_line, 10, what="the 'task succeeded' log line")
    assert line["class"] == "interactive" and line["type"] == "echo"
    assert line["worker"] == "json-logger" and line["level"] == "info"
    assert isinstance(line["elapsed_s"], int | float) and line["elapsed_s"] >= 0
    assert line["ts"].endswith("+00:00") and line["logger"] == "gpulane.worker"
    started = [e for e in json_lines(worker.log) if e.get("message") == "task started"]
    assert [e["task"] for e in started] == [task["id"]]


def test_a_batch_shows_as_its_first_task_and_the_rest() -> None:
    from dispatcher.ops.status import _current

    assert _current({"current_task": "a", "current_batch": ["a", "b", "c"]}) == "a (+2 in batch)"
    assert _current({"current_task": "a", "current_batch": ["a"]}) == "a"
    assert _current({"current_task": None, "current_batch": []}) == "-"
