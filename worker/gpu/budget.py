"""What GPU memory this worker can give a task: placement by memory.

Two numbers, both in MB:

* ``capacity_mb``: the most a task could ever get here, the card's total less what
  this worker's loaded models hold (measured through NVML around the loads). Published
  in the worker hash; the API refuses a task no live worker's capacity could hold.
* ``available_mb()``: what a task could get now, the card's free memory in the latest
  telemetry sample plus what PyTorch's caching allocator holds unused in this process
  (free for our next task, though NVML counts it as used), less what PyTorch reserved
  after the sample (the sampler notes its reservation with each sample). Sent with every claim:
  claim.lua skips tasks that need more, leaving them to a worker with room.

A worker on the ``cpu`` device has no GPU memory to run out of: both are None (no
limit), and it takes every task.

Workers sharing a card (``--per-gpu``) each count the whole card as capacity; the free
memory each sends with its claims is what keeps them from overcommitting it.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from worker.gpu.devices import Device, DeviceLost, telemetry

if TYPE_CHECKING:
    from worker.gpu.sampler import DeviceWatch

__all__ = ["GpuBudget", "torch_memory"]

log = logging.getLogger("gpulane.worker")

MB = 1024 * 1024


def torch_memory() -> tuple[int, int]:
    """(reserved, allocated) bytes of PyTorch's caching allocator in this process, from
    one ``memory_stats()`` (each of ``memory_reserved()``/``memory_allocated()`` builds
    it whole); (0, 0) when torch is not loaded or CUDA not started (never imported or
    initialised here)."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return 0, 0
    try:
        if not torch.cuda.is_initialized():
            return 0, 0
        stats = torch.cuda.memory_stats()
    except (RuntimeError, AttributeError):  # a CUDA error is the health check's business
        return 0, 0
    return int(stats.get("reserved_bytes.all.current", 0)), int(
        stats.get("allocated_bytes.all.current", 0)
    )


class GpuBudget:
    def __init__(self, device: Device | None, watch: DeviceWatch | None = None) -> None:
        self.device = device
        self.watch = watch
        self.models_mb = 0
        self._used_before: int | None = None

    @property
    def on_gpu(self) -> bool:
        return self.device is not None and self.device.kind == "gpu"

    def _used_now(self) -> int | None:
        if not self.on_gpu or self.device is None:
            return None
        try:
            used = telemetry(self.device).get("memory_used_bytes")
        except DeviceLost:
            return None  # the heartbeat's watch reports it
        return int(used) if used is not None else None

    def before_models(self) -> None:
        """Note the card's used memory before the model loads."""
        self._used_before = self._used_now()

    def after_models(self) -> None:
        """What the loads took: the rise in the card's used memory (0 if unknown)."""
        after = self._used_now()
        if self._used_before is not None and after is not None:
            self.models_mb = max(after - self._used_before, 0) // MB

    @property
    def capacity_mb(self) -> int | None:
        if not self.on_gpu or self.device is None or self.device.memory_total_bytes is None:
            return None
        return max(self.device.memory_total_bytes // MB - self.models_mb, 0)

    def available_mb(self) -> int | None:
        """MB a task could use now; before the first sample, the capacity."""
        capacity = self.capacity_mb
        if capacity is None:
            return None
        sample = self.watch.latest() if self.watch is not None else {}
        used, total = sample.get("memory_used_bytes"), sample.get("memory_total_bytes")
        if used is None or total is None:
            return capacity
        reserved, allocated = torch_memory()
        # What PyTorch reserved since the sample was taken is free in the sample and
        # also in the cache now: count it once.
        since = max(reserved - int(sample.get("torch_reserved_bytes", reserved)), 0)
        free = int(total) - int(used) + (reserved - allocated) - since
        return min(max(free // MB, 0), capacity)
