"""What a refused submit answers: the 429 or 503, its message, ``Retry-After`` and the
backpressure headers, for every route that submits (``POST /tasks``, the OpenAI
routes)."""

from __future__ import annotations

from typing import Any

from dispatcher.api.errors import ApiError
from dispatcher.api.pool import ClassState
from dispatcher.api.store import Submission, SubmitResult

__all__ = ["REFUSED", "backpressure", "over_limit", "refusal"]

# The verdicts of submit.lua that refusal() answers (429 or 503).
REFUSED = frozenset({"queue_full", "no_workers", "over_quota", "device_quota"})


def backpressure(depth: int, est: float | None, pressure: str) -> dict[str, str]:
    return {
        "Gpulane-Queue-Depth": str(depth),
        "Gpulane-Estimated-Wait": f"{est:.1f}" if est is not None else "-1",
        "Gpulane-Pressure": pressure,
    }


def over_limit(message: str, retry_s: int) -> ApiError:
    """429 for a tenant over one of its limits (quota, tpm, device time): retry then."""
    return ApiError(
        429, "rate_limited", message, headers={"Retry-After": str(retry_s)}, retry_after_s=retry_s
    )


def refusal(result: SubmitResult, state: ClassState, sub: Submission) -> ApiError:
    """The 429/503 for a submit admission refused (POST /tasks and /v1/embeddings),
    worded here; the verdict, the limit and Retry-After are submit.lua's."""
    retry = result.retry_after_s or 1
    if result.verdict == "device_quota":
        return over_limit(
            f"Tenant {sub.tenant!r} used its {sub.device_quota_s:g} device-seconds of the "
            f"last hour (device_seconds_per_hour); retry in {retry} s.",
            retry,
        )
    if result.verdict == "over_quota":
        return over_limit(
            f"Tenant {sub.tenant!r} has {sub.max_in_flight} tasks queued or running, its "
            f"max_in_flight; retry in {retry} s.",
            retry,
        )
    headers = {
        **backpressure(result.depth, result.estimated_wait_s, result.pressure),
        "Retry-After": str(retry),
    }
    extra: dict[str, Any] = {}
    if result.verdict == "no_workers" and state.workers > 0:
        largest = state.largest_mb
        message = (
            f"No live worker of class {state.name!r} has a GPU that could hold the "
            f"{sub.gpu_memory_mb} MB this task needs (the largest offers {largest} MB); "
            "retry when a bigger card serves the class."
        )
        extra = {"gpu_memory_mb": sub.gpu_memory_mb, "largest_gpu_memory_mb": largest}
    elif result.verdict == "no_workers":
        message = f"No live worker serves class {state.name!r}; retry later."
    elif result.limit == "bytes":
        message = (
            f"Class {state.name!r} is full: its unfinished tasks hold max_queued_bytes "
            f"({state.config.max_queued_bytes} bytes of uploads); retry in {retry} s."
        )
    else:
        message = f"Class {state.name!r} is full ({result.depth} queued); retry in {retry} s."
    return ApiError(503, result.verdict, message, headers=headers, retry_after_s=retry, **extra)
