"""``gpulane worker``: one process, one device, tasks one at a time.

Order matters:

1. discover the GPUs and resolve ``--gpu`` (a wrong one fails before Redis is used);
2. register the worker (name checked, visible in ``GET /workers`` from here on), start
   the heartbeat, and claim a GPU through Redis, waiting visibly while all are claimed;
3. pin ``CUDA_VISIBLE_DEVICES`` to the claimed card's UUID, and only then import the
   task modules, so whatever CUDA code they load sees only that card;
4. if a task type has a model loader: register as ``starting`` ("loading model") with
   the catalog, load each model once on the device (``cuda`` or ``cpu``), timed;
5. register again, now ``idle``, and serve.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from types import FrameType
from typing import Any

from redis.exceptions import RedisError

from dispatcher.contract.backoff import Backoff
from dispatcher.contract.connect import sync_client
from dispatcher.contract.exits import EXIT_CONFIG, EXIT_NO_GPU, EXIT_RECYCLED, EXIT_UNHEALTHY
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.reap import record_reaped
from dispatcher.contract.settings import Settings
from worker.broker import Broker
from worker.claims import Claimed
from worker.execute import Interrupts, ProgressSink, Runner, TaskHandback
from worker.gpu.budget import GpuBudget
from worker.gpu.claim import claim_device
from worker.gpu.devices import Device, DeviceError, discover, pin, select
from worker.gpu.sampler import DeviceWatch
from worker.heartbeat import Heartbeat
from worker.loop import WorkerLoop
from worker.registry import REGISTRY, TaskModuleError, load_task_modules
from worker.split import Splitter
from worker.state import WorkerState

__all__ = ["register_worker", "run_worker"]

log = logging.getLogger("gpulane.worker")


def register_worker(
    broker: Broker,
    state: WorkerState,
    settings: Settings,
    recorder: Recorder,
    catalog: dict[str, Any] | None = None,
) -> bool:
    """Publish the worker, waiting for Redis if need be. A name still leased by an
    earlier process (a restart after a crash) is waited out for two lease periods;
    False if it stays taken (another live worker has it)."""
    backoff = Backoff(cap_s=5.0)
    name_deadline = time.monotonic() + 2 * settings.lease_ttl_s
    while not state.stopping:
        try:
            recovered = broker.register(
                state.info(), REGISTRY.catalog() if catalog is None else catalog
            )
        except RedisError as exc:
            log.warning("redis unreachable at start, retrying: %s", exc)
            time.sleep(backoff.next())
            continue
        if recovered is not None:
            record_reaped(recovered, recorder, "gave back a task an earlier process held")
            return True
        if time.monotonic() > name_deadline:
            return False
        time.sleep(settings.heartbeat_interval_s / 2)
    return False


def _install_signals(state: WorkerState, interrupts: Interrupts, runner: Runner) -> None:
    def on_stop(signum: int, frame: FrameType | None) -> None:
        current = runner.current
        if state.stopping and current is not None:  # second signal: no grace period
            interrupts.request(TaskHandback, current)
        state.request_stop()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)


class _Worker:
    """The parts of one worker process, wired together."""

    def __init__(self, settings: Settings, served: list[str], name: str) -> None:
        self.settings = settings
        client = sync_client(settings, socket_timeout=10, connect_timeout=5)
        self.broker = Broker(client, settings, name, served)
        self.state = WorkerState(name, None, served, [])
        self.state.speed = settings.worker_speed
        self.recorder = Recorder()
        self.interrupts = Interrupts()
        self.runner = Runner(
            REGISTRY,
            self.interrupts,
            _progress_sink(self.broker),
            {},
            name,
            settings.max_result_bytes,
            Splitter(REGISTRY, self.broker.live_workers),
        )
        self.heartbeat = Heartbeat(
            self.broker, self.state, self.recorder, self.runner, self.interrupts, settings
        )
        self.gpu_slot: tuple[str, int] | None = None
        self.budget = GpuBudget(None)

    def take_device(self, candidates: list[Device], per_gpu: int) -> int | None:
        """Claim (a GPU) and pin the device; an exit status if there is none to run on."""
        device = candidates[0]
        if device.kind == "gpu":
            claimed = claim_device(self.broker, self.state, candidates, per_gpu, self.settings)
            if claimed is None:
                return None if self.state.stopping else EXIT_NO_GPU
            device, self.gpu_slot = claimed
            self.heartbeat.gpu_slot = self.gpu_slot
            self.heartbeat.watch = DeviceWatch(
                device, self.settings.heartbeat_interval_s, self.settings.gpu_sample_timeout_s
            ).start()
        pin(device)
        self.state.device = device
        self.budget = GpuBudget(device, self.heartbeat.watch)
        self.state.gpu_capacity_mb = self.budget.capacity_mb
        self.state.set("starting")
        return None

    def load_models(self) -> bool:
        """Run every model loader once, on this worker's device; the worker stays
        ``starting`` ("loading model") meanwhile. False if stopped or a load failed."""
        loaders = REGISTRY.loaders()
        if not loaders:
            return True
        device = self.state.device
        target = "cuda" if device is not None and device.kind == "gpu" else "cpu"
        self.budget.before_models()
        for model, load in loaders.items():
            started = time.monotonic()
            try:
                load(target)
            except Exception as exc:  # a model that fails to load: unhealthy, restarted
                log.exception("loading model %s failed", model, extra={"worker": self.state.name})
                self.state.mark_unhealthy(f"loading model {model} failed: {exc}")
                return False
            seconds = round(time.monotonic() - started, 3)
            self.state.models[model] = {"load_s": seconds, "device": target}
            log.info(
                "model %s loaded on %s in %.2f s",
                model,
                target,
                seconds,
                extra={"worker": self.state.name, "elapsed_s": seconds},
            )
        self.budget.after_models()  # what a task can have is the card less the models
        self.state.gpu_capacity_mb = self.budget.capacity_mb
        return not self.state.stopping

    def serve(self, tasks: list[str]) -> int:
        # Only now, pinned to its device, may task code load (see the module docstring),
        # so a module that cannot be used is found here rather than before Redis.
        try:
            load_task_modules(tasks)
        except TaskModuleError as exc:
            log.error("%s", exc, extra={"worker": self.state.name})
            return EXIT_CONFIG
        if not REGISTRY.names():  # registered idle, it would claim tasks it cannot run
            log.error(
                "task modules %s declare no @task: nothing to serve",
                tasks,
                extra={"worker": self.state.name},
            )
            return EXIT_CONFIG
        self.state.task_types = REGISTRY.names()
        self.runner.device = self.state.device_json() or {}
        catalog = REGISTRY.catalog()  # pydantic schemas: built once, not per phase
        # Phase "types known": still `starting` (loading its models, if it has any), the
        # catalog published; a heartbeat may publish the state at any moment, and nobody
        # may see this worker idle before its types are known.
        self.state.set("starting", "loading model" if REGISTRY.loaders() else "")
        if not self.publish(catalog) or not self.load_models():
            return 0  # stopped (or unhealthy, or its name taken) before it could serve
        # Phase "ready": published as idle now, not a heartbeat later, so admission
        # counts the worker as capacity as soon as it can take a task.
        self.state.set("idle")
        if not self.publish(catalog):
            return 0
        device = self.state.device
        log.info(
            "worker ready on %s (%s%s), classes %s, tasks %s",
            device.label if device else "?",
            device.name if device else "?",
            f", {device.uuid}" if device and device.uuid else "",
            self.state.classes,
            REGISTRY.names(),
            extra={"worker": self.state.name},
        )
        WorkerLoop(
            self.broker, self.runner, self.state, self.recorder, self.settings, self.budget
        ).run()
        return 0

    def publish(self, catalog: dict[str, Any] | None = None) -> bool:
        """Publish the worker as it is now (one call per start-up phase: its name, its
        types, ready); False when it cannot go on (stopped, or its name is taken)."""
        return register_worker(self.broker, self.state, self.settings, self.recorder, catalog)

    def leave(self) -> None:
        """Release the GPU claim, unregister and flush the last metrics. An unhealthy
        worker is listed again (as ``unhealthy``, with its reason, holding nothing)
        until its lease runs out, so operators and dashboards see why it went; a
        restarted process of the same name may take the name over at once."""
        self.heartbeat.gpu_slot = None  # before stop(): no late beat may renew the claim
        self.heartbeat.stop()
        if self.heartbeat.alive():  # stuck on a hung Redis: a last beat would race it
            log.warning("heartbeat did not stop; leaving without a last report")
            return
        try:
            if self.gpu_slot is not None:
                self.broker.gpu_release(self.gpu_slot)
            if self.state.unhealthy:
                self._unregister()  # out of the idle sets: no doorbell rings for it
                self.heartbeat.beat(relist=True)  # listed again, as unhealthy, for a lease
            else:
                self.heartbeat.beat()  # the last metrics
                self._unregister()
        except RedisError as exc:
            log.warning("could not unregister (%s); the leases will expire by themselves", exc)

    def _unregister(self) -> None:
        # Normally empty: a clean exit finished or handed back its task first.
        record_reaped(self.broker.unregister(), self.recorder, "gave back a task on exit")


def run_worker(
    settings: Settings,
    gpu: str = "auto",
    classes: list[str] | None = None,
    tasks: list[str] | None = None,
    name: str | None = None,
    per_gpu: int | None = None,
) -> int:
    """Run until SIGTERM/SIGINT. Returns the process exit status."""
    served = classes or settings.class_names
    unknown = [c for c in served if c not in settings.classes]
    if unknown:
        log.error("unknown classes %s; configured: %s", unknown, settings.class_names)
        return EXIT_CONFIG
    served = [c for c in settings.class_names if c in served]  # priority order
    name = name or f"{socket.gethostname()}.{os.getpid()}"
    try:  # before anything touches Redis: a wrong --gpu fails fast and leaves no trace
        candidates = select(gpu, [] if gpu == "none" else discover())
    except DeviceError as exc:
        log.error("%s", exc, extra={"worker": name})
        return EXIT_CONFIG
    worker = _Worker(settings, served, name)
    _install_signals(worker.state, worker.interrupts, worker.runner)
    # Start-up in phases, each published once: the name (before the device: a name
    # already taken fails here), the device (take_device), the types and their models,
    # ready (serve).
    if not worker.publish():
        if not worker.state.stopping:
            log.error("a live worker is already named %r; choose another --name", worker.state.name)
            return EXIT_CONFIG
        return 0
    worker.heartbeat.start()
    try:
        status = worker.take_device(candidates, per_gpu or settings.per_gpu)
        if status is None and not worker.state.stopping:
            status = worker.serve(tasks or settings.task_modules)
    finally:
        worker.leave()
    if worker.state.unhealthy:  # whenever it happened: the supervisor must restart it
        status = EXIT_UNHEALTHY
    elif worker.state.recycled:
        status = EXIT_RECYCLED
    log.info("worker stopped, exit status %d", status or 0, extra={"worker": worker.state.name})
    return status or 0


def _progress_sink(broker: Broker) -> ProgressSink:
    def sink(task: Claimed, fraction: float, message: str) -> None:
        try:
            if not broker.progress(task, fraction, message):
                log.debug("progress fenced (not the current attempt)", extra={"task": task.task_id})
        except RedisError:
            log.debug("progress not saved (redis unreachable)", extra={"task": task.task_id})

    return sink
