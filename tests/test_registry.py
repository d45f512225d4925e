"""The task registry and the fixed entry point."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from worker.entry import run
from worker.registry import Batch, Registry, TaskFailure


class Args(BaseModel):
    n: int


class Ctx:
    file = None


def test_register_and_run() -> None:
    reg = Registry()

    @reg.task("math.double", description="Twice n.")
    def double(args: Args, ctx: Any) -> int:
        return args.n * 2

    assert reg.names() == ["math.double"]
    entry = reg.catalog()["math.double"]
    assert entry["description"] == "Twice n." and entry["file"] == "none"
    assert entry["schema"]["properties"]["n"]["type"] == "integer"
    assert run("math.double", {"n": 21}, ctx=Ctx(), registry=reg) == 42  # type: ignore[arg-type]


def test_invalid_args_and_unknown_type() -> None:
    reg = Registry()
    reg.task("math.double")(lambda args, ctx: args.n)  # no model: takes no arguments
    with pytest.raises(TaskFailure) as unknown:
        run("math.triple", {}, ctx=Ctx(), registry=reg)  # type: ignore[arg-type]
    assert unknown.value.code == "unknown_task_type"
    with pytest.raises(TaskFailure) as invalid:
        run("math.double", {"n": 1}, ctx=Ctx(), registry=reg)  # type: ignore[arg-type]
    assert invalid.value.code == "invalid_args"


def test_file_required() -> None:
    reg = Registry()
    reg.task("doc.read", file="required")(lambda args, ctx: None)
    with pytest.raises(TaskFailure, match="needs an uploaded file"):
        run("doc.read", {}, ctx=Ctx(), registry=reg)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", "Echo", "a..b", "1x", "x" * 65, "shell exec"])
def test_bad_names(name: str) -> None:
    with pytest.raises(ValueError, match="task name"):
        Registry().task(name)


def test_duplicate_and_non_model_argument() -> None:
    reg = Registry()
    reg.task("a")(lambda args, ctx: None)
    with pytest.raises(ValueError, match="twice"):
        reg.task("a")(lambda args, ctx: None)

    def handler(args: dict, ctx: Any) -> None:  # type: ignore[type-arg]
        return None

    with pytest.raises(TypeError, match="pydantic model"):
        reg.task("b")(handler)


def test_batched_model_task_declaration() -> None:
    reg = Registry()
    loads: list[str] = []

    @reg.task("emb.one", model="org/model", load=loads.append, batch=Batch(8, 2))
    def one(batch: list[Args], ctxs: list[Any]) -> list[int]:
        return [a.n for a in batch]

    reg.task("emb.two", model="org/model", load=loads.append, batch=Batch(8, 2))(one)
    entry = reg.catalog()["emb.one"]
    assert entry["model"] == "org/model"
    assert entry["schema"]["properties"]["n"]["type"] == "integer"  # the item's model
    assert "model" not in Registry().catalog()  # plain types publish none
    assert list(reg.loaders()) == ["org/model"]  # one loader, run once
    with pytest.raises(TypeError, match="list"):
        reg.task("emb.bad", batch=Batch())(lambda args, ctx: args)
    with pytest.raises(ValueError, match="max_size"):
        Batch(max_size=0)
