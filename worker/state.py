"""What a worker is and is doing, shared by the task loop (writer) and the heartbeat
(reader), and published in ``gpulane:worker:<name>`` for ``GET /workers``."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, Literal

from worker.devices import Device

__all__ = ["WorkerState"]

State = Literal["starting", "idle", "busy", "stopping"]


class WorkerState:
    def __init__(
        self, name: str, device: Device, classes: list[str], task_types: list[str]
    ) -> None:
        self.name = name
        self.host = socket.gethostname()
        self.device = device
        self.classes = classes
        self.task_types = task_types
        self.state: State = "starting"
        self.tasks_done = 0
        self.tasks_failed = 0
        self.device_sample: dict[str, Any] = {}
        self.stop_requested_at: float | None = None  # monotonic
        self.started_ms = int(time.time() * 1000)
        self._lock = threading.Lock()

    @property
    def stopping(self) -> bool:
        return self.stop_requested_at is not None

    def request_stop(self) -> None:
        with self._lock:
            if self.stop_requested_at is None:
                self.stop_requested_at = time.monotonic()
                self.state = "stopping"

    def set(self, state: State) -> None:
        with self._lock:
            if not self.stopping:
                self.state = state

    def ended(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self.tasks_done += 1
            else:
                self.tasks_failed += 1

    def device_json(self) -> dict[str, Any]:
        return self.device.to_json(self.device_sample)

    def info(self) -> dict[str, str]:
        """The worker hash fields (all strings; lists and objects as JSON)."""
        return {
            "name": self.name,
            "host": self.host,
            "pid": str(os.getpid()),
            "state": self.state,
            "classes": json.dumps(self.classes),
            "task_types": json.dumps(self.task_types),
            "device": json.dumps(self.device_json()),
            "tasks_done": str(self.tasks_done),
            "tasks_failed": str(self.tasks_failed),
            "started_ms": str(self.started_ms),
        }
