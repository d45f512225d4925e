"""Backend workers in front of a real llama.cpp server (llama-cpp-python's), driven by
the official `openai` SDK through gpulane's API: chat and text completions, streamed
and whole, routing by model, failover when a server dies, a client that leaves,
unequal speeds, token budgets and metrics.

The model is a tiny Llama with random weights the tests write (testkit.llama): its
text is noise; serving, streaming, usage and failures are the server's own."""

from __future__ import annotations

import concurrent.futures as cf
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from conftest import FAST, make_settings, submit, wait_status
from support.observe import dashboard
from support.up import Up, up_env

from dispatcher.contract import keys
from dispatcher.contract.generation import type_of_model
from dispatcher.contract.settings import Settings, TenantConfig
from testkit import ApiServer, WorkerProcess, wait_for, worker_env
from testkit.llama import INFINITY_MODEL, MODEL_ID, InfinityServer, LlamaServer, write_tiny_gguf

MESSAGES = [{"role": "user", "content": "Say something."}]
# Random weights may end a generation at its first token; never </s> (id 2) makes the
# token counts each test asks for exact.
NO_EOS = {"2": -100}
BACKEND_TYPE = type_of_model(MODEL_ID)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    return {
        "fast": write_tiny_gguf(folder / "fast.gguf"),
        # ~40 times slower per token on these cores: a backend of another speed, and a
        # generation long enough to leave in the middle of.
        "slow": write_tiny_gguf(folder / "slow.gguf", seed=1, n_embd=384, n_layer=6, n_ff=1536),
    }


@pytest.fixture
def llama(models: dict[str, Path], tmp_path: Path) -> Iterator[Callable[..., LlamaServer]]:
    servers: list[LlamaServer] = []

    def start(kind: str = "fast", port: int | None = None, n_ctx: int = 512) -> LlamaServer:
        server = LlamaServer(models[kind], tmp_path / f"llama-{len(servers)}.log", port, n_ctx)
        servers.append(server.start())
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def backend_worker(redis_url: str) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []
    client = redis.Redis.from_url(redis_url)

    def start(url: str, name: str, *args: str, wait: bool = True, **settings: Any) -> WorkerProcess:
        env = worker_env(redis_url, **{**FAST, **settings})
        proc = WorkerProcess(name, env, ["--backend", url, *args])
        started.append(proc)
        if wait:
            wait_for(
                lambda: client.hget(keys.worker(name), "state") == b"idle" or not proc.alive(),
                30,
                what=f"backend worker {name} to serve",
            )
            assert proc.alive(), proc.output()
        return proc

    yield start
    for proc in started:
        proc.kill()
    client.close()


def sdk(api: ApiServer, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_chat_and_completions_through_the_sdk(
    llama: Callable[..., LlamaServer],
    backend_worker: Callable[..., WorkerProcess],
    api: ApiServer,
) -> None:
    server = llama()
    backend_worker(server.url, "b-sdk")
    client = sdk(api)
    assert MODEL_ID in [m.id for m in client.models.list().data]

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=MESSAGES, logit_bias=NO_EOS, max_tokens=6
    )
    whole = raw.parse()
    assert whole.object == "chat.completion"
    assert isinstance(whole.choices[0].message.content, str)
    assert whole.usage is not None and whole.usage.completion_tokens >= 1
    # The server's answer, relayed as it is: the task's result is the same JSON.
    record = httpx.get(f"{api.url}/tasks/{raw.headers['gpulane-task-id']}").json()
    assert record["result"] == whole.model_dump(exclude_unset=True)
    direct = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 6, "logit_bias": NO_EOS},
    ).json()
    assert whole.usage.prompt_tokens == direct["usage"]["prompt_tokens"]

    chunks = list(
        client.chat.completions.create(
            model=MODEL_ID,
            messages=MESSAGES,
            logit_bias=NO_EOS,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert text, chunks
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    # The server streams no usage: the worker counted one token a chunk.
    tokens = sum(1 for c in chunks if c.choices and c.choices[0].delta.content is not None)
    assert chunks[-1].usage.completion_tokens == tokens >= 1
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)

    no_usage = list(
        client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, logit_bias=NO_EOS, max_tokens=3, stream=True
        )
    )
    assert all(c.usage is None for c in no_usage)

    text_completion = client.completions.create(
        model=MODEL_ID, prompt="Once", logit_bias=NO_EOS, max_tokens=4
    )
    assert text_completion.object == "text_completion" and text_completion.usage is not None
    streamed = list(
        client.completions.create(
            model=MODEL_ID, prompt="Once", logit_bias=NO_EOS, max_tokens=4, stream=True
        )
    )
    assert any(c.choices and c.choices[0].text for c in streamed)


def test_bad_requests_in_openais_shape(
    llama: Callable[..., LlamaServer],
    backend_worker: Callable[..., WorkerProcess],
    api: ApiServer,
) -> None:
    backend_worker(llama().url, "b-bad")
    client = sdk(api)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as no_messages:
        client.chat.completions.create(model=MODEL_ID, messages=[])
    assert "messages" in str(no_messages.value)
    # Past the server's context (512 tokens): the server's own 400, relayed.
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": "word " * 3000}],
            logit_bias=NO_EOS,
            max_tokens=4,
        )
    assert "context" in str(too_long.value)
    # Streamed, this server answers 200 and closes the stream without a chunk or its
    # [DONE]: an error before the stream starts (502, the server's failure), never an
    # empty answer passed off as whole.
    with pytest.raises(openai.APIStatusError) as broken:
        client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": "word " * 3000}],
            logit_bias=NO_EOS,
            max_tokens=4,
            stream=True,
        )
    assert broken.value.status_code == 502 and "[DONE]" in str(broken.value)
    raw = httpx.post(api.url + "/v1/chat/completions", content=b"{not json")
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"


def test_in_process_and_backend_workers_share_a_class(
    known_types: None,
    llama: Callable[..., LlamaServer],
    backend_worker: Callable[..., WorkerProcess],
    start_worker: Callable[..., WorkerProcess],
    http: httpx.Client,
    api: ApiServer,
) -> None:
    """Routed by type: the in-process worker never takes a generation, the backend
    worker never takes an in-process task, and both are served."""
    backend_worker(llama().url, "b-mixed")
    start_worker("w-mixed")
    echoes = [submit(http, "echo", {"x": i}, cls="interactive")["id"] for i in range(10)]
    client = sdk(api)
    for _ in range(5):
        client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, logit_bias=NO_EOS, max_tokens=2
        )
    for task_id in echoes:
        record = wait_status(http, task_id, {"succeeded", "failed"})
        assert record["status"] == "succeeded" and record["worker"] == "w-mixed", record
    generated = http.post(
        "/tasks",
        json={
            "type": BACKEND_TYPE,
            "class": "batch",
            "args": {
                "kind": "chat",
                "body": {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 2},
            },
        },
    )
    assert generated.status_code == 202, generated.text
    record = wait_status(http, generated.json()["id"], {"succeeded", "failed"})
    assert record["status"] == "succeeded" and record["worker"] == "b-mixed", record
    assert record["result"]["object"] == "chat.completion"
    # Neither an echo nor a whole generation has a stream to read.
    for task_id in (echoes[0], generated.json()["id"]):
        answer = http.get(f"/tasks/{task_id}/stream")
        assert answer.status_code == 409 and answer.json()["error"]["code"] == "not_a_stream"
    assert http.get("/tasks/no-such-task/stream").status_code == 404


def test_a_stream_is_read_from_another_api_process(
    llama: Callable[..., LlamaServer],
    backend_worker: Callable[..., WorkerProcess],
    settings: Settings,
    api_factory: Callable[[Settings], ApiServer],
) -> None:
    backend_worker(llama().url, "b-replica")
    one, other = api_factory(settings), api_factory(settings)
    body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 5, "logit_bias": NO_EOS}
    accepted = httpx.post(
        one.url + "/tasks",
        json={"type": BACKEND_TYPE, "args": {"kind": "chat", "body": body, "stream": True}},
    )
    assert accepted.status_code == 202, accepted.text
    task_id = accepted.json()["id"]
    with httpx.stream("GET", f"{other.url}/tasks/{task_id}/stream", timeout=30) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"usage"' in events[-2]  # the usage chunk comes with a task's stream
    assert sum('"content"' in e for e in events) == 5


def test_a_client_that_leaves_cancels_the_generation(
    llama: Callable[..., LlamaServer],
    backend_worker: Callable[..., WorkerProcess],
    api: ApiServer,
    r: redis.Redis,
) -> None:
    server = llama("slow", n_ctx=2048)
    backend_worker(server.url, "b-leave")
    body = {
        "model": MODEL_ID,
        "messages": MESSAGES,
        "max_tokens": 1800,
        "logit_bias": NO_EOS,  # it runs its 1,800 tokens unless stopped
        "stream": True,
    }
    with httpx.stream("POST", api.url + "/v1/chat/completions", json=body, timeout=30) as stream:
        task_id = stream.headers["gpulane-task-id"]
        lines = stream.iter_lines()
        seen = [next(lines) for _ in range(5)]  # tokens are flowing
        assert all(line.startswith("data: ") or line == "" for line in seen)
    # Gone after five tokens of 1,800: the task is canceled and the worker's slot
    # freed long before the server could have finished.
    wait_for(lambda: r.hget(keys.job(task_id), "status") == b"canceled", 15, what="the cancel")
    wait_for(
        lambda: b'"busy": 0' in (r.hget(keys.worker("b-leave"), "backend") or b""),
        15,
        what="the slot back",
    )
    stream_len = r.xlen(keys.stream(task_id))
    assert stream_len < 1800, stream_len


def test_a_killed_server_fails_over_and_comes_back(
    llama: Callable[..., LlamaServer],
    backend_worker: Callable[..., WorkerProcess],
    api: ApiServer,
    r: redis.Redis,
) -> None:
    """Two servers under load; one is SIGKILLed. Whole requests all succeed (those it
    held run again on the other); streams end, with [DONE] or an explicit error event,
    never hanging. Its worker stops claiming and resumes when the server is back."""
    doomed, spare = llama("slow", n_ctx=2048), llama("slow", n_ctx=2048)
    backend_worker(doomed.url, "b-doomed", "--slots", "2")
    backend_worker(spare.url, "b-spare", "--slots", "2")
    client = sdk(api)

    def whole(_: int) -> str:
        answer = client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, logit_bias=NO_EOS, max_tokens=60
        )
        return answer.choices[0].finish_reason or ""

    def streamed(_: int) -> str:
        try:
            for _chunk in client.chat.completions.create(
                model=MODEL_ID, messages=MESSAGES, logit_bias=NO_EOS, max_tokens=60, stream=True
            ):
                pass
        except openai.APIError as exc:  # the error event of a stream its server lost
            return f"error: {exc}"
        return "done"

    with cf.ThreadPoolExecutor(16) as pool:
        wholes = [pool.submit(whole, i) for i in range(12)]
        streams = [pool.submit(streamed, i) for i in range(4)]
        wait_for(
            lambda: r.llen(keys.inflight("b-doomed", "interactive")) > 0, 30, what="work on doomed"
        )
        doomed.kill()
        finished = [f.result(timeout=120) for f in wholes]
        ended = [f.result(timeout=120) for f in streams]
    assert len(finished) == 12 and set(finished) <= {"length", "stop"}, finished
    assert all(e == "done" or e.startswith("error: ") for e in ended), ended
    wait_for(
        lambda: r.hget(keys.worker("b-doomed"), "state") == b"backend_down", 15, what="backend_down"
    )
    assert client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, logit_bias=NO_EOS, max_tokens=2
    )
    llama("slow", port=doomed.port, n_ctx=2048)  # the same server, back
    # Idle again with every slot free (a run stopped while it reported its outcome once
    # kept its slot, and the worker busy, for good).
    wait_for(
        lambda: (
            r.hget(keys.worker("b-doomed"), "state") == b"idle"
            and b'"busy": 0' in (r.hget(keys.worker("b-doomed"), "backend") or b"")
        ),
        15,
        what="claiming again",
    )


def test_the_faster_backend_serves_more(
    llama: Callable[..., LlamaServer],
    backend_worker: Callable[..., WorkerProcess],
    api: ApiServer,
    r: redis.Redis,
) -> None:
    backend_worker(llama("fast").url, "b-fast", "--slots", "1")
    backend_worker(llama("slow", n_ctx=2048).url, "b-slow", "--slots", "1")
    client = sdk(api)

    def ask(_: int) -> str:
        answer = client.chat.completions.with_raw_response.create(
            model=MODEL_ID, messages=MESSAGES, logit_bias=NO_EOS, max_tokens=100
        )
        task_id = answer.headers["gpulane-task-id"]
        return (r.hget(keys.job(task_id), "worker_name") or b"").decode()

    with cf.ThreadPoolExecutor(8) as pool:
        served = list(pool.map(ask, range(24)))
    assert served.count("b-fast") > 2 * served.count("b-slow"), served


def test_tpm_budget_charges_and_settles(
    llama: Callable[..., LlamaServer],
    backend_worker: Callable[..., WorkerProcess],
    redis_url: str,
    api_factory: Callable[[Settings], ApiServer],
    r: redis.Redis,
) -> None:
    import hashlib

    key = "tpm-key"
    tenant = TenantConfig(
        name="budgeted", key_sha256=hashlib.sha256(key.encode()).hexdigest(), tpm=400
    )
    api = api_factory(make_settings(redis_url, tenants=[tenant]))
    backend_worker(llama().url, "b-tpm")
    client = sdk(api, key)
    first = client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, logit_bias=NO_EOS, max_tokens=300
    )
    assert first.usage is not None
    used = first.usage.total_tokens
    # Charged 300 + the prompt's estimate, then settled to what it used.
    wait_for(
        lambda: float(r.hget(keys.tpm("budgeted"), "tokens") or 0) >= 400 - used - 1,
        10,
        what="the charge settled",
    )
    with pytest.raises(openai.RateLimitError) as over:
        client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, logit_bias=NO_EOS, max_tokens=400 - used + 50
        )
    assert int(over.value.response.headers["retry-after"]) >= 1


def test_tokens_and_backend_in_metrics_stats_and_workers(
    llama: Callable[..., LlamaServer],
    backend_worker: Callable[..., WorkerProcess],
    api: ApiServer,
) -> None:
    server = llama()
    backend_worker(server.url, "b-metrics", "--slots", "3")
    client = sdk(api)
    for _ in range(3):
        for _chunk in client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, logit_bias=NO_EOS, max_tokens=5, stream=True
        ):
            pass

    def metrics() -> str | None:
        text = httpx.get(api.url + "/metrics").text
        wanted = 'gpulane_tokens_total{kind="completion",model="tiny-llama",tenant="default"} 15.0'
        return text if wanted in text else None

    text = wait_for(metrics, 15, what="the tokens in /metrics")
    assert f'gpulane_time_to_first_token_seconds_count{{backend="{server.url}"}} 3.0' in text
    stats: dict[str, Any] = httpx.get(api.url + "/stats").json()
    assert stats["tokens"]["default"]["tiny-llama"]["completion"] == 15
    worker = next(
        w for w in httpx.get(api.url + "/workers").json()["workers"] if w["name"] == "b-metrics"
    )
    assert worker["backend"]["slots"] == 3 and worker["backend"]["url"] == server.url
    assert worker["task_types"] == [BACKEND_TYPE]
    # The dashboard: the tokens per tenant and model, the worker's server and slots.
    with dashboard(api.url) as page:
        page.wait_for_selector("#tokens-panel:not([hidden])", timeout=15_000)
        tokens = page.inner_text("#token-rows")
        assert "tiny-llama" in tokens and "15" in tokens, tokens
        page.wait_for_function(
            "document.querySelector('#worker-rows').innerText.includes('slots')", timeout=15_000
        )
        row = page.inner_text("#worker-rows")
        assert f"backend · {server.url}" in row and "0 / 3 slots" in row, row


def test_embeddings_served_by_infinity(
    tmp_path: Path,
    backend_worker: Callable[..., WorkerProcess],
    api: ApiServer,
    r: redis.Redis,
) -> None:
    """/v1/embeddings by an embedding server behind a backend worker: the same vectors
    as the server gives directly; the task's record, the relayed answer, is let go
    ``openai_result_ttl_s`` after it (as the chunks of a model's own are)."""
    server = InfinityServer(tmp_path / "infinity.log").start()
    try:
        backend_worker(server.url, "b-infinity")
        texts = ["a GPU job dispatcher", "least-busy by construction"]
        raw = sdk(api).embeddings.with_raw_response.create(
            model=INFINITY_MODEL, input=texts, encoding_format="float"
        )
        answer = raw.parse()
        record = keys.job(raw.headers["gpulane-task-id"])
        ttl = Settings.model_fields["openai_result_ttl_s"].default  # the fixture's
        wait_for(lambda: 0 < r.ttl(record) <= ttl, 10, "the record let go")
        direct = httpx.post(
            server.url + "/v1/embeddings", json={"model": INFINITY_MODEL, "input": texts}
        ).json()
        assert [d.index for d in answer.data] == [0, 1]
        assert len(answer.data[0].embedding) == 384
        for got, want in zip(answer.data, direct["data"], strict=True):
            assert got.embedding == pytest.approx(want["embedding"], abs=1e-6)
        assert answer.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
    finally:
        server.stop()


def test_a_stopped_worker_ends_its_streams_explicitly(
    llama: Callable[..., LlamaServer],
    backend_worker: Callable[..., WorkerProcess],
    api: ApiServer,
    r: redis.Redis,
) -> None:
    """SIGTERM: no more claims; a stream still running past the grace period ends with
    an error event (the client is told, never left hanging) and the worker exits 0."""
    worker = backend_worker(llama("slow", n_ctx=2048).url, "b-stop", shutdown_grace_s=0.5)
    stream = sdk(api).chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=1800, logit_bias=NO_EOS, stream=True
    )
    chunks = iter(stream)
    next(chunks)  # streaming
    worker.process.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError, match="worker stopped"):
        for _chunk in chunks:
            pass
    assert worker.process.wait(15) == 0
    task_id = stream.response.headers["gpulane-task-id"]
    assert r.hget(keys.job(task_id), "status") == b"failed"


def test_max_tokens_past_a_known_context_is_refused_before_queueing(
    r: redis.Redis, api: ApiServer
) -> None:
    """A server that states its context (vLLM's max_model_len, llama.cpp's /props) has it
    in the catalog; a max_tokens past it is a 400 at once, nothing queued."""
    import json

    from dispatcher.contract.generation import catalog_entry

    r.hset(keys.CATALOG, type_of_model("ctx-model"), json.dumps(catalog_entry("ctx-model", 128)))
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(api).chat.completions.create(model="ctx-model", messages=MESSAGES, max_tokens=500)
    assert refused.value.param == "max_tokens" and "128" in str(refused.value)
    assert r.llen(keys.queue("interactive")) == 0


def test_up_starts_a_backend_worker_per_url(
    llama: Callable[..., LlamaServer], tmp_path: Path
) -> None:
    server = llama()
    up = Up(up_env(tmp_path), "--workers", "1", "--backend", server.url)
    try:
        url = up.url()
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)

        def listed() -> bool:
            return MODEL_ID in [m.id for m in client.models.list().data]

        wait_for(listed, 30, what="the server's model in /v1/models")
        answer = client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, logit_bias=NO_EOS, max_tokens=3
        )
        assert answer.usage is not None and answer.usage.completion_tokens >= 1
        workers = httpx.get(url + "/workers").json()["workers"]
        backends = [w["backend"]["url"] for w in workers if w["backend"]]
        assert backends == [server.url] and len(workers) == 2, workers
    finally:
        assert up.stop() == 0, up.output()
