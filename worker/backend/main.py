"""``gpulane worker --backend URL``: one process fronting one inference server.

Order, as for an in-process worker (``worker.main``), with the server in place of a
device:

1. register as ``starting`` ("waiting for backend"), start the heartbeat;
2. wait until the server lists its models (``GET /v1/models``): registration is not
   readiness, a server still loading its weights is not capacity;
3. publish each model as a routed type (``dispatcher.contract.generation``) and
   register ``idle``; serve with ``--slots`` tasks at once (else llama.cpp's
   ``/props`` ``total_slots``, else ``backend_slots``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from types import FrameType
from typing import Any

import httpx
from redis.exceptions import RedisError

from dispatcher.contract.connect import sync_client
from dispatcher.contract.exits import EXIT_CONFIG, EXIT_UNHEALTHY
from dispatcher.contract.generation import catalog_entry, type_of_model
from dispatcher.contract.metrics import Recorder
from dispatcher.contract.reap import record_reaped
from dispatcher.contract.settings import Settings
from worker.backend.client import Backend, BackendDown, BackendError
from worker.backend.loop import BackendLoop
from worker.broker import Broker
from worker.execute import Interrupts
from worker.heartbeat import Heartbeat
from worker.main import register_worker
from worker.state import WorkerState

__all__ = ["run_backend_worker"]

log = logging.getLogger("gpulane.worker")


async def _wait_for_models(
    backend: Backend, state: WorkerState, interval_s: float
) -> dict[str, int | None]:
    """The server's models (id -> context length, when it says), once it lists at
    least one (empty: stopped first)."""
    said = ""
    while not state.stopping:
        try:
            models = await backend.models()
            if models:
                return models
            why = "it lists no model"
        except (BackendDown, BackendError) as exc:
            why = str(exc)
        if why != said:
            log.warning(
                "waiting for backend %s: %s", backend.url, why, extra={"worker": state.name}
            )
            said = why
        state.set("starting", f"waiting for backend {backend.url}: {why}"[:300])
        await asyncio.sleep(interval_s)
    return {}


async def _server_props(url: str) -> tuple[int | None, int | None]:
    """What llama.cpp's server says of itself (``/props``): how many sequences it runs
    at once, and each one's context; (None, None) from a server that does not say."""
    try:
        async with httpx.AsyncClient(timeout=2.0) as client:
            props = (await client.get(url.rstrip("/") + "/props")).json()
    except (httpx.HTTPError, ValueError):
        return None, None
    if not isinstance(props, dict):
        return None, None
    settings = props.get("default_generation_settings")
    slots, n_ctx = (
        props.get("total_slots"),
        settings.get("n_ctx") if isinstance(settings, dict) else None,
    )
    return (
        slots if isinstance(slots, int) and slots > 0 else None,
        n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None,
    )


class _Backend:
    """The parts of one backend worker process, wired together."""

    def __init__(self, settings: Settings, served: list[str], name: str, backend: Backend) -> None:
        self.settings = settings
        client = sync_client(settings, socket_timeout=10, connect_timeout=5)
        self.broker = Broker(client, settings, name, served, types=[])
        self.state = WorkerState(name, None, served, [])
        self.state.speed = settings.worker_speed
        self.recorder = Recorder()
        self.backend = backend
        self.loop = BackendLoop(
            self.broker, backend, self.state, self.recorder, settings, settings.backend_slots
        )
        self.heartbeat = Heartbeat(
            self.broker, self.state, self.recorder, self.loop, Interrupts(), settings
        )

    def register(self, catalog: dict[str, Any]) -> bool:
        return register_worker(self.broker, self.state, self.settings, self.recorder, catalog)

    async def serve(self, slots: int | None) -> None:
        self.state.set("starting", f"waiting for backend {self.backend.url}")
        models = await _wait_for_models(
            self.backend, self.state, self.settings.backend_probe_interval_s
        )
        if not models:
            return
        server_slots, n_ctx = await _server_props(self.backend.url)
        slots = slots or server_slots or self.settings.backend_slots
        types = {type_of_model(m): m for m in models}
        self.broker.types = sorted(types)
        self.loop.slots = slots
        self.state.task_types = sorted(types)
        self.state.parks = sorted(types)
        self.state.backend = {
            "url": self.backend.url,
            "slots": slots,
            "busy": 0,
            "models": sorted(models),
        }
        catalog = {t: catalog_entry(m, models[m] or n_ctx) for t, m in types.items()}
        # Published with the catalog while still `starting`, then idle: nobody may see
        # the worker as capacity before its types are known.
        if not await asyncio.to_thread(self.register, catalog):
            return
        self.state.set("idle")
        if not await asyncio.to_thread(self.register, catalog):
            return
        log.info(
            "backend worker for %s ready, models %s, %d slots, classes %s",
            self.backend.url,
            sorted(models),
            slots,
            self.state.classes,
            extra={"worker": self.state.name},
        )
        await self.loop.run()

    def leave(self) -> None:
        self.heartbeat.stop()
        if self.heartbeat.alive():
            log.warning("heartbeat did not stop; leaving without a last report")
            return
        try:
            self.heartbeat.beat()  # the last metrics
            record_reaped(self.broker.unregister(), self.recorder, "gave back a task on exit")
        except RedisError as exc:
            log.warning("could not unregister (%s); the leases will expire by themselves", exc)


def run_backend_worker(
    settings: Settings,
    url: str,
    slots: int | None = None,
    api_key_env: str | None = None,
    classes: list[str] | None = None,
    name: str | None = None,
) -> int:
    """Run until SIGTERM/SIGINT. Returns the process exit status."""
    served = classes or settings.class_names
    unknown = [c for c in served if c not in settings.classes]
    if unknown:
        log.error("unknown classes %s; configured: %s", unknown, settings.class_names)
        return EXIT_CONFIG
    served = [c for c in settings.class_names if c in served]  # priority order
    name = name or f"{socket.gethostname()}.{os.getpid()}"
    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            log.error(
                "--api-key-env %s: no such environment variable",
                api_key_env,
                extra={"worker": name},
            )
            return EXIT_CONFIG
    if not url.startswith(("http://", "https://")):
        log.error("--backend %r: an http:// or https:// URL", url, extra={"worker": name})
        return EXIT_CONFIG
    worker = _Backend(settings, served, name, Backend(url, api_key))

    def on_stop(signum: int, frame: FrameType | None) -> None:
        worker.state.request_stop()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    if not worker.register({}):
        if not worker.state.stopping:
            log.error("a live worker is already named %r; choose another --name", name)
            return EXIT_CONFIG
        return 0
    worker.heartbeat.start()
    try:
        asyncio.run(_serve_and_close(worker, slots))
    finally:
        worker.leave()
    status = EXIT_UNHEALTHY if worker.state.unhealthy else 0
    log.info("worker stopped, exit status %d", status, extra={"worker": name})
    return status


async def _serve_and_close(worker: _Backend, slots: int | None) -> None:
    try:
        await worker.serve(slots)
    finally:
        await worker.backend.close()
