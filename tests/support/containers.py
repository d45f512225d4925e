"""A gpulane stack in Docker containers, driven the way an operator drives it: the
``docker`` and ``docker compose`` CLIs against a real engine (tests/test_containers.py).

The image is built offline: the project's wheel and its dependencies go into
``.wheelhouse/`` on the host, built by an interpreter of the same version as the
image's (pip evaluates dependency markers such as ``python_full_version < "3.11.3"``
against the interpreter it runs in, not a target), and the Dockerfile installs them
with no package index.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from testkit import wait_for

__all__ = ["Stack", "build_image", "require_engine"]

REPO = Path(__file__).resolve().parents[2]
IMAGE = "gpulane:latest"
BASE_IMAGES = ("python:3.11-slim", "redis:7.2-alpine")  # what the files name
COMPOSE_FILES = ("compose.yaml", "compose.cpu.yaml")  # the README's CPU line
HOW = "run scripts/ensure-docker.sh (make test-slow does)"


def _run(*argv: str, timeout_s: float = 300, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout_s, check=False, env=env, cwd=REPO
    )
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done.stdout.strip()


def require_engine() -> None:
    """The engine answers, the Compose v2 plugin is there, and so are the base images."""
    assert shutil.which("docker"), f"no docker CLI: {HOW}"
    _run("docker", "info", "--format", "{{.ServerVersion}}")
    version = _run("docker", "compose", "version", "--short")
    assert version.lstrip("v").split(".")[0] == "2", f"Compose {version}, not v2: {HOW}"
    for image in BASE_IMAGES:
        _run("docker", "image", "inspect", "--format", "{{.Id}}", image)


def _interpreter_for(version: str) -> str:
    """A host Python of exactly ``version`` with pip (Debian's, beside the image's)."""
    for candidate in ("/usr/bin/python3", "python3.11", "python3"):
        path = shutil.which(candidate)
        if path is None:
            continue
        probe = subprocess.run(
            [path, "-c", "import platform, pip; print(platform.python_version())"],
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return path
    raise AssertionError(f"no host Python {version} with pip to build the image's wheels")


def build_image() -> None:
    """``gpulane:latest`` from the working tree, with no package index in the build."""
    version = _run(
        "docker",
        "run",
        "--rm",
        BASE_IMAGES[0],
        "python3",
        "-c",
        "import platform; print(platform.python_version())",
    )
    wheels = REPO / ".wheelhouse"
    shutil.rmtree(wheels, ignore_errors=True)
    # setuptools copies the package into build/lib and never deletes there: a module
    # renamed or removed since the last build would still go into the wheel.
    shutil.rmtree(REPO / "build", ignore_errors=True)
    _run(
        _interpreter_for(version),
        "-m",
        "pip",
        "wheel",
        "-q",
        "--wheel-dir",
        str(wheels),
        ".",
        timeout_s=600,
    )
    # The legacy builder: no buildx plugin needed, and no registry is asked for anything.
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    _run("docker", "build", "--quiet", "--tag", IMAGE, ".", timeout_s=600, env=env)


@dataclass
class Stack:
    """One Compose project on a published port of its own."""

    project: str
    port: int
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)

    def docker(self, *argv: str, timeout_s: float = 300) -> str:
        return _run("docker", *argv, timeout_s=timeout_s)

    def compose(self, *argv: str, timeout_s: float = 300) -> str:
        files = [arg for name in COMPOSE_FILES for arg in ("-f", name)]
        env = {**os.environ, "GPULANE_PORT": str(self.port)}
        return _run(
            "docker", "compose", "-p", self.project, *files, *argv, timeout_s=timeout_s, env=env
        )

    def up(self, workers: int) -> None:
        self.compose("up", "--detach", "--no-build", "--scale", f"worker={workers}")

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "10")

    def containers(self, service: str) -> list[str]:
        """The running containers of ``service``, by id."""
        return self.compose("ps", "--quiet", service).split()

    def container(self, service: str) -> str:
        [one] = self.containers(service)
        return one

    def hostname(self, container: str) -> str:
        return self.docker("inspect", "--format", "{{.Config.Hostname}}", container)

    def exec(self, container: str, *argv: str) -> str:
        return self.docker("exec", container, *argv)

    def record(self, task_id: str) -> dict[str, Any] | None:
        """The task's record, or None while the API does not answer (a restart)."""
        try:
            response = self.http.get(f"/tasks/{task_id}")
        except httpx.TransportError:
            return None
        record: dict[str, Any] | None = response.json() if response.status_code == 200 else None
        return record

    def wait_api(self, timeout_s: float = 120) -> None:
        def healthy() -> bool:
            try:
                return self.http.get("/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, timeout_s, what="the API container answering", interval_s=0.2)

    def wait_serving(self, workers: int, timeout_s: float = 120) -> None:
        """Registration is not readiness: wait for ``workers`` live, serving workers."""
        self.wait_api(timeout_s)

        def serving() -> bool:
            listed = self.http.get("/workers").json()["workers"]
            idle = [w for w in listed if w["state"] in {"idle", "busy"}]
            return len(listed) == workers and len(idle) == workers

        wait_for(serving, timeout_s, what=f"{workers} serving workers", interval_s=0.2)

    def resources(self) -> dict[str, list[str]]:
        """What the engine still holds of this project."""
        label = f"label=com.docker.compose.project={self.project}"
        return {
            kind: self.docker(
                kind[:-1],
                "ls",
                *(["--all"] if kind == "containers" else []),
                "--quiet",
                "--filter",
                label,
            ).split()
            for kind in ("containers", "volumes", "networks")
        }

    def save_logs(self) -> None:
        logs = REPO / ".test-logs"
        logs.mkdir(exist_ok=True)
        done = subprocess.run(
            ["docker", "compose", "-p", self.project, "logs", "--no-color"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=REPO,
        )
        (logs / f"{self.project}.log").write_text(done.stdout + done.stderr)
