"""Device telemetry sampled on a thread of its own, watched by the heartbeat.

Sampling never runs on the task loop, and not on the heartbeat thread either: an NVML
call on a device that stopped answering can block for a long time, and the heartbeat
must keep renewing the lease and notice the hang instead of sharing it. The heartbeat
reads the latest sample (never blocking) and asks :meth:`DeviceWatch.problem`, which
reports a lost device or a sample unanswered for ``timeout_s``.

Cost: NVML's calls are ctypes calls, which release the GIL while the driver answers,
so the task thread is not held up; the Python side of one sample is a few tens of
microseconds, once per heartbeat (``scripts/telemetry_cost.py`` measures it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from worker.gpu.budget import torch_memory
from worker.gpu.devices import Device, DeviceLost, telemetry

__all__ = ["DeviceWatch"]

log = logging.getLogger("gpulane.worker")

Sample = Callable[[Device], dict[str, Any]]


class DeviceWatch:
    def __init__(
        self,
        device: Device,
        interval_s: float,
        timeout_s: float,
        sample: Sample = telemetry,
    ) -> None:
        self.device = device
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._sample = sample
        self._latest: dict[str, Any] = {}
        self._lost: str | None = None
        self._started_at: float | None = None  # monotonic start of a sample in progress
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # Daemon: a thread stuck inside the driver must not keep the process alive.
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)

    def start(self) -> DeviceWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def latest(self) -> dict[str, Any]:
        """The last complete sample ({} before the first)."""
        with self._lock:
            return self._latest

    def problem(self) -> str | None:
        """Why the device is unusable, or None: lost, or not answering for timeout_s."""
        with self._lock:
            if self._lost is not None:
                return self._lost
            started = self._started_at
        if started is not None and time.monotonic() - started > self.timeout_s:
            return (
                f"{self.device.label} ({self.device.uuid}) stopped answering: an NVML "
                f"sample has not returned for {self.timeout_s:g} s"
            )
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._started_at = time.monotonic()
            try:
                sample = self._sample(self.device)
                # With it, what PyTorch held then: a reservation made after the sample
                # is free in it and must not count twice (GpuBudget.available_mb).
                sample["torch_reserved_bytes"] = torch_memory()[0]
            except DeviceLost as exc:
                with self._lock:
                    self._lost = f"{self.device.label} ({self.device.uuid}) is lost: {exc}"
                    self._started_at = None
                return
            except Exception:  # a bug in a sampler must not read as a hung device
                log.exception("device sample failed")
                sample = {}
            with self._lock:
                self._latest = sample
                self._started_at = None
            self._stop.wait(self.interval_s)
