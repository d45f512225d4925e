"""Device discovery at the NVML boundary: no NVIDIA here means the cpu device."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from worker import devices
from worker.devices import CPU, Device, DeviceError, discover, pin, select


class FakeNVMLError(Exception):
    pass


def fake_pynvml(count: int = 4, init_error: bool = False) -> types.ModuleType:
    """A stand-in for nvidia-ml-py with `count` GPUs whose UUIDs do not follow index order."""
    module = types.ModuleType("pynvml")
    module.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
    uuids = [f"GPU-{i:08x}-aaaa" for i in reversed(range(count))]

    def init() -> None:
        if init_error:
            raise FakeNVMLError("Driver Not Loaded")

    memory = types.SimpleNamespace(total=80 * 2**30, used=2**30)
    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: count  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    module.nvmlDeviceGetUUID = lambda h: uuids[h]  # type: ignore[attr-defined]
    module.nvmlDeviceGetName = lambda h: b"NVIDIA H100"  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = lambda h: memory  # type: ignore[attr-defined]
    return module


def test_no_nvidia_here_means_cpu() -> None:
    assert discover() == []  # this machine has no driver: logged, not raised
    assert select("auto", []) == CPU
    assert CPU.to_json()["kind"] == "cpu"


def test_discovery_with_fake_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(4))
    found = discover()
    assert [d.index for d in found] == [0, 1, 2, 3]
    assert found[0].uuid == "GPU-00000003-aaaa" and found[0].name == "NVIDIA H100"
    assert found[2].memory_total_bytes == 80 * 2**30
    assert select("2", found) == found[2]
    assert select("GPU-00000000-aaaa", found) == found[3]
    with pytest.raises(DeviceError, match="no GPU '7'"):
        select("7", found)


def test_driver_not_loaded_is_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=True))
    assert discover() == []


def test_pin_uses_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "environ", dict(os.environ))
    pin(Device("gpu", 1, "GPU-1234", "x"))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-1234"
    pin(CPU)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_module_has_no_import_of_cuda_libraries() -> None:
    source = Path(devices.__file__).read_text()
    for library in ("torch", "cupy", "tensorflow"):
        assert f"import {library}" not in source


def _json(device: Device) -> dict[str, Any]:
    return device.to_json({"utilization": 0.5, "memory_used_bytes": 1})


def test_device_json_shape() -> None:
    body = _json(Device("gpu", 0, "GPU-1", "A100", memory_total_bytes=10))
    assert body == {
        "kind": "gpu",
        "index": 0,
        "uuid": "GPU-1",
        "name": "A100",
        "utilization": 0.5,
        "memory_used_bytes": 1,
        "memory_total_bytes": 10,
    }
