"""Scenario generate: gpulane in front of real llama.cpp servers (llama-cpp-python's, from
``.venv-llama``; ``scripts/llama-venv.sh``), side by side in one run with going straight
to the server and with LiteLLM's router (its proxy, ``scripts/litellm-venv.sh``;
skipped with a note when it is not installed).

- (a) overhead: sequential streamed chat completions on one fast server, straight and
  through gpulane (one API process, one backend worker, ``--slots 1``: the server runs
  one request at a time): time to first token p50/p99, streamed tokens/s per request.
- (b) two servers of unequal speed (one ~40x slower a token), 8 concurrent clients of
  whole completions: gpulane's pull (a backend worker each) against LiteLLM's
  ``simple-shuffle`` and ``least-busy``: p50/p99 latency and completion rate; then the
  same with the fast server SIGKILLed a third of the way in.

The model is testkit.llama's tiny random-weight Llama (its text is noise; the serving
is the server's own). Every request suppresses </s> so all generate their max_tokens.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import numpy as np

from bench.harness import Stack
from bench.report import Report, Table, axes, figure, grouped_bars, judged, latency_cdf, pct, save
from testkit import CLI, REPO, free_port, http_ok, wait_for
from testkit.llama import LLAMA_PYTHON, MODEL_ID, LlamaServer, write_tiny_gguf

LITELLM = REPO / ".venv-litellm" / "bin" / "litellm"
NO_EOS = {"2": -100}
KEY = "sk-gpulane-bench"  # LiteLLM's master key; gpulane (open) and the servers ignore it
HEADERS = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Say something."}]


@dataclass(frozen=True)
class Size:
    streams: int  # (a) sequential streams per system
    stream_tokens: int
    requests: int  # (b) whole completions per run
    tokens: int
    peers: bool = True  # smoke (in the test suite) proves gpulane's path alone


SIZES = {
    "smoke": Size(5, 16, 16, 8, peers=False),
    "quick": Size(60, 64, 160, 24),
    "full": Size(200, 128, 400, 32),
}


@contextmanager
def servers(folder: Path) -> Iterator[tuple[LlamaServer, LlamaServer]]:
    fast = write_tiny_gguf(folder / "fast.gguf")
    slow = write_tiny_gguf(folder / "slow.gguf", seed=1, n_embd=384, n_layer=6, n_ff=1536)
    started = [
        LlamaServer(fast, folder / "fast.log").start(),
        LlamaServer(slow, folder / "slow.log", n_ctx=2048).start(),
    ]
    try:
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop()


@contextmanager
def gpulane(*backends: str) -> Iterator[str]:
    """The API and one backend worker per server (``--slots 1``); yields the /v1 URL."""
    with Stack() as stack:
        _, url = stack.gpulane_api(["interactive", "batch"])
        for i, backend in enumerate(backends):
            argv = [*CLI, "worker", "--name", f"backend{i}", "--backend", backend, "--slots", "1"]
            stack.wait_idle(stack.spawn(f"backend{i}", argv, stack.env()), 60)
        yield f"{url}/v1"


@contextmanager
def litellm(strategy: str, *backends: str) -> Iterator[str]:
    """LiteLLM's proxy with its router over ``backends`` (one deployment each)."""
    folder = Path(tempfile.mkdtemp(prefix="litellm-"))
    deployments = "".join(
        f"  - model_name: {MODEL_ID}\n    litellm_params:\n      model: openai/{MODEL_ID}\n"
        f"      api_base: {b}/v1\n      api_key: none\n      rpm: 100000\n"
        for b in backends
    )
    config = folder / "config.yaml"
    config.write_text(
        f"model_list:\n{deployments}router_settings:\n  routing_strategy: {strategy}\n"
        "  num_retries: 2\n  allowed_fails: 1\n  cooldown_time: 5\n"
        "litellm_settings:\n  telemetry: false\n  drop_params: false\n"
    )
    port = free_port()
    env = {**os.environ, "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR"}
    env["LITELLM_MASTER_KEY"] = KEY
    with (folder / "log").open("wb") as log:
        argv = [str(LITELLM), "--config", str(config), "--port", str(port), "--host", "127.0.0.1"]
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    alive = f"http://127.0.0.1:{port}/health/liveliness"
    try:
        wait_for(lambda: proc.poll() is not None or http_ok(alive), 120, "LiteLLM")
        if proc.poll() is not None:
            raise RuntimeError((folder / "log").read_text()[-2000:])
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(folder, ignore_errors=True)


def _body(tokens: int) -> dict[str, object]:
    return {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": tokens, "logit_bias": NO_EOS}


async def _stream(client: httpx.AsyncClient, url: str, tokens: int) -> tuple[float, float]:
    """One streamed chat completion: (seconds to the first token, tokens/s after it)."""
    body = {**_body(tokens), "stream": True}
    start = time.perf_counter()
    first = last = 0.0
    n = 0
    async with client.stream("POST", f"{url}/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content"' in line:
                last = time.perf_counter()
                first = first or last
                n += 1
    rate = (n - 1) / (last - first) if n > 1 and last > first else float("nan")
    return first - start, rate


async def overhead(url: str, size: Size) -> tuple[list[float], list[float]]:
    async with httpx.AsyncClient(timeout=60, headers=HEADERS) as client:
        await _stream(client, url, 4)  # warm
        ttft, rates = [], []
        for _ in range(size.streams):
            first, rate = await _stream(client, url, size.stream_tokens)
            ttft.append(first)
            rates.append(rate)
    return ttft, rates


async def load(url: str, size: Size, kill: LlamaServer | None = None) -> tuple[list[float], int]:
    """``size.requests`` whole completions from 8 clients: latencies of those that
    succeeded, and how many failed; ``kill`` is SIGKILLed a third of the way in."""
    done: list[float] = []
    failed = 0
    queue = list(range(size.requests))
    body = _body(size.tokens)

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal failed
        while queue:
            queue.pop()
            if kill is not None and len(done) + failed == size.requests // 3:
                kill.kill()
            start = time.perf_counter()
            try:
                response = await client.post(f"{url}/chat/completions", json=body)
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                done.append(time.perf_counter() - start)
            else:
                failed += 1

    async with httpx.AsyncClient(timeout=120, headers=HEADERS) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(8)))
    return done, failed


def run(size_name: str, outdir: Path) -> Report:
    size = SIZES[size_name]
    report = Report("generate", size_name)
    if not LLAMA_PYTHON.exists():
        report.notes.append("llama.cpp's server is not installed: run scripts/llama-venv.sh")
        report.write(outdir)
        return report
    folder = Path(tempfile.mkdtemp(prefix="gen-bench-"))
    try:
        ttft, cdfs = _run(size, report, folder)
        report.charts.append(_chart(ttft, cdfs, outdir))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report.write(outdir)
    return report


Ttft = dict[str, tuple[float, float]]  # server -> (straight, through gpulane) p50 ms
Cdfs = dict[str, list[float]]  # system -> latencies (s), both servers up


def _run(size: Size, report: Report, folder: Path) -> tuple[Ttft, Cdfs]:
    ttft: Ttft = {}
    cdfs: Cdfs = {}
    with servers(folder) as (first_fast, slow):
        for server, label in ((first_fast, "fast"), (slow, "slow")):
            straight = asyncio.run(overhead(f"{server.url}/v1", size))
            with gpulane(server.url) as url:
                through = asyncio.run(overhead(url, size))
            _overhead_rows(report, straight, through, label)
            ttft[label] = (pct(straight[0], 50) * 1e3, pct(through[0], 50) * 1e3)
        urls = (first_fast.url, slow.url)  # a restarted fast server keeps its port
        systems: list[tuple[str, Callable[[], AbstractContextManager[str]]]] = [
            ("gpulane (pull)", partial(gpulane, *urls))
        ]
        if LITELLM.exists() and size.peers:
            for strategy in ("simple-shuffle", "least-busy"):
                systems.append((f"LiteLLM {strategy}", partial(litellm, strategy, *urls)))
        elif size.peers:
            report.notes.append(
                "LiteLLM is not installed (scripts/litellm-venv.sh): its rows are left out"
            )
        rows: list[list[object]] = []
        fast = first_fast
        for killed in (False, True):
            for name, system in systems:
                if killed:  # a fresh fast server on the same port for each run
                    fast.stop()
                    fast = LlamaServer(fast.model, folder / "fast2.log", fast.port).start()
                with system() as url:
                    latencies, _ = asyncio.run(load(url, size, kill=fast if killed else None))
                if not killed:
                    cdfs[name] = latencies
                servers_state = "fast one killed at 1/3" if killed else "both up"
                completed = f"{len(latencies)}/{size.requests}"
                rows.append(
                    [name, servers_state, pct(latencies, 50), pct(latencies, 99), completed]
                )
        fast.stop()
        note = f"{size.requests} requests of {size.tokens} tokens; the slow server is ~40x slower."
        report.tables.append(
            Table(
                "Two servers of unequal speed, 8 concurrent clients (whole completions)",
                "system | servers | p50 s | p99 s | completed",
                rows,
                note=note,
            )
        )
    return ttft, cdfs


def _chart(ttft: Ttft, cdfs: Cdfs, outdir: Path) -> str:
    fig, (left, right) = figure(9.0, 3.2, ncols=2)
    ticks = [f"{label} server" for label in ttft]
    series = {
        "straight": [t[0] for t in ttft.values()],
        "through gpulane": [t[1] for t in ttft.values()],
    }
    grouped_bars(left, series, ticks)
    axes(left, y="time to first token, p50 (ms)", legend=10)
    latency_cdf(right, cdfs)
    right.set_title("two servers of unequal speed, 8 clients", fontsize=9)
    right.legend(fontsize=8)
    return save(fig, outdir, "generate.png")


def _overhead_rows(
    report: Report,
    straight: tuple[list[float], list[float]],
    through: tuple[list[float], list[float]],
    label: str,
) -> None:
    """The overhead table and targets for one server (``label``: fast, a CPU toy at
    thousands of tokens a second; slow, at the tens a second of a real model)."""
    (t_direct, r_direct), (t_gl, r_gl) = straight, through
    added_ms = (pct(t_gl, 50) - pct(t_direct, 50)) * 1000
    rate_direct, rate_gl = float(np.nanmedian(r_direct)), float(np.nanmedian(r_gl))
    ratio = rate_gl / rate_direct
    rows: list[list[object]] = [
        ["straight to the server", pct(t_direct, 50) * 1e3, pct(t_direct, 99) * 1e3, rate_direct],
        ["through gpulane", pct(t_gl, 50) * 1e3, pct(t_gl, 99) * 1e3, rate_gl],
    ]
    report.tables.append(
        Table(
            f"Streamed chat completions, one {label} server, sequential",
            "path | TTFT p50 ms | TTFT p99 ms | tokens/s p50",
            rows,
        )
    )
    report.targets += [
        judged(f"TTFT added, p50 ({label} server)", "straight", added_ms, "<= 5 ms", digits=1),
        judged(f"streamed tokens/s ({label} server)", "straight", ratio, ">= 0.95x"),
    ]
