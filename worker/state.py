"""What a worker is and is doing, shared by the task loop (writer) and the heartbeat
(reader), and published in ``gpulane:worker:<name>`` for ``GET /workers``.

States: ``starting`` (registered, loading), ``waiting_for_gpu`` (every GPU it may use
is claimed; it serves nothing yet), ``idle``, ``busy``, ``backend_down`` (a backend
worker whose server does not answer: it takes no task until it does), ``stopping``
(finishing its task after SIGTERM) and ``unhealthy`` (its GPU faulted or stopped
answering: it takes no more tasks and exits to be restarted). ``reason`` says why for
``waiting_for_gpu``, ``backend_down`` and ``unhealthy``, and ``starting`` says
"loading model" while task modules' models load (a backend worker: "waiting for
backend").
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from typing import Any

from dispatcher.contract.workers import WorkerStatus
from worker.gpu.devices import Device

__all__ = ["State", "WorkerState"]

State = WorkerStatus


class WorkerState:
    def __init__(
        self, name: str, device: Device | None, classes: list[str], task_types: list[str]
    ) -> None:
        self.name = name
        self.host = socket.gethostname()
        self.device = device  # None until one is chosen (and, for a GPU, claimed)
        self.classes = classes
        self.task_types = task_types
        self.state: State = "starting"
        self.reason = ""
        self.tasks_done = 0
        self.tasks_failed = 0
        self.device_sample: dict[str, Any] = {}
        self.models: dict[str, dict[str, Any]] = {}  # model id -> {"load_s", "device"}
        self.gpu_capacity_mb: int | None = None  # most GPU memory a task could get; None: no limit
        self.speed = 1.0  # declared relative speed (worker_speed): doorbell order
        # A backend worker's server: {url, slots, busy, models}; its routed types, the
        # idle sets it parks in (the reaper reads them from the worker hash).
        self.backend: dict[str, Any] | None = None
        self.parks: list[str] = []
        self.stop_requested_at: float | None = None  # monotonic
        self.unhealthy_at: float | None = None  # monotonic
        self.recycled = False  # stopping because its memory grew past max_worker_rss_mb
        self.started_ms = int(time.time() * 1000)
        # Lets this process register twice under its name (before and after it has a
        # device) while any other process with the name is refused.
        self.instance = secrets.token_hex(8)
        self._lock = threading.Lock()

    @property
    def stopping(self) -> bool:
        return self.stop_requested_at is not None

    @property
    def unhealthy(self) -> bool:
        return self.unhealthy_at is not None

    def request_stop(self) -> None:
        with self._lock:
            if self.stop_requested_at is None:
                self.stop_requested_at = time.monotonic()
                self.state = "stopping"

    def recycle(self, reason: str) -> None:
        """Stop after the task just reported, to be restarted fresh (exit 72)."""
        with self._lock:
            if self.stop_requested_at is None:
                self.stop_requested_at = time.monotonic()
                self.state = "stopping"
                self.reason = reason
                self.recycled = True

    def mark_unhealthy(self, reason: str) -> bool:
        """Stop taking tasks for good; False if it was already unhealthy."""
        with self._lock:
            if self.unhealthy_at is not None:
                return False
            self.unhealthy_at = time.monotonic()
            self.stop_requested_at = self.stop_requested_at or self.unhealthy_at
            self.state = "unhealthy"
            self.reason = reason
            return True

    def set(self, state: State, reason: str = "") -> None:
        with self._lock:
            if not self.stopping:
                self.state = state
                self.reason = reason

    def ended(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self.tasks_done += 1
            else:
                self.tasks_failed += 1

    def device_json(self) -> dict[str, Any] | None:
        return self.device.to_json(self.device_sample) if self.device else None

    def info(self) -> dict[str, str]:
        """The worker hash fields (all strings; lists and objects as JSON)."""
        return {
            "name": self.name,
            "host": self.host,
            "pid": str(os.getpid()),
            "instance": self.instance,
            "state": self.state,
            "reason": self.reason,
            "classes": json.dumps(self.classes),
            "task_types": json.dumps(self.task_types),
            "device": json.dumps(self.device_json()),
            "tasks_done": str(self.tasks_done),
            "tasks_failed": str(self.tasks_failed),
            "started_ms": str(self.started_ms),
            "models": json.dumps(self.models),
            "gpu_capacity_mb": "" if self.gpu_capacity_mb is None else str(self.gpu_capacity_mb),
            "speed": repr(self.speed),
            "backend": json.dumps(self.backend) if self.backend else "",
            "parks": json.dumps(self.parks) if self.parks else "",
        }
