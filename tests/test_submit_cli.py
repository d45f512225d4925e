"""`gpulane submit` as a person types it: mistakes it refuses itself, and Ctrl-C while
it waits."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from conftest import WorkerFactory, wait_status

from dispatcher.contract.exits import EXIT_INTERRUPTED, EXIT_USAGE
from testkit import CLI, REPO, ApiServer, foreground, free_port, run_cli, wait_for


def _env() -> dict[str, str]:
    # Not PYTHONUNBUFFERED either: an operator's shell has none, and output that must
    # appear at once (the task id before a long wait) has to flush for itself.
    drop = ("GPULANE_", "PYTHONUNBUFFERED")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--type", "echo", "--timeout", "nan"], "--timeout"),
        (["--type", "echo", "--timeout", "inf"], "--timeout"),
        (["--type", "echo", "--timeout", "0"], "--timeout"),
        (["--type", "echo", "--timeout", "soon"], "--timeout"),
        (["--type", "echo", "--args", '{"x": NaN}'], "NaN"),
        (["--type", "echo", "--args", '{"x": -Infinity}'], "Infinity"),
        (["--type", "echo", "--args", '{"x": 1e400}'], "1e400"),
        (["--type", "echo", "--args", "[1]"], "JSON object"),
        (["--type", "echo", "--args", "{x"], "not valid JSON"),
        (["/nonexistent.pdf"], "/nonexistent.pdf"),
        ([], "FILE or --type"),
    ],
)
def test_submit_refuses_its_own_usage_mistakes(args: list[str], needle: str) -> None:
    """Found before anything is sent: exit 2 and one line, even with no API to reach
    (an unreachable one would be exit 3)."""
    url = f"http://127.0.0.1:{free_port()}"
    done = run_cli("submit", *args, "--url", url, env=_env())
    assert done.returncode == EXIT_USAGE == 2, done.stderr
    assert "Traceback" not in done.stderr
    message = done.stderr.strip()
    assert "\n" not in message and message.startswith("gpulane submit: "), message
    assert needle in message, message


def test_ctrl_c_while_waiting_leaves_the_task_running(
    api: ApiServer, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    start_worker("submit-waited-on")
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        args = ["--type", "sleep", "--args", '{"seconds": 3}', "--wait", "--url", api.url]
        process = subprocess.Popen(
            foreground([*CLI, "submit", *args]),  # Ctrl-C reaches it from any test run
            env=_env(),
            cwd=REPO,
            stdout=stdout,
            stderr=stderr,
        )
        try:
            # Submitted (its id printed) and following it: the first status line.
            wait_for(lambda: err.read_text().strip(), 20, what="submit to start waiting")
            task_id = out.read_text().split()[0]
            process.send_signal(signal.SIGINT)
            code = process.wait(15)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert code == EXIT_INTERRUPTED == 130
    text = err.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    last = text.strip().splitlines()[-1]
    assert re.fullmatch(rf"interrupted: task {task_id} keeps going .*", last), text
    with httpx.Client(base_url=api.url, timeout=10) as http:  # and it does
        assert wait_status(http, task_id, {"succeeded", "failed"})["status"] == "succeeded"
