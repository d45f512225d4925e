"""GPU-aware health: which task errors leave the device unusable, which are an
ordinary out-of-memory, and freeing cached memory after one.

The worker never imports torch, cupy or any CUDA library (task modules do, and only
after pinning), so errors are recognised by class name, module and message. A CUDA
error is "sticky" when it corrupts the process' CUDA context: every later CUDA call
in the process fails too, so the only cure is a new process. Those are fatal: the
task is handed back (as a lost attempt) and the worker exits to be restarted. An
out-of-memory error is not sticky: the task fails with ``gpu_out_of_memory``, the
caches are emptied, and the worker keeps serving.
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Iterator
from typing import Literal

__all__ = ["GpuErrorKind", "classify", "describe", "free_cached_memory"]

log = logging.getLogger("gpulane.worker")

GpuErrorKind = Literal["fatal", "oom"]

# Top-level packages whose exceptions come from a GPU stack.
_GPU_PACKAGES = frozenset(
    {"torch", "cupy", "cupy_backends", "pycuda", "cuda", "numba", "jax", "jaxlib", "triton"}
    | {"tensorflow", "pynvml", "nvidia", "tensorrt", "vllm", "xformers", "flash_attn"}
)

# Messages of the sticky CUDA errors, from cudaGetErrorString and the driver/runtime
# enum names (cupy and others print those), lower-cased.
_FATAL_PHRASES = (
    "illegal memory access",  # cudaErrorIllegalAddress
    "illegal_address",
    "illegaladdress",
    "unspecified launch failure",  # cudaErrorLaunchFailure
    "launch_failed",
    "launchfailure",
    "illegal instruction",  # cudaErrorIllegalInstruction
    "misaligned address",  # cudaErrorMisalignedAddress
    "hardware stack error",  # cudaErrorHardwareStackError
    "invalid program counter",  # cudaErrorInvalidPc
    "device-side assert",  # cudaErrorAssert: the context is unusable afterwards
    "launch timed out",  # cudaErrorLaunchTimeout (watchdog killed a kernel)
    "uncorrectable ecc",  # cudaErrorECCUncorrectable
    "ecc_uncorrectable",
    "uncorrectable nvlink",  # cudaErrorNvlinkUncorrectable
    "context is destroyed",
    "gpu is lost",  # NVML_ERROR_GPU_IS_LOST
    "fallen off the bus",  # Xid 79
    "gpu requires restart",  # NVML_ERROR_RESET_REQUIRED
    "device lost",
    "cuda error: unknown error",  # what CUDA reports after most Xid faults
)
_FATAL_CLASSES = frozenset({"NVMLError_GpuIsLost", "NVMLError_ResetRequired", "DeviceLost"})


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception and what caused it: a handler that wraps a CUDA error in its own
    exception (or a TaskFailure) still leaves the context broken."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 8:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _from_gpu_stack(exc: BaseException) -> bool:
    package = (type(exc).__module__ or "").split(".")[0]
    return package in _GPU_PACKAGES


def _kind(exc: BaseException) -> GpuErrorKind | None:
    name = type(exc).__name__
    if name in _FATAL_CLASSES:
        return "fatal"
    text = str(exc).lower()
    gpu = _from_gpu_stack(exc) or "cuda" in text or "nvml" in text
    if gpu and any(phrase in text for phrase in _FATAL_PHRASES):
        return "fatal"
    if name == "OutOfMemoryError" and _from_gpu_stack(exc):
        return "oom"  # torch.OutOfMemoryError, torch.cuda.OutOfMemoryError, cupy's
    if "cuda out of memory" in text or (gpu and "out of memory" in text):
        return "oom"  # "CUDA error: out of memory", jax/XLA RESOURCE_EXHAUSTED
    return None


def classify(exc: BaseException) -> GpuErrorKind | None:
    """``fatal``, ``oom`` or None (an ordinary task error), looking down the cause chain."""
    kinds = {_kind(e) for e in _chain(exc)}
    if "fatal" in kinds:
        return "fatal"
    return "oom" if "oom" in kinds else None


def describe(exc: BaseException) -> str:
    """The first line of the error that decided the classification, for records."""
    for e in _chain(exc):
        if _kind(e) is not None:
            exc = e
            break
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:500]


def free_cached_memory() -> None:
    """After an out-of-memory: drop what the failed task left and return the cached
    blocks to the driver, so the next task starts with the memory the card has. Only
    libraries the task code already imported are touched (never import one here)."""
    gc.collect()  # tensors held by the dead task's frames and cycles
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            torch.cuda.empty_cache()
        except Exception:  # a broken torch must not take the worker down
            log.warning("torch.cuda.empty_cache() failed", exc_info=True)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            cupy.get_default_memory_pool().free_all_blocks()
            cupy.get_default_pinned_memory_pool().free_all_blocks()
        except Exception:
            log.warning("cupy memory pool could not be freed", exc_info=True)
