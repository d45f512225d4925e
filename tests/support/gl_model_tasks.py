"""A model task whose loader fails (``--tasks gl_model_tasks``): start-up with a
model that cannot load, without the real model's cost."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from worker import TaskContext, task


def load_broken(device: str) -> None:
    raise RuntimeError(f"no weights for {device}")


@task("test.model", model="test/broken", load=load_broken)
def broken(args: BaseModel, ctx: TaskContext) -> dict[str, Any]:
    """Never runs: its model does not load."""
    return {}
