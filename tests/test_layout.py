"""The layout keeps its promises: workers never load the API, the shared contract never
loads FastAPI, the sync and async clients offer the same methods, and docs/design.md's
module map names every module."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys

import pytest

from dispatcher.client import AsyncClient, Client
from testkit import REPO


def _modules_after(statement: str) -> set[str]:
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_worker_main_loads_no_api_module() -> None:
    loaded = _modules_after("import worker.main")
    assert "worker.main" in loaded  # the probe really imported it
    assert not {m for m in loaded if m.startswith("dispatcher.api")}
    assert "fastapi" not in loaded


def test_api_and_catalog_publisher_load_no_task_code() -> None:
    # The configured catalog comes from a subprocess (python -m worker.describe).
    loaded = _modules_after("import dispatcher.api.app, dispatcher.ops.catalog")
    assert "dispatcher.api.task_types" in loaded
    assert not {m for m in loaded if m.split(".")[0] == "worker"}


def test_worker_loads_no_cuda_library_before_pinning() -> None:
    # Task modules (which may import torch) load only after the device is pinned;
    # the worker's own code, GPU modules included, never imports a CUDA library.
    modules = ("worker.main", "worker.gpu.devices", "worker.gpu.claim", "worker.gpu.health")
    loaded = _modules_after("\n".join(f"import {m}" for m in (*modules, "worker.gpu.sampler")))
    assert set(modules) <= loaded
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "cupy", "tensorflow", "jax")}


@pytest.mark.parametrize(
    "module",
    [
        "dispatcher.contract.keys",
        "dispatcher.contract.jobs",
        "dispatcher.contract.scripts",
        "dispatcher.contract.settings",
        "dispatcher.contract.metrics",
        "dispatcher.contract.workers",
        "dispatcher.contract.reap",
        "dispatcher.contract.exits",
        "dispatcher.contract.backoff",
        "dispatcher.contract.logs",
    ],
)
def test_contract_loads_no_web_framework(module: str) -> None:
    loaded = _modules_after(f"import {module}")
    assert module in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("fastapi", "starlette", "uvicorn")}


def _public(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def test_sync_and_async_clients_stay_in_step() -> None:
    sync, async_ = _public(Client), _public(AsyncClient)
    # close()/aclose() differ by name only, as httpx's do.
    sync.pop("close")
    async_.pop("aclose")
    assert sorted(sync) == sorted(async_)
    for name, signature in sync.items():
        assert str(signature) == str(async_[name]), name
        assert inspect.iscoroutinefunction(getattr(AsyncClient, name)), name


def _module_map() -> set[str]:
    """The modules docs/design.md's module map names, as paths (its tree: a name ending
    in / opens a folder at its indentation, a .py name is a module of the folders
    open above it; text further right is the description)."""
    doc = (REPO / "docs" / "design.md").read_text()
    block = doc[doc.index("### Module layout") : doc.index("Dependency rules")]
    block = block[block.index("```") + 3 :]
    block = block[: block.index("```")]
    named: set[str] = set()
    folders: list[tuple[int, str]] = []
    for line in block.splitlines():
        match = re.match(r"^(\s*)(\S+)", line)
        if match is None or len(match.group(1)) >= 17:  # a description's next line
            continue
        indent, name = len(match.group(1)), match.group(2)
        while folders and folders[-1][0] >= indent:
            folders.pop()
        if name.endswith("/"):
            folders.append((indent, name))
        elif name.endswith(".py"):
            named.add("".join(folder for _, folder in folders) + name)
    return named


def test_the_module_map_names_every_module() -> None:
    modules = {
        path.relative_to(REPO).as_posix()
        for top in ("dispatcher", "worker")
        for path in (REPO / top).rglob("*.py")
        if path.name != "__init__.py"
    }
    named = _module_map()
    assert modules - named == set(), "modules missing from docs/design.md's module map"
    assert named - modules - {"gpulane.py"} == set(), "the map names modules that are gone"
