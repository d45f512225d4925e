"""compose.yaml holds the settings the README promises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return data


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


def test_dockerfile_installs_the_package() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "pip install ." in text and "USER gpulane" in text
