"""Device discovery and telemetry at the NVML boundary: the real pynvml here (no
driver: the cpu device), and the fake pynvml of tests/support/fake_nvml for GPUs."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from support.cpus import cpu_set

from testkit import FAKE_NVML, wait_for
from worker.gpu import devices
from worker.gpu.budget import GpuBudget
from worker.gpu.devices import (
    CPU,
    Device,
    DeviceError,
    DeviceLost,
    discover,
    pin,
    select,
    telemetry,
)
from worker.gpu.sampler import DeviceWatch


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The fake pynvml with 4 GPUs, loaded fresh; NVML state in worker.gpu.devices reset."""
    monkeypatch.setenv("GPULANE_FAKE_NVML", "4")
    monkeypatch.delenv("GPULANE_FAKE_NVML_DIR", raising=False)
    monkeypatch.syspath_prepend(str(FAKE_NVML))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    module = importlib.import_module("pynvml")
    assert module.__file__ and Path(module.__file__).parent == FAKE_NVML
    devices.reset()
    yield module
    devices.reset()
    sys.modules.pop("pynvml", None)


@pytest.fixture
def real_nvml() -> Iterator[None]:
    sys.modules.pop("pynvml", None)
    devices.reset()
    yield
    devices.reset()


def test_no_nvidia_here_means_cpu(real_nvml: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "gpulane.devices"):
        assert discover() == []  # this machine has no driver: logged, not raised
        assert discover() == []
        assert telemetry(Device("gpu", 0, "GPU-x", "x")) == {}
    assert len([r for r in caplog.records if "cpu device" in r.message]) == 1  # once
    assert select("auto", []) == [CPU]
    assert CPU.to_json()["kind"] == "cpu"


def test_discovery_by_uuid(fake_nvml: ModuleType) -> None:
    found = discover()
    assert [d.index for d in found] == [0, 1, 2, 3]
    assert found[0].uuid == "GPU-fa4e0003-0000-4000-8000-000000000000"  # not in index order
    assert found[0].name == "NVIDIA Fake H100 80GB HBM3"  # bytes from older pynvml decoded
    assert found[2].memory_total_bytes == 80 * 2**30
    assert select("2", found) == [found[2]]
    assert select(str(found[3].uuid), found) == [found[3]]
    assert select("auto", found) == found
    assert select("none", found) == [CPU]
    with pytest.raises(DeviceError, match="no GPU '7'"):
        select("7", found)


def test_nvml_initialised_once_per_process(fake_nvml: ModuleType) -> None:
    found = discover()
    for _ in range(50):
        telemetry(found[1])
    discover()
    assert fake_nvml.calls["nvmlInit"] == 1
    assert fake_nvml.calls["nvmlShutdown"] == 0  # kept open; closed at exit
    assert fake_nvml.calls["nvmlDeviceGetHandleByUUID"] == 1  # handle cached


def test_telemetry_sample_and_unsupported_metrics(fake_nvml: ModuleType) -> None:
    found = discover()
    assert telemetry(found[1]) == {
        "utilization": 0.2,
        "memory_used_bytes": 2 * 2**30,
        "memory_total_bytes": 80 * 2**30,
        "temperature_c": 41,
        "power_w": 125.0,
    }
    card3 = telemetry(found[3])  # supports neither power nor temperature
    assert card3["temperature_c"] is None and card3["power_w"] is None
    assert card3["utilization"] == 0.4
    body = found[3].to_json(card3)
    assert body["kind"] == "gpu" and body["uuid"] == found[3].uuid
    assert body["power_w"] is None and body["memory_used_bytes"] == 4 * 2**30
    assert telemetry(CPU) == {}


def test_lost_gpu(fake_nvml: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPULANE_FAKE_NVML_DIR", str(tmp_path))
    found = discover()
    (tmp_path / "lost-2").touch()
    with pytest.raises(DeviceLost, match="GPU is lost"):
        telemetry(found[2])
    assert telemetry(found[1])["utilization"] == 0.2  # the others still answer
    devices.reset()
    # A lost card is left out of discovery; the host does not become a cpu host.
    assert [d.index for d in discover()] == [0, 1, 3]
    with pytest.raises(DeviceError, match="no GPU '2'"):
        select("2", discover())


def test_driver_not_loaded_is_cpu(fake_nvml: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULANE_FAKE_NVML", "0")  # nvmlInit raises LibraryNotFound
    assert discover() == []


def test_device_watch_reports_a_lost_and_a_hung_device(
    fake_nvml: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPULANE_FAKE_NVML_DIR", str(tmp_path))
    gpu0, gpu1 = discover()[:2]
    watch = DeviceWatch(gpu0, interval_s=0.01, timeout_s=0.3).start()
    hung = DeviceWatch(gpu1, interval_s=0.01, timeout_s=0.3)
    try:
        wait_for(lambda: watch.latest().get("utilization") == 0.1, 5, what="a first sample")
        assert watch.problem() is None
        (tmp_path / "lost-0").touch()
        assert "is lost" in wait_for(watch.problem, 5, what="the lost GPU to be noticed")
        (tmp_path / "hang-1").touch()
        hung.start()
        assert "stopped answering" in wait_for(hung.problem, 5, what="the hang to be noticed")
    finally:
        (tmp_path / "hang-1").unlink(missing_ok=True)
        watch.stop()
        hung.stop()


def test_each_sample_reads_the_card_once(fake_nvml: ModuleType) -> None:
    """One NVML utilization read per sample (scripts/telemetry_cost.py measures the cost)."""
    gpu = discover()[0]
    for _ in range(20):
        telemetry(gpu)
    assert fake_nvml.calls["nvmlDeviceGetUtilizationRates"] == 20


def test_pin_uses_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "environ", dict(os.environ))
    pin(Device("gpu", 1, "GPU-1234", "x"))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-1234"
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    pin(CPU)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def _json(device: Device) -> dict[str, Any]:
    return device.to_json({"utilization": 0.5, "memory_used_bytes": 1, "power_w": 70.5})


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
        "temperature_c": None,
        "power_w": 70.5,
        "cpus": None,  # a GPU's
    }


def test_a_cpu_device_reports_the_cpus_its_worker_may_run_on() -> None:
    body = CPU.to_json()
    assert body["kind"] == "cpu" and body["index"] is None
    assert cpu_set(body["cpus"]) == os.sched_getaffinity(0)


class _Watch:
    def __init__(self, sample: dict[str, Any]) -> None:
        self.sample = sample

    def latest(self) -> dict[str, Any]:
        return self.sample


def test_free_memory_counts_a_reservation_made_after_the_sample_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PyTorch reserved 6 GiB after the last NVML sample (free in it, cached now): a
    task can have the card's free memory at the sample, not that plus the cache."""
    gib = 1024**3
    card = Device("gpu", 0, "GPU-x", "Fake", memory_total_bytes=80 * gib)
    sample = {"memory_used_bytes": 10 * gib, "memory_total_bytes": 80 * gib}
    watch = _Watch({**sample, "torch_reserved_bytes": 2 * gib})  # reserved 2 GiB then
    budget = GpuBudget(card, watch)  # type: ignore[arg-type]
    stats = {"reserved_bytes.all.current": 8 * gib, "allocated_bytes.all.current": 2 * gib}
    cuda = SimpleNamespace(is_initialized=lambda: True, memory_stats=lambda: stats)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    # 70 free at the sample, +6 cached, -6 reserved since: 70 (not 76).
    assert budget.available_mb() == 70 * 1024
    watch.sample["torch_reserved_bytes"] = 8 * gib  # a sample taken after it: all 76
    assert budget.available_mb() == 76 * 1024
