"""The `gpulane` command: up, api, worker, catalog, submit, status."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from dispatcher.contract.exits import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
)
from dispatcher.contract.logs import configure_logging
from dispatcher.contract.settings import Settings, SettingsError, load_settings
from dispatcher.contract.strict_json import loads_finite

__all__ = ["main"]

log = logging.getLogger("gpulane")


def _csv(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpulane", description="GPU job dispatcher.")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run Redis, the API and one worker per GPU on this machine")
    up.add_argument(
        "--workers", default="auto", help="N, or auto: one per GPU (cpu_workers without GPUs)"
    )
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    up.add_argument("--redis-url", help="use this Redis instead of a private one")
    up.add_argument("--data-dir", type=Path)
    up.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="also start a backend worker for this OpenAI-compatible server (repeatable)",
    )

    api = sub.add_parser("api", help="run the HTTP API")
    api.add_argument("--host")
    api.add_argument("--port", type=int)
    api.add_argument("--redis-url")
    api.add_argument("--workers", type=int, dest="api_workers", help="API processes (default 1)")
    api.add_argument("--fd", type=int, help=argparse.SUPPRESS)  # a socket `gpulane up` holds

    worker = sub.add_parser("worker", help="run one worker process")
    worker.add_argument(
        "--gpu",
        default="auto",
        help="auto: claim a free GPU (wait if all are claimed); none: the cpu; an index or "
        "UUID: claim that GPU (wait while another worker holds it)",
    )
    worker.add_argument(
        "--per-gpu",
        type=int,
        metavar="K",
        help="up to K workers share one GPU (default: GPULANE_PER_GPU, 1)",
    )
    worker.add_argument(
        "--speed",
        type=float,
        dest="worker_speed",
        metavar="X",
        help="relative speed of this worker's device, for a pool that mixes GPU generations: "
        "a parked faster worker is woken first (default: GPULANE_WORKER_SPEED, 1)",
    )
    worker.add_argument("--classes", type=_csv, help="classes to serve (default: all)")
    worker.add_argument("--tasks", type=_csv, help="task modules to load (default: built-ins)")
    worker.add_argument("--name", help="worker name (default: host.pid)")
    worker.add_argument("--redis-url")
    worker.add_argument(
        "--backend",
        metavar="URL",
        help="front this OpenAI-compatible inference server instead of running task modules",
    )
    worker.add_argument(
        "--slots",
        type=int,
        help="with --backend: tasks held at once (default: the server's /props total_slots, "
        "else backend_slots, 8)",
    )
    worker.add_argument(
        "--api-key-env", metavar="VAR", help="with --backend: the server's API key is in VAR"
    )

    catalog = sub.add_parser(
        "catalog", help="publish the task types of the configured task modules to Redis"
    )
    catalog.add_argument("--tasks", type=_csv, help="task modules (default: task_modules)")
    catalog.add_argument("--redis-url")
    catalog.add_argument(
        "--print", action="store_true", dest="print_only", help="print it; touch no Redis"
    )

    submit = sub.add_parser("submit", help="submit a task (a document, or --type/--args)")
    submit.add_argument("file", nargs="?", type=Path)
    submit.add_argument("--type")
    submit.add_argument("--class", dest="cls")
    # Both read as text and checked in _submit_inputs: a mistake is one line, exit 2.
    submit.add_argument("--args", help="JSON object of arguments")
    submit.add_argument("--timeout", help="run-time limit in seconds")
    submit.add_argument("--wait", action="store_true", help="wait and print the result")
    submit.add_argument("--url", help="API URL (default: GPULANE_API_URL or the local `up`)")

    status = sub.add_parser("status", help="show classes and workers")
    status.add_argument("--watch", action="store_true", help="refresh every second")
    status.add_argument("--url")
    return parser


def _settings(ns: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {
        key: getattr(ns, key, None)
        for key in ("host", "port", "redis_url", "data_dir", "api_workers", "worker_speed")
    }
    return load_settings(**overrides)


def _cmd_up(ns: argparse.Namespace, settings: Settings) -> int:
    from dispatcher.ops.supervisor import Supervisor, UpError

    if ns.workers != "auto" and not (ns.workers.isdigit() and int(ns.workers) >= 1):
        print("gpulane up: --workers takes a positive number or auto", file=sys.stderr)
        return EXIT_USAGE
    try:
        return Supervisor(settings, ns.workers, ns.backend).run()
    except (UpError, RuntimeError) as exc:
        print(f"gpulane up: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it is reachable from elsewhere
        return False


def _cmd_api(ns: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from dispatcher.api.app import create_app
    from dispatcher.api.guard import server_options

    if not settings.tenants and not _loopback(settings.host):
        log.warning(
            "serving on %s with no API keys: anyone who reaches this port can submit tasks",
            settings.host,
        )
    where: dict[str, Any] = (
        {"fd": ns.fd} if ns.fd is not None else {"host": settings.host, "port": settings.port}
    )
    common: dict[str, Any] = {
        "log_config": None,
        "access_log": False,
        "timeout_graceful_shutdown": 5,
        **server_options(settings),
    }
    if settings.api_workers == 1:
        uvicorn.run(create_app(settings), **where, **common)
        return EXIT_OK
    # Several processes share the socket; each builds its app from the environment, so
    # the flags given here must reach them there.
    os.environ.update(settings.environment("host", "port", "redis_url"))
    uvicorn.run(
        "dispatcher.api.app:app_from_environment",
        factory=True,
        workers=settings.api_workers,
        **where,
        **common,
    )
    return EXIT_OK


def _cmd_worker(ns: argparse.Namespace, settings: Settings) -> int:
    from worker.main import run_worker

    if ns.per_gpu is not None and ns.per_gpu < 1:
        print("gpulane worker: --per-gpu takes a positive number", file=sys.stderr)
        return EXIT_USAGE
    if ns.slots is not None and ns.slots < 1:
        print("gpulane worker: --slots takes a positive number", file=sys.stderr)
        return EXIT_USAGE
    if ns.backend:
        from worker.backend.main import run_backend_worker

        return run_backend_worker(
            settings, ns.backend, ns.slots, ns.api_key_env, ns.classes, ns.name
        )
    if ns.slots is not None or ns.api_key_env is not None:
        print("gpulane worker: --slots and --api-key-env go with --backend", file=sys.stderr)
        return EXIT_USAGE
    return run_worker(
        settings,
        gpu=ns.gpu,
        classes=ns.classes,
        tasks=ns.tasks,
        name=ns.name,
        per_gpu=ns.per_gpu,
    )


def _cmd_catalog(ns: argparse.Namespace, settings: Settings) -> int:
    from dispatcher.ops.catalog import publish_catalog

    return publish_catalog(settings, ns.tasks or settings.task_modules, ns.print_only)


def _api_url(ns: argparse.Namespace, settings: Settings) -> str:
    from dispatcher.ops.supervisor import read_up_file

    if ns.url:
        return str(ns.url)
    if settings.api_url:
        return settings.api_url
    running = read_up_file(settings.data_dir)
    return str(running["url"]) if running else f"http://{settings.host}:{settings.port}"


def _submit_inputs(ns: argparse.Namespace) -> tuple[dict[str, Any] | None, float | None]:
    """``--args`` and ``--timeout`` as the API takes them; ValueError (its message the
    one line to print) for what the API could never accept or the client never send:
    NaN and infinities are not JSON, a missing file is a usage mistake, not an outage."""
    if ns.file is None and ns.type is None:
        raise ValueError("give a FILE or --type")
    if ns.file is not None:
        try:
            with ns.file.open("rb"):
                pass
        except OSError as exc:
            raise ValueError(f"cannot read {ns.file}: {exc.strerror or exc}") from None
    args: dict[str, Any] | None = None
    if ns.args is not None:
        try:
            args = loads_finite(ns.args)
        except ValueError as exc:
            raise ValueError(f"--args is not valid JSON: {exc}") from None
        if not isinstance(args, dict):
            raise ValueError("--args must be a JSON object, e.g. '{\"seconds\": 1}'")
    timeout: float | None = None
    if ns.timeout is not None:
        try:
            timeout = float(ns.timeout)
        except ValueError:
            timeout = math.nan
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"--timeout takes a positive number of seconds, not {ns.timeout!r}")
    return args, timeout


def _cmd_submit(ns: argparse.Namespace, settings: Settings) -> int:
    from dispatcher.client import Client
    from dispatcher.ops.submit import submit_and_report

    try:
        args, timeout = _submit_inputs(ns)
    except ValueError as exc:
        print(f"gpulane submit: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with Client(_api_url(ns, settings), settings.api_key) as client:
            return submit_and_report(client, ns.file, ns.type, ns.cls, args, timeout, ns.wait)
    except KeyboardInterrupt:  # before the API answered (after it, submit_and_report says)
        print("gpulane submit: interrupted; the task may have been queued", file=sys.stderr)
        return EXIT_INTERRUPTED


def _cmd_status(ns: argparse.Namespace, settings: Settings) -> int:
    import httpx

    from dispatcher.client import Client, GpulaneError
    from dispatcher.ops.status import show_status

    url = _api_url(ns, settings)
    try:
        with Client(url, settings.api_key, max_retries=1) as client:
            show_status(client, ns.watch)
    except (httpx.HTTPError, GpulaneError) as exc:
        print(f"gpulane status: cannot read {url}: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        pass
    return EXIT_OK


_COMMANDS = {
    "up": _cmd_up,
    "api": _cmd_api,
    "worker": _cmd_worker,
    "catalog": _cmd_catalog,
    "submit": _cmd_submit,
    "status": _cmd_status,
}


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        settings = _settings(ns)
    except SettingsError as exc:
        print(f"gpulane {ns.command}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(settings.log_level, settings.log_format)
    return _COMMANDS[ns.command](ns, settings)


if __name__ == "__main__":
    sys.exit(main())
