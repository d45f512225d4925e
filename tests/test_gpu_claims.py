"""GPU claiming with real worker processes, real Redis and the fake pynvml (4 cards):
each worker gets its own card, extra workers wait visibly, a killed worker's card is
taken over within its lease, --per-gpu shares a card, --gpu N still claims."""

from __future__ import annotations

from typing import Any

import httpx
import redis
from conftest import WorkerFactory, submit, wait_status
from support.observe import scrape

from dispatcher.contract import keys
from dispatcher.contract.exits import EXIT_NO_GPU, EXIT_UNHEALTHY
from testkit import WorkerProcess, fake_gpu_env, wait_for

GPU = ["--gpu", "auto"]


def _workers(http: httpx.Client) -> dict[str, dict[str, Any]]:
    return {w["name"]: w for w in http.get("/workers").json()["workers"]}


def _serving(http: httpx.Client, names: list[str]) -> dict[str, dict[str, Any]]:
    listed = _workers(http)
    return {n: listed[n] for n in names if n in listed and listed[n]["state"] in ("idle", "busy")}


def _claims(r: redis.Redis) -> dict[str, str]:
    return {k.decode(): r.get(k).decode() for k in r.scan_iter(keys.gpu_claim("*", "*"))}


def _waiting(http: httpx.Client, name: str) -> dict[str, Any] | None:
    entry = _workers(http).get(name)
    return entry if entry and entry["state"] == "waiting_for_gpu" else None


def test_five_workers_share_four_gpus_and_the_waiter_takes_a_freed_card(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    env = fake_gpu_env(4)
    procs = [start_worker(f"race{i}", wait=False, extra=GPU, env=env) for i in range(5)]
    names = [p.name for p in procs]

    def settled() -> tuple[dict[str, dict[str, Any]], list[str]] | None:
        serving = _serving(http, names)
        waiting = [n for n in names if _waiting(http, n)]
        return (serving, waiting) if len(serving) == 4 and len(waiting) == 1 else None

    serving, (waiter,) = wait_for(settled, 30, interval_s=0.1, what="4 serving and 1 waiting")
    uuids = {w["device"]["uuid"] for w in serving.values()}
    assert len(uuids) == 4  # four distinct cards
    for entry in serving.values():
        device = entry["device"]
        assert device["kind"] == "gpu" and device["name"] == "NVIDIA Fake H100 80GB HBM3"
        assert device["memory_total_bytes"] == 80 * 2**30
    # Telemetry from the heartbeat: wait for the first samples to be published.
    wait_for(
        lambda: all(w["device"]["utilization"] is not None for w in _serving(http, names).values()),
        10,
        what="telemetry in GET /workers",
    )
    by_index = {w["device"]["index"]: w["device"] for w in _serving(http, names).values()}
    assert by_index[1]["utilization"] == 0.2 and by_index[1]["memory_used_bytes"] == 2 * 2**30
    assert by_index[1]["temperature_c"] == 41 and by_index[1]["power_w"] == 125.0
    assert by_index[3]["power_w"] is None and by_index[3]["temperature_c"] is None  # unsupported

    # The same sample in /metrics, by worker and GPU index; unsupported ones absent.
    metrics = scrape(http)
    name1 = next(n for n, w in _serving(http, names).items() if w["device"]["index"] == 1)
    name3 = next(n for n, w in _serving(http, names).items() if w["device"]["index"] == 3)
    gpu1, gpu3 = {"worker": name1, "gpu": "1"}, {"worker": name3, "gpu": "3"}
    assert metrics.value("gpulane_gpu_utilization_ratio", **gpu1) == 0.2
    assert metrics.value("gpulane_gpu_memory_used_bytes", **gpu1) == 2 * 2**30
    assert metrics.value("gpulane_gpu_temperature_celsius", **gpu1) == 41
    assert metrics.value("gpulane_gpu_power_watts", **gpu1) == 125
    assert metrics.value("gpulane_gpu_power_watts", **gpu3) is None
    assert metrics.value("gpulane_gpu_memory_total_bytes", **gpu3) == 80 * 2**30
    assert metrics.value("gpulane_workers", state="waiting_for_gpu") == 1

    waiting = _workers(http)[waiter]
    assert waiting["device"] is None and "waiting for a free GPU" in waiting["reason"]
    waiter_proc = next(p for p in procs if p.name == waiter)
    # The log line may trail the state it describes (published first): wait for it.
    wait_for(
        lambda: "waiting for a free GPU: all 4 GPUs claimed" in waiter_proc.output(),
        10,
        what="the waiting worker's log line",
    )
    classes = {c["name"]: c for c in http.get("/queues").json()["classes"]}
    assert classes["batch"]["workers"] == 4  # the waiting one is not capacity

    claims = _claims(r)
    assert sorted(claims.values()) == sorted(serving)
    assert all(0 < r.pttl(k) <= 1000 for k in claims)  # lease_ttl_s = 1 s in tests

    # A task sees only its card, by UUID.
    result = wait_status(http, submit(http, "test.env")["id"], {"succeeded"})["result"]
    assert result["cuda_visible_devices"] == result["device"]["uuid"]
    assert result["cuda_visible_devices"] in uuids

    # Kill a claimant outright: its claim expires within the lease; the waiter takes it.
    victim_name, victim = next(iter(serving.items()))
    next(p for p in procs if p.name == victim_name).kill()
    took = wait_for(
        lambda: (
            (w := _serving(http, [waiter]).get(waiter))
            and w["device"]["uuid"] == victim["device"]["uuid"]
        ),
        15,
        interval_s=0.05,
        what="the waiter to take the killed worker's card",
    )
    assert took
    assert _claims(r)[keys.gpu_claim(victim["device"]["uuid"], 0)] == waiter


def test_per_gpu_lets_two_workers_share_a_card(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    env = fake_gpu_env(1)
    share = [*GPU, "--per-gpu", "2"]
    a = start_worker("share-a", extra=share, env=env)
    b = start_worker("share-b", extra=share, env=env)
    c = start_worker("share-c", wait=False, extra=share, env=env)
    wait_for(lambda: _waiting(http, c.name), 20, what="the third worker to wait")
    listed = _workers(http)
    uuid = listed[a.name]["device"]["uuid"]
    assert listed[b.name]["device"]["uuid"] == uuid
    assert _claims(r) == {keys.gpu_claim(uuid, 0): a.name, keys.gpu_claim(uuid, 1): b.name}
    assert "2 workers per GPU" in listed[c.name]["reason"]
    # A waiting worker stops cleanly on SIGTERM and leaves the pool.
    d = start_worker("share-d", wait=False, extra=share, env=env)
    wait_for(lambda: _waiting(http, d.name), 20, what="a fourth worker to wait")
    assert d.terminate() == 0
    wait_for(lambda: d.name not in _workers(http), 5, what="the fourth to leave the pool")
    # A clean exit releases the slot at once (compare-and-delete), no lease to wait out.
    assert b.terminate() == 0
    wait_for(lambda: _serving(http, [c.name]), 15, what="the third worker to take the slot")
    assert _claims(r)[keys.gpu_claim(uuid, 1)] == c.name


def test_explicit_gpu_still_claims_and_waits_for_its_holder(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    env = fake_gpu_env(4)
    holder = start_worker("holder", extra=["--gpu", "1"], env=env)
    uuid = _workers(http)[holder.name]["device"]["uuid"]
    second = start_worker("second", wait=False, extra=["--gpu", "1"], env=env)
    entry = wait_for(lambda: _waiting(http, second.name), 20, what="--gpu 1 to wait")
    assert entry["reason"] == f"waiting for a free GPU: gpu1 ({uuid}) claimed by holder"
    impatient: WorkerProcess = start_worker(
        "impatient", wait=False, extra=["--gpu", uuid], env=env, gpu_wait_s=0.5
    )
    assert impatient.process.wait(20) == EXIT_NO_GPU
    assert "no GPU became free within gpu_wait_s=0.5 s" in impatient.output()
    assert _claims(r) == {keys.gpu_claim(uuid, 0): holder.name}  # never shared by mistake

    assert holder.terminate() == 0
    wait_for(lambda: _serving(http, [second.name]), 15, what="--gpu 1 to get its card")
    assert _workers(http)[second.name]["device"]["index"] == 1


def test_a_lost_claim_is_retaken_or_ends_the_worker(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    worker = start_worker("claimant", extra=GPU, env=fake_gpu_env(1))
    [key] = _claims(r)
    r.delete(key)  # expired while the worker stalled, and nobody took it: taken again
    wait_for(lambda: r.get(key) == b"claimant", 10, what="the claim to be taken again")
    # Logged once the renewal's reply is back, after Redis holds the claim: wait for it.
    wait_for(
        lambda: "GPU claim had expired; taken again" in worker.output(),
        10,
        what="the worker to say it took the claim again",
    )
    r.set(key, "intruder", px=60_000)  # someone else holds the card now
    assert worker.process.wait(20) == EXIT_UNHEALTHY, worker.output()
    assert "was taken by intruder" in worker.output()
    assert r.get(key) == b"intruder"  # the leaving worker's release deletes only its own
