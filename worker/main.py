"""``gpulane worker``: one process, one device, tasks one at a time.

Order matters: the device is chosen and ``CUDA_VISIBLE_DEVICES`` set before any task
module is imported, so whatever CUDA code those modules load sees only its GPU.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from types import FrameType

from redis import Redis
from redis.exceptions import RedisError

from dispatcher.backoff import Backoff
from dispatcher.metrics import Recorder
from dispatcher.settings import Settings
from worker.broker import Broker
from worker.devices import Device, DeviceError, discover, pin, select
from worker.execute import Interrupts, ProgressSink, Runner, TaskHandback
from worker.heartbeat import Heartbeat
from worker.loop import WorkerLoop
from worker.registry import REGISTRY, load_task_modules
from worker.state import WorkerState

__all__ = ["run_worker"]

log = logging.getLogger("gpulane.worker")

EXIT_CONFIG = 2


def _choose_device(gpu: str) -> Device:
    devices = [] if gpu == "none" else discover()
    return select(gpu, devices)


def _register(broker: Broker, state: WorkerState, settings: Settings) -> bool:
    """Publish the worker, waiting for Redis if need be. A name still leased by an
    earlier process (a restart after a crash) is waited out for two lease periods;
    False if it stays taken (another live worker has it)."""
    backoff = Backoff(cap_s=5.0)
    name_deadline = time.monotonic() + 2 * settings.lease_ttl_s
    while not state.stopping:
        try:
            recovered = broker.register(state.info(), REGISTRY.catalog())
        except RedisError as exc:
            log.warning("redis unreachable at start, retrying: %s", exc)
            time.sleep(backoff.next())
            continue
        if recovered is not None:
            for item in recovered:
                log.warning(
                    "gave back a task an earlier process of this name held: %s",
                    item.outcome,
                    extra={"task": item.task_id, "class": item.cls},
                )
            return True
        if time.monotonic() > name_deadline:
            return False
        time.sleep(settings.heartbeat_interval_s / 2)
    return False


def _install_signals(state: WorkerState, interrupts: Interrupts) -> None:
    def on_stop(signum: int, frame: FrameType | None) -> None:
        if state.stopping:  # second signal: don't wait for the grace period
            interrupts.request(TaskHandback)
        state.request_stop()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)


def run_worker(
    settings: Settings,
    gpu: str = "auto",
    classes: list[str] | None = None,
    tasks: list[str] | None = None,
    name: str | None = None,
) -> int:
    """Run until SIGTERM/SIGINT. Returns the process exit status."""
    try:
        device = _choose_device(gpu)
    except DeviceError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    pin(device)
    load_task_modules(tasks or settings.task_modules)

    served = classes or settings.class_names
    unknown = [c for c in served if c not in settings.classes]
    if unknown:
        log.error("unknown classes %s; configured: %s", unknown, settings.class_names)
        return EXIT_CONFIG
    served = [c for c in settings.class_names if c in served]  # priority order
    name = name or f"{socket.gethostname()}.{os.getpid()}"

    client = Redis.from_url(
        settings.redis_url_or_default, socket_timeout=10, socket_connect_timeout=5
    )
    broker = Broker(client, settings, name, served)
    state = WorkerState(name, device, served, REGISTRY.names())
    recorder = Recorder()
    interrupts = Interrupts()
    runner = Runner(
        REGISTRY,
        interrupts,
        _progress_sink(broker),
        state.device_json(),
        name,
        settings.max_result_bytes,
    )
    _install_signals(state, interrupts)

    if not _register(broker, state, settings):
        if not state.stopping:
            log.error("a live worker is already named %r; choose another --name", name)
            return EXIT_CONFIG
        return 0
    log.info(
        "worker ready on %s (%s), classes %s, tasks %s",
        device.label,
        device.name,
        served,
        REGISTRY.names(),
        extra={"worker": name},
    )
    heartbeat = Heartbeat(broker, state, recorder, runner, interrupts, settings)
    heartbeat.start()
    try:
        WorkerLoop(broker, runner, state, recorder, settings).run()
    finally:
        heartbeat.stop()
        _leave(broker, heartbeat)
    log.info("worker stopped", extra={"worker": name})
    return 0


def _progress_sink(broker: Broker) -> ProgressSink:
    def sink(task_id: str, fraction: float, message: str) -> None:
        try:
            broker.progress(task_id, fraction, message)
        except RedisError:
            log.debug("progress not saved (redis unreachable)", extra={"task": task_id})

    return sink


def _leave(broker: Broker, heartbeat: Heartbeat) -> None:
    try:
        heartbeat.beat()  # flush the last metrics
        broker.unregister()
    except RedisError as exc:
        log.warning("could not unregister (%s); the lease will expire by itself", exc)
