"""What one heartbeat's device sample costs, and whether sampling slows the task loop.

    .venv/bin/python scripts/telemetry_cost.py            # the fake pynvml, 4 cards
    .venv/bin/python scripts/telemetry_cost.py --real     # this host's NVML (a GPU host)

Prints the cost of ``worker.gpu.devices.telemetry`` per sample, the cost of each NVML call
it makes, and the time a CPU-bound loop (standing in for a task) takes with and
without a :class:`worker.gpu.sampler.DeviceWatch` sampling beside it (at 100 Hz, a hundred
times the default heartbeat rate, so any slowdown would show).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _per_call_us(fn: Callable[[], Any], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def _busy_loop(n: int = 3_000_000) -> float:
    start = time.perf_counter()
    total = 0
    for i in range(n):
        total += i * i
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="use this host's NVML")
    parser.add_argument("-n", type=int, default=5000, help="samples to time")
    ns = parser.parse_args()
    if not ns.real:
        sys.path.insert(0, str(REPO / "tests" / "support" / "fake_nvml"))
        os.environ.setdefault("GPULANE_FAKE_NVML", "4")
    sys.path.insert(0, str(REPO))

    import pynvml

    from worker.gpu.devices import discover, telemetry
    from worker.gpu.sampler import DeviceWatch

    found = discover()
    if not found:
        print("no GPU found through NVML; nothing to measure")
        return 1
    gpu = found[0]
    print(f"pynvml: {pynvml.__file__}\ndevice: {gpu.label} {gpu.name} {gpu.uuid}")
    telemetry(gpu)  # the handle is cached from here on, as in a worker
    per_sample = _per_call_us(lambda: telemetry(gpu), ns.n)
    print(f"telemetry(): {per_sample:.1f} us per sample ({ns.n} samples)")

    handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
    calls: dict[str, Callable[[], Any]] = {
        "nvmlDeviceGetUtilizationRates": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle),
        "nvmlDeviceGetMemoryInfo": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle),
        "nvmlDeviceGetTemperature": lambda: pynvml.nvmlDeviceGetTemperature(
            handle, pynvml.NVML_TEMPERATURE_GPU
        ),
        "nvmlDeviceGetPowerUsage": lambda: pynvml.nvmlDeviceGetPowerUsage(handle),
    }
    for name, call in calls.items():
        try:
            print(f"  {name}: {_per_call_us(call, min(ns.n, 1000)):.1f} us per call")
        except pynvml.NVMLError as exc:
            print(f"  {name}: not supported here ({exc})")

    # Alternate the two conditions so that drift on a shared machine hits both alike.
    alone, beside = [], []
    for _ in range(7):
        alone.append(_busy_loop())
        watch = DeviceWatch(gpu, interval_s=0.01, timeout_s=10).start()
        beside.append(_busy_loop())
        watch.stop()
    baseline, sampled = statistics.median(alone), statistics.median(beside)
    print(
        f"task loop stand-in: {baseline * 1000:.1f} ms alone, {sampled * 1000:.1f} ms with "
        f"sampling at 100 Hz ({(sampled / baseline - 1) * 100:+.1f}%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
