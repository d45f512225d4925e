"""Which device a worker runs on: NVIDIA GPUs found through NVML, or the CPU.

NVML numbers devices its own way (it ignores ``CUDA_VISIBLE_DEVICES`` and may not
follow CUDA's order), so devices are identified by UUID and a worker is pinned with
``CUDA_VISIBLE_DEVICES=<UUID>``. No driver, no library or any NVML error means the
``cpu`` device (invariant 6): logged once, never a crash.
"""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

__all__ = ["CPU", "Device", "DeviceError", "discover", "pin", "select", "telemetry"]

log = logging.getLogger("gpulane.devices")


class DeviceError(ValueError):
    """The requested device does not exist on this host."""


@dataclass(frozen=True)
class Device:
    kind: Literal["gpu", "cpu"]
    index: int | None
    uuid: str | None
    name: str
    memory_total_bytes: int | None = None

    @property
    def label(self) -> str:
        return f"gpu{self.index}" if self.kind == "gpu" else "cpu"

    def to_json(self, sample: dict[str, Any] | None = None) -> dict[str, Any]:
        """The public ``device`` object of ``GET /workers`` and task records."""
        sample = sample or {}
        return {
            "kind": self.kind,
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "utilization": sample.get("utilization"),
            "memory_used_bytes": sample.get("memory_used_bytes"),
            "memory_total_bytes": sample.get("memory_total_bytes", self.memory_total_bytes),
        }


CPU = Device(kind="cpu", index=None, uuid=None, name=platform.processor() or "cpu")


def _nvml() -> ModuleType | None:
    """The pynvml module, initialised, or None (logged once) when NVML cannot be used."""
    try:
        import pynvml
    except ImportError:
        log.info("nvidia-ml-py is not installed; using the cpu device")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.info("no NVIDIA driver usable (%s); using the cpu device", exc)
        return None
    module: ModuleType = pynvml
    return module


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def discover() -> list[Device]:
    """Every NVIDIA GPU on this host, by NVML index; empty when there is none."""
    nvml = _nvml()
    if nvml is None:
        return []
    devices = []
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            devices.append(
                Device(
                    kind="gpu",
                    index=index,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_total_bytes=int(memory.total),
                )
            )
    except nvml.NVMLError as exc:
        log.warning("NVML failed while listing devices (%s); using the cpu device", exc)
        return []
    finally:
        nvml.nvmlShutdown()
    return devices


def select(spec: str, devices: list[Device]) -> Device:
    """Resolve ``--gpu``: ``none``, ``auto`` (first GPU, else cpu), an index or a UUID."""
    if spec == "none":
        return CPU
    if spec == "auto":
        return devices[0] if devices else CPU
    for device in devices:
        if spec in (str(device.index), device.uuid):
            return device
    known = ", ".join(f"{d.index} ({d.uuid})" for d in devices) or "none"
    raise DeviceError(f"no GPU {spec!r} on this host; GPUs found: {known}")


def pin(device: Device) -> None:
    """Make CUDA in this process see only ``device``; call before importing task code."""
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = device.uuid or ""


def telemetry(device: Device) -> dict[str, Any]:
    """A sample of the device's utilization and memory; unsupported values are None."""
    if device.kind == "cpu":
        return {}
    nvml = _nvml()
    if nvml is None:
        return {}
    out: dict[str, Any] = {}
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(device.uuid)
        try:
            out["utilization"] = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100
        except nvml.NVMLError:
            out["utilization"] = None
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            out["memory_used_bytes"] = int(memory.used)
            out["memory_total_bytes"] = int(memory.total)
        except nvml.NVMLError:
            out["memory_used_bytes"] = None
    except nvml.NVMLError as exc:
        log.warning("NVML sample of %s failed: %s", device.label, exc)
    finally:
        nvml.nvmlShutdown()
    return out


if __name__ == "__main__":  # `python -m worker.devices`: what `gpulane up` counts
    import json
    import sys

    json.dump([d.to_json() for d in discover()], sys.stdout)
