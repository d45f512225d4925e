"""Which device a worker runs on: NVIDIA GPUs found through NVML, or the CPU.

NVML numbers devices its own way (it ignores ``CUDA_VISIBLE_DEVICES`` and may not
follow CUDA's order), so devices are identified by UUID and a worker is pinned with
``CUDA_VISIBLE_DEVICES=<UUID>``. No driver, no library or any NVML error means the
``cpu`` device (invariant 6): logged once, never a crash.

NVML is initialised once per process and kept: ``nvmlInit`` costs milliseconds to
seconds (it may wake the driver), far more than the samples taken every heartbeat.
"""

from __future__ import annotations

import atexit
import logging
import os
import platform
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

from dispatcher.contract import cpus

__all__ = [
    "CPU",
    "Device",
    "DeviceError",
    "DeviceLost",
    "discover",
    "pin",
    "reset",
    "select",
    "telemetry",
]

log = logging.getLogger("gpulane.devices")

# NVML return codes that mean the card is gone until a reset (pynvml's values).
_LOST_CODES = frozenset({15, 16})  # NVML_ERROR_GPU_IS_LOST, NVML_ERROR_RESET_REQUIRED


class DeviceError(ValueError):
    """The requested device does not exist on this host (or cannot be used)."""


class DeviceLost(RuntimeError):
    """NVML says the GPU is lost or needs a reset: nothing more will run on it."""


@dataclass(frozen=True)
class Device:
    kind: Literal["gpu", "cpu"]
    index: int | None
    uuid: str | None
    name: str
    memory_total_bytes: int | None = None
    # The CPU's: the CPUs this process may run on (`up` pins each CPU worker to a
    # share before exec, so it is fixed from the start), in `taskset -c` form.
    cpus: str | None = None

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
            "temperature_c": sample.get("temperature_c"),
            "power_w": sample.get("power_w"),
            "cpus": self.cpus,
        }


CPU = Device(
    kind="cpu",
    index=None,
    uuid=None,
    name=platform.processor() or "cpu",
    cpus=cpus.describe(cpus.allowed()),
)


@dataclass
class _Nvml:
    """The process' one NVML session: the module once initialised, or None."""

    tried: bool = False
    module: ModuleType | None = None
    handles: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATE = _Nvml()


def _nvml() -> ModuleType | None:
    """The pynvml module, initialised once, or None (logged once) when NVML is unusable."""
    with _STATE.lock:
        if not _STATE.tried:
            _STATE.tried = True
            _STATE.module = _init()
        return _STATE.module


def _init() -> ModuleType | None:
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
    atexit.register(_shutdown, pynvml)
    module: ModuleType = pynvml
    return module


def _shutdown(nvml: ModuleType) -> None:
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError:
        log.debug("nvmlShutdown failed at exit", exc_info=True)


def reset() -> None:
    """Forget the NVML session (tests swap the pynvml module between cases)."""
    with _STATE.lock:
        if _STATE.module is not None:
            _shutdown(_STATE.module)
        _STATE.tried, _STATE.module = False, None
        _STATE.handles.clear()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _lost(nvml: ModuleType, exc: Exception) -> bool:
    return isinstance(exc, nvml.NVMLError) and getattr(exc, "value", None) in _LOST_CODES


def discover() -> list[Device]:
    """Every usable NVIDIA GPU on this host, by NVML index; empty when there is none.

    A card NVML cannot read (lost, fallen off the bus) is left out with a warning, so
    one dead card does not turn the whole host into a cpu host."""
    nvml = _nvml()
    if nvml is None:
        return []
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except nvml.NVMLError as exc:
        log.warning("NVML cannot count devices (%s); using the cpu device", exc)
        return []
    devices = []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            devices.append(
                Device(
                    kind="gpu",
                    index=index,
                    uuid=uuid,
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_total_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                )
            )
        except nvml.NVMLError as exc:
            log.warning("GPU %d is not usable (%s); leaving it out", index, exc)
    return devices


def select(spec: str, devices: list[Device]) -> list[Device]:
    """Resolve ``--gpu`` to the devices the worker may claim, in preference order:
    ``none`` (the cpu), ``auto`` (every GPU, else the cpu), an index or a UUID."""
    if spec == "none":
        return [CPU]
    if spec == "auto":
        return devices or [CPU]
    for device in devices:
        if spec in (str(device.index), device.uuid):
            return [device]
    known = ", ".join(f"{d.index} ({d.uuid})" for d in devices) or "none usable"
    raise DeviceError(f"no GPU {spec!r} on this host; GPUs found: {known}")


def pin(device: Device) -> None:
    """Make CUDA in this process see only ``device``; call before importing task code."""
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = device.uuid or ""


def _handle(nvml: ModuleType, uuid: str) -> Any:
    handle = _STATE.handles.get(uuid)
    if handle is None:
        handle = _STATE.handles[uuid] = nvml.nvmlDeviceGetHandleByUUID(uuid)
    return handle


def telemetry(device: Device) -> dict[str, Any]:
    """One sample of the device: utilization (0-1), memory, temperature (°C), power (W).

    A value the card does not support (or fails to give this time) is None. Raises
    :class:`DeviceLost` when NVML reports the card lost or needing a reset."""
    if device.kind == "cpu" or device.uuid is None:
        return {}
    nvml = _nvml()
    if nvml is None:
        return {}
    try:
        handle = _handle(nvml, device.uuid)
    except nvml.NVMLError as exc:
        if _lost(nvml, exc):
            raise DeviceLost(f"NVML: {exc}") from exc
        log.warning("NVML cannot open %s: %s", device.label, exc)
        return {}
    util = _read(nvml, nvml.nvmlDeviceGetUtilizationRates, handle)
    memory = _read(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
    temperature = _read(nvml, nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
    power_mw = _read(nvml, nvml.nvmlDeviceGetPowerUsage, handle)
    out: dict[str, Any] = {
        "utilization": util.gpu / 100 if util is not None else None,
        "memory_used_bytes": int(memory.used) if memory is not None else None,
        "temperature_c": temperature,
        "power_w": power_mw / 1000 if power_mw is not None else None,
    }
    if memory is not None:
        out["memory_total_bytes"] = int(memory.total)
    return out


def _read(nvml: ModuleType, call: Callable[..., Any], *args: Any) -> Any:
    """One NVML reading, None when the card does not support it (or fails this time)."""
    try:
        return call(*args)
    except nvml.NVMLError as exc:
        if _lost(nvml, exc):
            raise DeviceLost(f"NVML: {exc}") from exc
        return None


if __name__ == "__main__":  # `python -m worker.gpu.devices`: what `gpulane up` counts
    import json
    import sys

    json.dump([d.to_json() for d in discover()], sys.stdout)
