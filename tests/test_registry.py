"""The task registry and the fixed entry point."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from dispatcher.contract.jobs import ENTRY_POINT, decode_call, encode_call
from gpulane import run
from worker.batching import BatchRunner
from worker.claims import Claimed
from worker.entry import run as legacy_run
from worker.execute import Interrupts, Outcome, Runner
from worker.registry import Batch, Registry


class Args(BaseModel):
    n: int


def _run(reg: Registry, task_type: str, args: dict[str, Any]) -> Outcome:
    """One task through the worker's one run path (a batch of one)."""
    runner = Runner(reg, Interrupts(), lambda *_: None, {}, "w", 1 << 20)
    claimed = Claimed("t1", "batch", encode_call(task_type, args), 1, 30.0, None, 0, None)
    (item,) = BatchRunner(runner).run([claimed])
    assert item.outcome is not None
    return item.outcome


def test_register_and_run() -> None:
    reg = Registry()

    @reg.task("math.double", description="Twice n.")
    def double(args: Args, ctx: Any) -> int:
        return args.n * 2

    assert reg.names() == ["math.double"]
    entry = reg.catalog()["math.double"]
    assert entry["description"] == "Twice n." and entry["file"] == "none"
    assert entry["schema"]["properties"]["n"]["type"] == "integer"
    outcome = _run(reg, "math.double", {"n": 21})
    assert outcome.status == "finished" and outcome.result_json == "42"


def test_invalid_args_and_unknown_type() -> None:
    reg = Registry()
    reg.task("math.double")(lambda args, ctx: args.n)  # no model: takes no arguments
    assert (_run(reg, "math.triple", {}).error or {})["code"] == "unknown_task_type"
    assert (_run(reg, "math.double", {"n": 1}).error or {})["code"] == "invalid_args"


def test_file_required() -> None:
    reg = Registry()
    reg.task("doc.read", file="required")(lambda args, ctx: None)
    error = _run(reg, "doc.read", {}).error or {}
    assert error["code"] == "invalid_args" and "needs an uploaded file" in error["message"]


def test_the_entry_point_refuses_a_plain_rq_worker() -> None:
    """RQ's worker would import and call the job's entry (gpulane.run, or an older job's
    worker.entry.run): a clear failure, not a task run without a gpulane worker's checks."""
    for entry in (run, legacy_run):
        with pytest.raises(RuntimeError, match="must run in a gpulane worker"):
            entry("math.double", {"n": 1})


def test_jobs_name_the_stable_tag_and_older_jobs_still_decode() -> None:
    import json
    import zlib

    assert ENTRY_POINT == "gpulane.run"  # a name of its own, not a module path
    assert json.loads(zlib.decompress(encode_call("echo", {"x": 1})))[0] == "gpulane.run"
    old = zlib.compress(json.dumps(["worker.entry.run", None, ["echo", {"x": 1}], {}]).encode())
    call = decode_call(old)
    assert (call.task_type, call.args) == ("echo", {"x": 1})


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
