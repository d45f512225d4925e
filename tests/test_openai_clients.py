"""Real clients at the sizes real clients send: the official ``openai`` SDK with 2,048
inputs in one call (float and base64) and ``langchain-openai``'s ``OpenAIEmbeddings``
indexing thousands of chunks, against the default class limits, a real API and a real
worker running the real model on the CPU."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import openai
import pytest
import redis
from conftest import WorkerFactory, make_settings
from langchain_openai import OpenAIEmbeddings
from support.models import EMBED_TASKS, MODEL, requires_models, wait_model_loaded

from testkit import ApiServer

pytestmark = requires_models

WORDS = [
    "queue",
    "worker",
    "model",
    "batch",
    "vector",
    "search",
    "index",
    "query",
    "document",
    "memory",
    "cache",
]


def _texts(n: int) -> list[str]:
    """``n`` short, mostly distinct texts (a RAG indexer's chunks), deterministic."""
    return [" ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 2 + i % 7)) for i in range(n)]


@pytest.fixture
def api(redis_url: str, known_embed: None, api_factory: Callable[..., ApiServer]) -> ApiServer:
    # The default config (classes and limits as shipped): no tenants, no overrides.
    return api_factory(make_settings(redis_url))


@pytest.fixture
def served(api: ApiServer, r: redis.Redis, start_worker: WorkerFactory) -> ApiServer:
    wait_model_loaded(r, start_worker("embedder", wait=False, extra=EMBED_TASKS))
    return api


@pytest.fixture
def sdk(served: ApiServer) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=300)
    yield client
    client.close()


def test_the_sdk_embeds_2048_inputs_in_one_call_float_and_base64(
    sdk: openai.OpenAI, r: redis.Redis
) -> None:
    texts = _texts(2048)
    floats = sdk.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(2048))
    # The 2,048 inputs travelled as 32 chunks of 64: no record per input.
    assert len(list(r.scan_iter("rq:job:*"))) == 32
    packed = sdk.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64
    assert len(packed.data) == 2048 and packed.usage.prompt_tokens == floats.usage.prompt_tokens
    for a, b in zip(floats.data, packed.data, strict=True):
        assert len(a.embedding) == 384
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding, strict=True)) < 1e-6
    norms = [math.sqrt(math.fsum(x * x for x in d.embedding)) for d in floats.data]
    assert all(math.isclose(n, 1.0, abs_tol=1e-4) for n in norms)
    same = [i for i, t in enumerate(texts) if t == texts[0]]
    assert len(same) > 1 and all(floats.data[i].embedding == floats.data[0].embedding for i in same)
    assert floats.data[0].embedding != floats.data[1].embedding


def test_langchain_indexes_thousands_of_chunks(served: ApiServer) -> None:
    embeddings = OpenAIEmbeddings(
        model=MODEL,
        base_url=f"{served.url}/v1",
        api_key="none",  # type: ignore[arg-type]
        check_embedding_ctx_length=False,  # its tiktoken path would download at run time
        max_retries=0,
    )
    texts = _texts(2500)  # 3 calls of its default chunk_size, 1,000
    vectors = embeddings.embed_documents(texts)
    assert len(vectors) == 2500 and {len(v) for v in vectors} == {384}
    query = embeddings.embed_query(texts[7])
    assert max(abs(x - y) for x, y in zip(query, vectors[7], strict=True)) < 1e-5


def test_bad_inputs_are_openai_400s(sdk: openai.OpenAI, r: redis.Redis) -> None:
    cases = [
        ({"input": _texts(2049)}, "2049 items"),
        ({"input": ["fine", ""]}, "input[1]"),
        ({"input": ["fine"], "dimensions": 128}, "dimensions"),
    ]
    for kwargs, words in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.embeddings.create(model=MODEL, **kwargs)  # type: ignore[arg-type]
        assert raised.value.status_code == 400 and words in raised.value.message
        body = raised.value.body
        assert isinstance(body, dict) and body["type"] == "invalid_request_error"
