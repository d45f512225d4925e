"""compose.yaml and the CPU overlay compose.cpu.yaml hold what the README promises.

The overlay is checked as Compose applies it: with `docker compose config` where the
Compose plugin is installed (it needs no engine), else with the subset of Compose's
merge rules these files use, done here (mappings merge key by key, a sequence or
scalar replaces, `!reset` removes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESET = object()  # what `!reset` loads as


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)
_ComposeLoader.add_constructor(
    "!override",
    lambda loader, node: (
        loader.construct_object(node, deep=True)  # type: ignore[no-untyped-call]
        if not isinstance(node, yaml.MappingNode)
        else loader.construct_mapping(node, deep=True)
    ),
)


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.load(
        (ROOT / name).read_text(), Loader=_ComposeLoader
    )  # a SafeLoader
    return data


def _compose() -> dict[str, Any]:
    return _load("compose.yaml")


def merge(base: Any, overlay: Any) -> Any:
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = dict(base)
        for key, value in overlay.items():
            if value is RESET:
                out.pop(key, None)
            else:
                out[key] = merge(base.get(key), value)
        return out
    return overlay


def _merged_in_python() -> dict[str, Any]:
    merged: dict[str, Any] = merge(_compose(), _load("compose.cpu.yaml"))
    return merged


def test_services() -> None:
    services = _compose()["services"]
    assert {"redis", "api", "worker"} <= set(services)


def test_redis_is_durable_private_and_checked() -> None:
    redis = _compose()["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command
    assert "--maxmemory-policy noeviction" in command
    assert "healthcheck" in redis and "ping" in " ".join(redis["healthcheck"]["test"])
    assert any(":/data" in volume for volume in redis["volumes"])
    assert "ports" not in redis  # not published on the host
    # Said in the file, not left to an image's entrypoint: only the stack's network sees it.
    assert "--protected-mode no" in command


def test_api_and_worker() -> None:
    services = _compose()["services"]
    assert services["api"]["command"][:2] == ["gpulane", "api"]
    assert any(p.endswith(":8000") for p in services["api"]["ports"])
    worker = services["worker"]
    assert worker["command"][:2] == ["gpulane", "worker"]
    assert "ports" not in worker and "container_name" not in worker  # scalable
    for name in ("api", "worker"):
        assert services[name]["environment"]["GPULANE_REDIS_URL"].startswith("redis://redis:")
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_a_backend_worker_is_opt_in_and_needs_no_gpu() -> None:
    backend = _compose()["services"]["backend"]
    assert backend["profiles"] == ["backend"]  # `docker compose up` alone does not start it
    assert backend["command"][:3] == ["gpulane", "worker", "--backend"]
    assert backend["command"][3].startswith("${GPULANE_BACKEND_URL:-http")
    assert backend["environment"]["GPULANE_REDIS_URL"].startswith("redis://redis:")
    assert _gpu_reservations(backend) == []


def _gpu_reservations(worker: dict[str, Any]) -> list[dict[str, Any]]:
    reservations = worker.get("deploy", {}).get("resources", {}).get("reservations", {})
    return list(reservations.get("devices") or [])


def test_workers_get_every_gpu_and_claim_one_each() -> None:
    worker = _compose()["services"]["worker"]
    assert worker["command"] == ["gpulane", "worker", "--gpu", "auto"]
    [gpus] = _gpu_reservations(worker)
    assert gpus["driver"] == "nvidia"
    assert gpus["count"] == "all"  # each replica claims its own card through Redis
    assert "gpu" in gpus["capabilities"]
    assert "utility" in worker["environment"]["NVIDIA_DRIVER_CAPABILITIES"]  # NVML


def test_cpu_overlay_runs_the_same_stack_without_gpus() -> None:
    overlay = _load("compose.cpu.yaml")
    assert set(overlay["services"]) == {"worker"}  # only the worker changes
    merged = _merged_in_python()
    assert set(merged["services"]) == set(_compose()["services"])
    worker = merged["services"]["worker"]
    assert worker["command"] == ["gpulane", "worker", "--gpu", "none"]
    assert _gpu_reservations(worker) == []
    assert worker["environment"] == _compose()["services"]["worker"]["environment"]
    assert worker["restart"] == "unless-stopped" and worker["stop_grace_period"] == "40s"


def test_dockerfile_installs_the_package() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "pip install ." in text and "USER gpulane" in text
    assert "--no-index --find-links /tmp/wheels" in text  # the offline build's branch
    # The build context is the package (and its wheels), never the venvs beside it.
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    rules = [line for line in lines if line and not line.startswith("#")]
    assert rules[0] == "*" and {"!dispatcher", "!worker", "!.wheelhouse"} <= set(rules)
