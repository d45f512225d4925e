"""Which task errors are fatal to a CUDA context, which are an out-of-memory, and
which are ordinary: recognised by class name, module and message (the worker never
imports torch). The classes below are shaped like torch's, cupy's and pynvml's."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from worker.gpu.health import classify, describe, free_cached_memory
from worker.registry import TaskFailure


def _cls(module: str, name: str, base: type[Exception] = RuntimeError) -> type[Exception]:
    return type(name, (base,), {"__module__": module})


AcceleratorError = _cls("torch", "AcceleratorError")
TorchOOM = _cls("torch", "OutOfMemoryError")
OldTorchOOM = _cls("torch.cuda", "OutOfMemoryError")
CudaError = _cls("torch.cuda", "CudaError")
CupyRuntimeError = _cls("cupy_backends.cuda.api.runtime", "CUDARuntimeError")
CupyOOM = _cls("cupy.cuda.memory", "OutOfMemoryError", MemoryError)
NvmlLost = _cls("pynvml", "NVMLError_GpuIsLost", Exception)

ILLEGAL = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing "
    "CUDA_LAUNCH_BLOCKING=1"
)


@pytest.mark.parametrize(
    "exc",
    [
        AcceleratorError(ILLEGAL),
        RuntimeError(ILLEGAL),  # older torch raises a plain RuntimeError
        RuntimeError("CUDA error: unspecified launch failure"),
        RuntimeError("CUDA error: device-side assert triggered"),
        RuntimeError("CUDA error: misaligned address"),
        RuntimeError("CUDA error: uncorrectable ECC error encountered"),
        CudaError("CUDA error: an illegal instruction was encountered"),
        CupyRuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered"),
        RuntimeError("CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure"),
        NvmlLost("GPU is lost"),
        RuntimeError("CUDA error: unknown error"),
    ],
    ids=lambda e: f"{type(e).__name__}:{str(e)[:30]}",
)
def test_fatal(exc: Exception) -> None:
    assert classify(exc) == "fatal"


@pytest.mark.parametrize(
    "exc",
    [
        TorchOOM(
            "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity "
            "of 79.19 GiB of which 1.2 GiB is free."
        ),
        OldTorchOOM("CUDA out of memory. Tried to allocate 2.00 MiB"),
        RuntimeError("CUDA error: out of memory"),
        CupyOOM("Out of memory allocating 1,073,741,824 bytes (allocated so far: 0 bytes)."),
    ],
    ids=lambda e: type(e).__module__,
)
def test_out_of_memory(exc: Exception) -> None:
    assert classify(exc) == "oom"


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("boom"),
        ValueError("misaligned address in my own parser"),  # no CUDA about it
        MemoryError("host RAM"),  # not the GPU's memory
        AcceleratorError("CUDA error: invalid argument"),  # not sticky: a task bug
        KeyError("illegal memory access"),
    ],
    ids=repr,
)
def test_ordinary(exc: Exception) -> None:
    assert classify(exc) is None


def test_wrapped_errors_are_found_in_the_cause_chain() -> None:
    try:
        try:
            raise AcceleratorError(ILLEGAL)
        except RuntimeError as inner:
            raise TaskFailure("model_failed", "the model failed") from inner
    except TaskFailure as outer:
        assert classify(outer) == "fatal"
        assert (
            describe(outer)
            == "AcceleratorError: CUDA error: an illegal memory access was encountered"
        )


def test_free_cached_memory_only_touches_imported_libraries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    free_cached_memory()  # nothing imported: nothing to do, nothing imported
    assert "torch" not in sys.modules

    calls: list[str] = []
    torch: Any = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(empty_cache=lambda: calls.append("empty_cache"))
    monkeypatch.setitem(sys.modules, "torch", torch)
    free_cached_memory()
    assert calls == ["empty_cache"]

    def broken() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    torch.cuda = types.SimpleNamespace(empty_cache=broken)
    free_cached_memory()  # logged, not raised
