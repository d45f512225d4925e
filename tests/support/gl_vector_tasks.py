"""A user's own embedding type (``--tasks gl_vector_tasks``): named by a ``model``, so
``/v1/embeddings`` serves it, batched. It ignores ``ctx.encoding_format``: its vectors
are plain JSON numbers, read off the text, so a test knows each one."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from worker import Batch, TaskContext, task

MODEL = "test/plain-vectors"
NO_VECTOR = "give no vector"  # an input whose result holds no embedding
PAST_FLOAT32 = "give 1e39"  # an input whose vector holds a number float32 cannot hold


class TextArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str


def vector(text: str) -> list[float]:
    return [1e39 if text == PAST_FLOAT32 else float(len(text)), 0.0, 0.5]


@task("test.vectors", model=MODEL, batch=Batch(max_size=8, max_wait_ms=5))
def vectors(batch: list[TextArgs], ctxs: list[TaskContext]) -> list[dict[str, Any]]:
    """Three numbers per text: its length, 0, 0.5."""
    return [
        {"tokens": 1} if args.text == NO_VECTOR else {"embedding": vector(args.text), "tokens": 1}
        for args in batch
    ]
