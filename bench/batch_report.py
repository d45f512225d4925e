"""What reporting a batch's outcomes costs the worker: 64 ``finish.lua`` calls one round
trip each (how a single task is reported) against one round trip (how a batch is: one
``finish.lua`` call for its records since 2026-12-07, 64 pipelined calls before), side
by side, over loopback and through a relay that adds latency
(``testkit.slowlink``), since a worker on another host pays a round trip per call.

    python -m bench.batch_report [--rounds 30]   # writes bench/results/batch_report.md
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis

from dispatcher.api.store import Submission, submit_options
from dispatcher.contract.jobs import encode_call
from dispatcher.contract.scripts import SyncScripts
from dispatcher.contract.settings import Settings
from testkit import REPO, RedisServer, free_port, wait_redis
from worker.broker import Broker
from worker.claims import Claimed, Report
from worker.state import WorkerState

TYPE = "test.batch_echo"  # any batched type: the claim takes the whole batch at once
SIZE = 64  # the embed type's batch size
LINK_DELAY_MS = 0.25
RESULT = '{"embedding":[0.1,0.2],"dim":2}'


def _batch(client: redis.Redis, broker: Broker, settings: Settings) -> list[Claimed]:
    scripts = SyncScripts(client)
    for i in range(SIZE):
        sub = Submission(TYPE, "batch", {"value": i}, timeout_s=60, tenant="t")
        opts = submit_options(sub, settings.classes["batch"], 1, 1.0, settings)
        scripts.run("submit", opts, encode_call(TYPE, {"value": i}), "")
    claims = broker.claim(False, "{}", batch={TYPE: SIZE})
    assert len(claims) == SIZE
    return claims


def _one_by_one(broker: Broker, claims: list[Claimed]) -> None:
    for claimed in claims:
        broker.finish(claimed, "finished", RESULT)


def _pipelined(broker: Broker, claims: list[Claimed]) -> None:
    broker.finish_many([Report(claimed, "finished", RESULT) for claimed in claims])


MODES: dict[str, Callable[[Broker, list[Claimed]], None]] = {
    "one round trip per item": _one_by_one,
    "one round trip per batch": _pipelined,
}


def _measure(port: int, rounds: int) -> dict[str, float]:
    """Median ms to report one batch, per mode, alternating modes round by round."""
    client = redis.Redis(port=port, socket_timeout=10)
    settings = Settings(redis_url=f"redis://127.0.0.1:{port}/0", catalog_on_start=False)
    name = f"bench-{port}"  # one worker per link: the first one's lease is still live
    broker = Broker(client, settings, name, settings.class_names)
    state = WorkerState(name, None, settings.class_names, [TYPE])
    assert broker.register(state.info(), {}) is not None
    pings = []
    for _ in range(50):
        started = time.perf_counter()
        client.ping()
        pings.append((time.perf_counter() - started) * 1000)
    times: dict[str, list[float]] = {"PING": pings, **{mode: [] for mode in MODES}}
    for _ in range(rounds):
        for mode, report in MODES.items():
            claims = _batch(client, broker, settings)
            started = time.perf_counter()
            report(broker, claims)
            times[mode].append((time.perf_counter() - started) * 1000)
    return {mode: statistics.median(values) for mode, values in times.items()}


def measure(rounds: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp), appendfsync="everysec").start()
        relay_port = free_port()
        relay = subprocess.Popen(
            [sys.executable, "-m", "testkit.slowlink", f"127.0.0.1:{relay_port}",
             f"127.0.0.1:{server.port}", "--delay-ms", str(LINK_DELAY_MS), "--loss", "0"],
            cwd=REPO,
        )  # fmt: skip
        try:
            probe = redis.Redis(port=relay_port, socket_timeout=2)
            wait_redis(probe, "redis through the slow-link relay")
            return {
                "loopback": _measure(server.port, rounds),
                "relay": _measure(relay_port, rounds),
            }
        finally:
            relay.kill()
            relay.wait()
            server.kill()


def report(results: dict[str, dict[str, float]], rounds: int) -> str:
    lines = [
        "# Reporting a batch's outcomes (bench/batch_report.py)",
        "",
        f"Command: `python -m bench.batch_report --rounds {rounds}`. A worker reports a batch",
        f"of {SIZE} finished items (`finish.lua`); median time per batch over {rounds}",
        "rounds, the two ways alternating in one run. The relay row goes through",
        f"`testkit.slowlink` (a Python TCP relay set to {LINK_DELAY_MS:g} ms each way), as a",
        "worker on another host would; its real round trip is the PING column (the",
        "relay's own scheduling adds to the set delay).",
        "",
        "| link | PING round trip | " + " | ".join(MODES) + " | per item / per batch |",
        "|---|" + "---|" * (len(MODES) + 2),
    ]
    for link, by_mode in results.items():
        one, piped = (by_mode[mode] for mode in MODES)
        lines.append(
            f"| {link} | {by_mode['PING']:.2f} ms | {one:.1f} ms | {piped:.1f} ms "
            f"| {one / piped:.1f} times |"
        )
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    text = report(measure(args.rounds), args.rounds)
    (REPO / "bench" / "results" / "batch_report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
