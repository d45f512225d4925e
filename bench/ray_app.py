"""Ray Serve peer for the embedding benchmarks, run by the peers venv (never the
project's): ``.venv-peers/bin/python bench/ray_app.py --port P --model-dir DIR``.

One replica of a deployment over ``SentenceTransformer(DIR, device="cpu")`` behind a
FastAPI ingress: ``POST /v1/embeddings`` takes OpenAI's shape (``input``: a string or a
list of strings; ``model`` is accepted and ignored) and answers
``{"object": "list", "data": [{"object": "embedding", "embedding": [...], "index": i}],
"model": ..., "usage": ...}``. Every input goes through ``@serve.batch(max_batch_size=64,
batch_wait_timeout_s=0.005)`` on its own, so the replica batches across requests as
gpulane's worker does (64 at most, 5 ms wait).

Local Ray (no dashboard, no usage stats), temporary files under ``--temp-dir``; SIGTERM
or SIGINT shuts Serve and Ray down and exits. :func:`bench.peers.ray_serve` starts it in
a process group of its own and kills that group if anything outlives the shutdown.

Types: ray and sentence-transformers are not installed where mypy runs, so they are
imported as ``Any``. No ``from __future__ import annotations``: FastAPI must see the
``Request`` annotation as a class in the replica (a string there reads as a query
parameter).
"""

import argparse
import asyncio
import importlib
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MAX_BATCH = 64
BATCH_WAIT_S = 0.005
MAX_ONGOING = 1024  # requests a replica holds at once (Ray's default, 5, starves batching)

ray: Any = importlib.import_module("ray")
serve: Any = importlib.import_module("ray.serve")

app = FastAPI()


def batched(func: Callable[..., Any]) -> Any:
    """``@serve.batch(max_batch_size=64, batch_wait_timeout_s=0.005)``; callers pass
    one input and get its vector (Serve finds the method by its own name on ``self``)."""
    return serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=BATCH_WAIT_S)(func)


class Embedder:
    def __init__(self, model_dir: str, threads: int) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        # Ray caps a replica's OpenMP threads at its num_cpus; use the machine's cores,
        # as Infinity and the in-process limit do.
        torch.set_num_threads(threads)
        self.model = SentenceTransformer(model_dir, device="cpu", local_files_only=True)
        self.model.eval()

    @batched
    async def encode(self, texts: list[str]) -> list[list[float]]:
        """One batch of up to :data:`MAX_BATCH` inputs, gathered across requests."""
        vectors = self.model.encode(
            texts,
            batch_size=MAX_BATCH,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return [v.tolist() for v in vectors]

    @app.post("/embeddings")
    async def embeddings(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        inputs = body["input"]
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        vectors = await asyncio.gather(*(self.encode(t) for t in texts))
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)
            ],
            "model": body.get("model", MODEL_NAME),
            "usage": {"prompt_tokens": 0, "total_tokens": 0},
        }


def build(model_dir: str, threads: int) -> Any:
    """The Serve application: one replica of :class:`Embedder` behind its FastAPI app."""
    deployment = serve.deployment(
        num_replicas=1,
        max_ongoing_requests=MAX_ONGOING,
        ray_actor_options={"num_cpus": 1},
    )(serve.ingress(app)(Embedder))
    return deployment.bind(model_dir, threads)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--temp-dir", default=None)
    ns = parser.parse_args()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threads = os.cpu_count() or 1
    ray.init(
        num_cpus=threads,
        include_dashboard=False,
        _temp_dir=ns.temp_dir,
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": ns.port})
        serve.run(build(ns.model_dir, threads), route_prefix="/v1", blocking=False)
        print(f"ray_app: serving on http://127.0.0.1:{ns.port}/v1", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
