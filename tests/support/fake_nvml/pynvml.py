"""A stand-in for nvidia-ml-py's ``pynvml`` for tests: put this folder first on
``PYTHONPATH`` and real worker processes load it instead of the real module.

It is configured by environment variables that only this test double reads:

``GPULANE_FAKE_NVML``
    How many GPUs the host has. Unset or ``0``: no driver (``nvmlInit`` raises
    ``NVMLError_LibraryNotFound``, as on a machine without NVIDIA).
``GPULANE_FAKE_NVML_DIR``
    A folder of switches a test creates while workers run: a file ``lost-<index>``
    makes every call on that GPU raise ``NVMLError_GpuIsLost``; ``hang-<index>`` makes
    calls on it block until the file is removed (a device that stopped answering);
    ``used-<index>`` holds the MiB in use on that GPU (memory that changes while a
    worker runs; default ``index + 1`` GiB).
``GPULANE_FAKE_NVML_MEMORY_GIB``
    Comma-separated total memory per card, in GiB (``24,80``: card 0 has 24 GiB, card
    1 80 GiB); unset or missing entries: 80 GiB.

The cards: UUIDs that do not follow index order (NVML's numbering is its own), 80 GiB
each unless told otherwise; card 3 supports neither power nor temperature readings (``NotSupported``, like
some boards), so a metric one card lacks can be tested. ``calls`` counts the calls
per function, for tests that run in-process.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

NVML_TEMPERATURE_GPU = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_UNKNOWN = 999

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}

GIB = 2**30
calls: Counter[str] = Counter()
_session = {"inits": 0}  # nvmlInit calls not yet matched by nvmlShutdown


class NVMLError(Exception):
    """Like pynvml's: ``NVMLError(value)`` builds the subclass for that value."""

    _classes: dict[int, type[NVMLError]] = {}

    def __new__(cls, value: int) -> NVMLError:
        kind = NVMLError._classes.get(value, cls) if cls is NVMLError else cls
        obj = Exception.__new__(kind)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML error {self.value}")


def _subclass(name: str, value: int) -> type[NVMLError]:
    cls = type(name, (NVMLError,), {})
    NVMLError._classes[value] = cls
    return cls


NVMLError_Uninitialized = _subclass("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_NotSupported = _subclass("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NotFound = _subclass("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_DriverNotLoaded = _subclass("NVMLError_DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_LibraryNotFound = _subclass("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_GpuIsLost = _subclass("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)
NVMLError_ResetRequired = _subclass("NVMLError_ResetRequired", NVML_ERROR_RESET_REQUIRED)


def _count() -> int:
    return int(os.environ.get("GPULANE_FAKE_NVML") or 0)


def _uuid(index: int) -> str:
    return f"GPU-fa4e{_count() - 1 - index:04d}-0000-4000-8000-00000000{index:04d}"


def _check(index: int) -> None:
    """Apply the test's switches to a call on GPU ``index``."""
    if not _session["inits"]:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    switches = os.environ.get("GPULANE_FAKE_NVML_DIR")
    if not switches:
        return
    folder = Path(switches)
    while (folder / f"hang-{index}").exists():
        time.sleep(0.02)
    if (folder / f"lost-{index}").exists():
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)


def _called(name: str) -> None:
    calls[name] += 1


def nvmlInit() -> None:
    _called("nvmlInit")
    if _count() <= 0:
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    _session["inits"] += 1


def nvmlShutdown() -> None:
    _called("nvmlShutdown")
    if not _session["inits"]:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    _session["inits"] -= 1


def nvmlDeviceGetCount() -> int:
    _called("nvmlDeviceGetCount")
    if not _session["inits"]:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    return _count()


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    _called("nvmlDeviceGetHandleByIndex")
    if not 0 <= index < _count():
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    _check(index)
    return index


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> int:
    _called("nvmlDeviceGetHandleByUUID")
    text = uuid.decode() if isinstance(uuid, bytes) else uuid
    for index in range(_count()):
        if _uuid(index) == text:
            _check(index)
            return index
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetUUID(handle: int) -> str:
    _called("nvmlDeviceGetUUID")
    _check(handle)
    return _uuid(handle)


def nvmlDeviceGetName(handle: int) -> bytes:
    _called("nvmlDeviceGetName")
    _check(handle)
    return b"NVIDIA Fake H100 80GB HBM3"  # older pynvml versions return bytes


def _total(index: int) -> int:
    sizes = [s for s in os.environ.get("GPULANE_FAKE_NVML_MEMORY_GIB", "").split(",") if s]
    return int(float(sizes[index]) * GIB) if index < len(sizes) else 80 * GIB


def _used(index: int) -> int:
    switches = os.environ.get("GPULANE_FAKE_NVML_DIR")
    if switches:
        try:
            return int(float((Path(switches) / f"used-{index}").read_text()) * 2**20)
        except (FileNotFoundError, ValueError):  # absent, or caught half-written
            pass
    return (index + 1) * GIB


def nvmlDeviceGetMemoryInfo(handle: int) -> Any:
    _called("nvmlDeviceGetMemoryInfo")
    _check(handle)
    total = _total(handle)
    used = min(_used(handle), total)
    return SimpleNamespace(total=total, used=used, free=total - used)


def nvmlDeviceGetUtilizationRates(handle: int) -> Any:
    _called("nvmlDeviceGetUtilizationRates")
    _check(handle)
    return SimpleNamespace(gpu=10 * (handle + 1), memory=5)


def nvmlDeviceGetTemperature(handle: int, sensor: int) -> int:
    _called("nvmlDeviceGetTemperature")
    _check(handle)
    if handle == 3:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return 40 + handle


def nvmlDeviceGetPowerUsage(handle: int) -> int:
    """Milliwatts, as NVML reports them."""
    _called("nvmlDeviceGetPowerUsage")
    _check(handle)
    if handle == 3:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return 100_000 + 25_000 * handle
