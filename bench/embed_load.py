"""Load on an OpenAI-compatible embeddings server (``POST {base_url}/embeddings``):
gpulane's ``/v1``, or a peer of :mod:`bench.peers` (Infinity, Ray Serve).

Rows, each bounded in requests and in time: a row stops issuing at its ``max_s`` and
reports what it finished (every request times out after ``max_s`` too, so a row ends
within twice that). On 2 CPU cores a ``quick`` run of all rows takes about 1.5 minutes
per peer on ``short`` texts and 8 on ``long`` ones (10x the tokens).

- (a) :func:`one_call`: one request of 2,048 inputs; inputs/s and wall time;
- (b) :func:`closed_loop` with 32 clients of 1 input per request, N requests in all;
  req/s, p50, p99 (ms);
- (c) :func:`closed_loop` with 8 clients of 256 inputs per request; inputs/s, p50, p99;
- :func:`at_half_load`: Poisson arrivals of single-input requests at half a given rate
  (the capacity measured in (b)) for T seconds, open loop; p50, p99;
- :func:`in_process`: one ``model.encode`` call at ``batch_size`` 64 in this process
  (the project venv's sentence-transformers through ``worker.tasks.embed``; it sorts
  the texts by length), inputs/s: the limit.

Texts: :func:`corpus` makes ``short`` (about 20 tokens) or ``long`` (about 200 tokens)
sentences from a word list, deterministic for a seed (every word is one WordPiece token
of the model's vocabulary, so a sentence of k words is k + 2 tokens with [CLS], [SEP]:
16-20 words, 18-22 tokens; 190-206 words, 192-208 tokens), or ``mixed`` (8-200 words,
10-202 tokens, uniformly: a document indexer's chunks).

``python -m bench.embed_load --size quick --rows abcp --in-process`` starts each peer
in turn (``--peer infinity``: one of them) and prints their rows as markdown tables,
side by side in one run; ``--base-url URL --model NAME`` loads a server already up
instead (gpulane: ``http://HOST:PORT/v1``). ``--json`` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from bench.report import Table, pct

BATCH = 64  # in-process batch, gpulane's embed batch
WORDS = [
    *("the", "a", "queue", "worker", "model", "batch", "time", "token", "vector", "search"),
    *("index", "query", "document", "memory", "cache", "request", "answer", "system"),
    *("fast", "slow", "data", "user", "small", "large", "running", "over", "under"),
    *("between", "network", "storage", "sentence", "city", "river", "house", "light"),
    *("water", "music", "paper", "market", "school", "garden", "window", "morning"),
]
# Words per sentence, inclusive. ``mixed`` is what a document indexer sends: chunks of
# any length up to the model's window, where a batch's padding to its longest input
# is most of the work unless like lengths are batched together.
LENGTHS = {"short": (16, 20), "long": (190, 206), "mixed": (8, 200)}


@dataclass(frozen=True)
class Size:
    one_call: int  # (a) inputs in the one request
    singles: int  # (b) requests of 1 input, all clients together
    bulk_requests: int  # (c) requests of bulk_inputs, all clients together
    bulk_inputs: int
    encode_texts: int  # in-process texts
    load_s: float  # Poisson phase length
    max_s: float  # the most any one row may take


SIZES = {
    "smoke": Size(64, 64, 8, 32, 64, load_s=1.0, max_s=30.0),
    "quick": Size(2048, 512, 16, 256, 1024, load_s=8.0, max_s=180.0),
    "full": Size(2048, 4096, 64, 256, 4096, load_s=30.0, max_s=600.0),
}
SINGLE_CLIENTS = 32
BULK_CLIENTS = 8


@dataclass
class Row:
    label: str
    requests: int
    inputs: int
    wall_s: float
    latencies_ms: list[float]
    complete: bool = True  # False: stopped at the row's time bound

    @property
    def req_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s else float("nan")

    @property
    def inputs_per_s(self) -> float:
        return self.inputs / self.wall_s if self.wall_s else float("nan")

    def summary(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "requests": self.requests,
            "inputs": self.inputs,
            "wall_s": self.wall_s,
            "req_per_s": self.req_per_s,
            "inputs_per_s": self.inputs_per_s,
            "p50_ms": pct(self.latencies_ms, 50),
            "p99_ms": pct(self.latencies_ms, 99),
            "complete": self.complete,
        }


def corpus(n: int, kind: str = "short", seed: int = 12) -> list[str]:
    """``n`` sentences of the ``kind``'s length from :data:`WORDS`, the same for a seed."""
    low, high = LENGTHS[kind]
    rng = random.Random(f"{kind}:{seed}")
    return [" ".join(rng.choices(WORDS, k=rng.randint(low, high))) for _ in range(n)]


def _cycle(texts: list[str], start: int, n: int) -> list[str]:
    return [texts[(start + i) % len(texts)] for i in range(n)]


_JSON = {"content-type": "application/json"}


async def _post(
    client: aiohttp.ClientSession, model: str, inputs: list[str], fmt: str | None = None
) -> float:
    """One request (``fmt``: its ``encoding_format``, else the server's default, floats);
    its latency in ms (the whole body read). A wrong status or count raises."""
    started = time.perf_counter()
    request: dict[str, Any] = {"model": model, "input": inputs}
    if fmt is not None:
        request["encoding_format"] = fmt
    body = orjson.dumps(request)
    async with client.post("embeddings", data=body, headers=_JSON) as reply:
        raw = await reply.read()
    elapsed = (time.perf_counter() - started) * 1000
    if reply.status != 200:
        raise RuntimeError(f"HTTP {reply.status}: {raw[:300]!r}")
    data = orjson.loads(raw)["data"]
    if len(data) != len(inputs):
        raise RuntimeError(f"{len(inputs)} inputs sent, {len(data)} embeddings back")
    return elapsed


def _client(base_url: str, timeout_s: float, clients: int) -> aiohttp.ClientSession:
    """A keep-alive pool of ``clients`` connections. aiohttp, not httpx: the load runs
    on the machine it measures, and the load generator's CPU is taken from the system
    under test: measured on 32 one-input requests, httpx spent 2.0 ms of CPU per input
    and aiohttp 0.2 ms."""
    connector = aiohttp.TCPConnector(limit=clients, limit_per_host=clients)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    return aiohttp.ClientSession(base_url.rstrip("/") + "/", connector=connector, timeout=timeout)


async def one_call(
    base_url: str, model: str, texts: list[str], n: int, max_s: float, fmt: str | None = None
) -> Row:
    """(a) One request of ``n`` inputs (``fmt``: as in :func:`_post`)."""
    async with _client(base_url, max_s, 1) as client:
        await _post(client, model, texts[:2], fmt)  # a connection open, the server warm
        latency = await _post(client, model, _cycle(texts, 0, n), fmt)
    label = f"one call of {n:,} inputs" + (f", {fmt}" if fmt else "")
    return Row(label, 1, n, latency / 1000, [latency])


async def closed_loop(
    base_url: str,
    model: str,
    texts: list[str],
    *,
    clients: int,
    per_request: int,
    requests: int,
    max_s: float,
) -> Row:
    """``clients`` concurrent clients, each sending its next request of ``per_request``
    inputs when the last one answered, ``requests`` in all or until ``max_s``."""
    latencies: list[float] = []
    issued = 0
    deadline = time.monotonic() + max_s

    async def client_loop(client: aiohttp.ClientSession) -> None:
        nonlocal issued
        while issued < requests and time.monotonic() < deadline:
            start = issued * per_request
            issued += 1
            latencies.append(await _post(client, model, _cycle(texts, start, per_request)))

    async with _client(base_url, max_s, clients) as client:
        await asyncio.gather(*(_post(client, model, texts[:1]) for _ in range(clients)))
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - started
    label = f"{clients} clients x {per_request} input(s) per request"
    done = len(latencies)
    return Row(label, done, done * per_request, wall, latencies, done == requests)


async def at_half_load(
    base_url: str,
    model: str,
    texts: list[str],
    capacity: float,
    span_s: float,
    seed: int = 7,
) -> Row:
    """Open loop: Poisson arrivals of 1-input requests at ``capacity / 2`` per second
    for ``span_s``; each request is sent on time whether or not earlier ones answered."""
    rate = capacity / 2
    rng = random.Random(seed)
    bound = int(rate * span_s * 3) + 10  # arrivals are Poisson: far above the mean
    tasks: list[asyncio.Task[float]] = []
    async with _client(base_url, span_s + 120, 256) as client:
        await _post(client, model, texts[:1])
        start = time.monotonic()
        due = rng.expovariate(rate)
        while due < span_s and len(tasks) < bound:
            pause = start + due - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            tasks.append(asyncio.create_task(_post(client, model, _cycle(texts, len(tasks), 1))))
            due += rng.expovariate(rate)
        latencies = list(await asyncio.gather(*tasks))
        wall = time.monotonic() - start
    label = f"Poisson, 1 input, {rate:,.1f} req/s (half of {capacity:,.1f})"
    return Row(label, len(latencies), len(latencies), wall, latencies)


def in_process(texts: list[str]) -> float:
    """Inputs/s of one ``model.encode`` call at batch size 64 over ``texts`` in this
    process, on the bench's device (the embed scenario's limit function, ``whole``)."""
    from bench.scenarios.embed import in_process_limit

    return in_process_limit(texts, whole=True)


async def rows(
    base_url: str, model: str, texts: list[str], size: Size, which: str = "abc"
) -> dict[str, Row]:
    """The rows named in ``which`` (``a``, ``b``, ``c``, ``p``: at half load, the
    capacity from (b), which then runs first), one after the other."""
    out: dict[str, Row] = {}
    if "a" in which:
        out["a"] = await one_call(base_url, model, texts, size.one_call, size.max_s)
    if "b" in which or "p" in which:
        out["b"] = await closed_loop(
            base_url,
            model,
            texts,
            clients=SINGLE_CLIENTS,
            per_request=1,
            requests=size.singles,
            max_s=size.max_s,
        )
    if "c" in which:
        out["c"] = await closed_loop(
            base_url,
            model,
            texts,
            clients=BULK_CLIENTS,
            per_request=size.bulk_inputs,
            requests=size.bulk_requests,
            max_s=size.max_s,
        )
    if "p" in which:
        out["p"] = await at_half_load(base_url, model, texts, out["b"].req_per_s, size.load_s)
    return out


def table(name: str, measured: dict[str, Row], limit: float | None = None) -> Table:
    """One system's rows as a report table (``limit``: in-process inputs/s around
    them, a row)."""
    body: list[list[Any]] = []
    for row in measured.values():
        s = row.summary()
        label = s["label"] if row.complete else f"{s['label']} (stopped at its time bound)"
        body.append([label, s["requests"], s["inputs_per_s"], s["req_per_s"], s["p50_ms"]])
        body[-1] += [s["p99_ms"], s["wall_s"]]
    if limit is not None:
        body.append([f"in-process model.encode, batches of {BATCH}", "", limit, "", "", "", ""])
    columns = ["row", "requests", "inputs/s", "req/s", "p50 ms", "p99 ms", "wall s"]
    return Table(name, columns, body)


def _servers(ns: argparse.Namespace) -> list[AbstractContextManager[Any]]:
    """A server already up (``--base-url``), else each ``--peer`` started in turn."""
    if ns.base_url:
        return [nullcontext(None)]
    from bench import peers

    return [peers.PEERS[name]() for name in ns.peer or peers.PEERS]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.embed_load")
    parser.add_argument(
        "--peer",
        action="append",
        choices=["infinity", "ray-serve"],
        help="a peer to start and load, one after the other (default: both)",
    )
    parser.add_argument("--base-url", help="a server already up instead (then --model too)")
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--size", choices=list(SIZES), default="smoke")
    parser.add_argument("--corpus", choices=list(LENGTHS), default="short")
    parser.add_argument("--rows", default="abc", help="any of a, b, c, p (at half load)")
    parser.add_argument("--in-process", action="store_true", help="also the in-process limit")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    ns = _parse(argv)
    size = SIZES[ns.size]
    texts = corpus(max(size.one_call, size.encode_texts, 512), ns.corpus)
    results: dict[str, dict[str, Row]] = {}
    for server in _servers(ns):  # started lazily: one peer up at a time
        with server as peer:
            base_url, model = (peer.base_url, peer.model) if peer else (ns.base_url, ns.model)
            name = peer.name if peer else base_url
            results[name] = asyncio.run(rows(base_url, model, texts, size, ns.rows))
    limit = in_process(texts[: size.encode_texts]) if ns.in_process else None
    if ns.json:
        out = {n: {k: r.summary() for k, r in m.items()} for n, m in results.items()}
        return json.dumps({"size": ns.size, "corpus": ns.corpus, "limit": limit, "rows": out})
    title = f"{ns.corpus} texts, {ns.size}"
    tables = [table(f"{n}, {title}", m) for n, m in results.items()]
    if limit is not None:
        tables.append(table(f"in-process, {title}", {}, limit))
    return "\n".join(t.markdown() for t in tables)


if __name__ == "__main__":
    print(main())
