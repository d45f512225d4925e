"""The worker record format: the states a worker publishes in its
``gpulane:worker:<name>`` hash (``worker.state`` writes them; the API's pool read
model, the exporter and ``gpulane status`` read them)."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["NOT_SERVING", "WORKER_STATES", "WorkerStatus"]

# What a worker publishes as its state (worker.state writes it, this module reads it).
WorkerStatus = Literal["starting", "waiting_for_gpu", "idle", "busy", "stopping", "unhealthy"]
WORKER_STATES: tuple[str, ...] = get_args(WorkerStatus)

# Live workers that take no task yet or any more: loading (registered before it has a
# device and its task modules), waiting for a free GPU, draining on its way out, or
# out of service after a GPU fault. Admission must not count them as capacity.
NOT_SERVING = frozenset({"starting", "waiting_for_gpu", "stopping", "unhealthy"})
