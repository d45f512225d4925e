"""`gpulane submit`: send one task, optionally follow it to the end."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx

from dispatcher.client import Client, GpulaneError
from dispatcher.contract.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNAVAILABLE
from dispatcher.contract.jobs import TaskStatus

__all__ = ["submit_and_report"]

_EXIT = {
    TaskStatus.SUCCEEDED: EXIT_OK,
    TaskStatus.FAILED: EXIT_FAILED,
    TaskStatus.CANCELED: EXIT_FAILED,
}


def _line(record: dict[str, Any]) -> str:
    status = str(record["status"])
    if status == "queued":
        return f"queued, position {record.get('position')}"
    progress = record.get("progress") or {}
    if status == "running" and progress:
        return f"running {progress.get('fraction', 0) * 100:3.0f}%  {progress.get('message', '')}"
    return status


def submit_and_report(
    client: Client,
    file: Path | None,
    task_type: str | None,
    cls: str | None,
    args: dict[str, Any] | None,
    timeout_s: float | None,
    wait: bool,
) -> int:
    try:
        task = client.submit(task_type, args, cls=cls, file=file, timeout_s=timeout_s)
    except GpulaneError as exc:
        print(f"refused: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (httpx.HTTPError, OSError) as exc:
        print(f"cannot submit: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    est = task.get("estimated_wait_s")
    print(
        f"{task['id']}  {task['type']} ({task['class']}): {task['status']}, position "
        f"{task.get('position')}, estimated {'-' if est is None else f'{est:.1f}s'}",
        flush=True,  # the id, now: a pipe or a file would hold it until the wait ends
    )
    if not wait:
        return EXIT_OK
    tty = sys.stderr.isatty()
    last = ""

    def show(record: dict[str, Any]) -> None:
        nonlocal last
        line = _line(record)
        if line != last:
            print(
                f"\r\033[K{line}" if tty else line,
                end="" if tty else "\n",
                file=sys.stderr,
                flush=True,
            )
            last = line

    # Long-polls of 1 s: the result shows the moment the task ends, progress each second.
    try:
        record = client.wait(task["id"], on_update=show, wait_s=1.0)
    except KeyboardInterrupt:
        # Only the waiting stops: the task is the API's now, and runs on.
        end_progress = "\n" if tty else ""  # the progress line has no newline of its own
        print(
            f"{end_progress}interrupted: task {task['id']} keeps going "
            f"(cancel: DELETE /tasks/{task['id']})",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    if tty:
        print(file=sys.stderr)
    print(
        json.dumps(
            {k: record[k] for k in ("status", "result", "error", "queue_wait_s", "run_s")}, indent=2
        )
    )
    return _EXIT.get(record["status"], EXIT_FAILED)
