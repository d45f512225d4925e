"""One backend task's run: forward the request to the server, relay its answer.

A streamed answer goes chunk by chunk into ``gpulane:stream:<id>`` (``stream.lua``,
fenced by attempt), where any API process reads it; the chunks a write is waiting
for go together in the next write, so a fast server costs one round trip per burst,
not per token. A whole answer is the task's result.

How a run ends (:class:`Outcome`):

- the answer, whole: ``finished`` (a stream's result is its usage and finish reason);
- the server unreachable or the connection broken before anything reached the
  client: ``release``, handed back at the head of its queue to run on another backend
  (the loop takes this worker out of claiming until its server answers again);
- after the first chunk, or when the server answered an error: ``failed``
  (``backend_error``, the server's status in the message), and a stream gets an
  ``error`` entry, so its reader ends instead of hanging;
- its timeout, its client's cancel, the worker's shutdown: ``timeout``, ``canceled``,
  or ``release`` / ``worker_lost`` as for a broken connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from dispatcher.contract.generation import Kind, StreamEntry, estimate_tokens
from dispatcher.contract.jobs import CallRefused, ErrorCode, decode_call
from dispatcher.contract.metrics import Recorder
from worker.backend.client import Backend, BackendDown, BackendError
from worker.backend.stream import Fenced, StreamWriter
from worker.execute import Outcome, RunEnd, canceled

__all__ = ["BackendArgs", "Relay", "Stop", "Usage"]

_HOLD_MAX = 8  # chunks held back waiting for the first token, at most

log = logging.getLogger("gpulane.worker")


class Stop(StrEnum):
    """Why the loop stopped a run from outside."""

    CANCEL = "cancel"  # its client canceled it
    BACKEND_DOWN = "backend_down"  # the health probe found the server gone
    HANDBACK = "handback"  # the worker is shutting down past its grace period


class BackendArgs(BaseModel):
    kind: Kind
    body: dict[str, Any]
    stream: bool = False


@dataclass
class Usage:
    """Tokens one run used; ``counted``: the server reported none, so gpulane counted
    the streamed chunks and estimated the prompt (:func:`estimate_tokens`)."""

    prompt: int = 0
    completion: int = 0
    counted: bool = False


@dataclass
class Relay:
    claimed: Any  # worker.claims.Claimed
    backend: Backend
    writer: StreamWriter
    recorder: Recorder
    label: str  # the backend, as the metrics name it
    stop: Stop | None = None
    sent: int = 0  # chunks written to the stream
    usage: Usage | None = None
    model: str = "-"
    kind: Kind | None = None
    streaming: bool = False
    started: float = field(default_factory=time.monotonic)

    # While True, a stop cancels the run's asyncio task: not before its first step (a
    # task canceled then never runs a line), nor once it returned (its task is
    # reporting the outcome then, which a cancel would cut short).
    running: bool = False

    async def run(self) -> Outcome:
        self.running = True
        try:
            return await self._run()
        finally:
            self.running = False

    async def _run(self) -> Outcome:
        if self.stop is not None:
            return await self._stopped()
        try:
            call = decode_call(self.claimed.data)
            args = BackendArgs.model_validate(call.args)
        except (CallRefused, ValidationError) as exc:
            return Outcome.fail(ErrorCode.INVALID_ARGS, f"Not a backend task: {str(exc)[:300]}")
        self.kind, self.model = args.kind, str(args.body.get("model", "-"))
        self.streaming = args.stream
        try:
            async with asyncio.timeout(max(self.claimed.timeout_s, 0.001)):
                if args.stream:
                    return await self._stream(args)
                return await self._whole(args)
        except TimeoutError:
            return await self._ended(
                ErrorCode.TIMEOUT, f"Ran past its timeout of {self.claimed.timeout_s:g} s."
            )
        except asyncio.CancelledError:
            return await self._stopped()
        except BackendDown as exc:
            if not self.sent:
                return Outcome(RunEnd.RELEASE)
            return await self._ended(
                ErrorCode.BACKEND_ERROR, f"The backend connection broke mid-stream: {exc}"
            )
        except BackendError as exc:
            error = {"code": ErrorCode.BACKEND_ERROR, "message": exc.message, "status": exc.status}
            return await self._ended(
                ErrorCode.BACKEND_ERROR, exc.message, Outcome(RunEnd.FAILED, error=error)
            )
        except Fenced:
            return Outcome(RunEnd.ABANDON)

    async def _whole(self, args: BackendArgs) -> Outcome:
        answer = await self.backend.call(args.kind, args.body)
        self._observe_done(1)
        usage = answer.get("usage")
        if isinstance(usage, dict):
            self.usage = Usage(
                _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))
            )
        return Outcome(RunEnd.FINISHED, result_json=orjson.dumps(answer).decode())

    async def _stream(self, args: BackendArgs) -> Outcome:
        if self.claimed.attempt > 1 and await self.writer.written_before():
            # An earlier attempt's chunks reached the client (its worker was lost): a
            # generation started again would append a second answer to the first.
            return await self._ended(
                ErrorCode.WORKER_LOST, "The stream was cut when its worker was lost; not restarted."
            )
        # Usage asked of every server: those that honour it (vLLM, SGLang, llama.cpp's
        # own server) send a last chunk with it; the API shows it only when asked.
        body = {**args.body, "stream": True, "stream_options": {"include_usage": True}}
        last = self.started
        pieces = 0
        reported: dict[str, Any] | None = None
        finish: Any = None
        # Chunks before the first token (the role's) wait for it: one write, one read at
        # the API and one send carry them together, the time to first token's path.
        held: list[bytes] = []
        async for chunk, raw in self.backend.stream(args.kind, body):
            now = time.monotonic()
            text = _has_text(chunk)
            if text:
                if pieces:
                    self.recorder.observe("tbt", now - last, self.label)
                else:
                    self.recorder.observe("ttft", now - self.started, self.label)
                pieces += 1
                last = now
            if isinstance(chunk.get("usage"), dict):
                reported = chunk["usage"]
            finish = _finish_reason(chunk) or finish
            held.append(raw)  # as the server wrote it
            if pieces or len(held) >= _HOLD_MAX:
                await self._put(held)
        await self._put(held)
        if reported is not None:
            self.usage = Usage(
                _int(reported.get("prompt_tokens")), _int(reported.get("completion_tokens"))
            )
        else:
            self.usage = Usage(estimate_tokens(args.kind, args.body), pieces, counted=True)
        self._observe_done(self.usage.completion)
        end = {"usage": self._usage_json(), "finish_reason": finish}
        await self.writer.put(StreamEntry.END, end)
        await self.writer.flush()
        result = orjson.dumps({"streamed": self.sent, **end}).decode()
        return Outcome(RunEnd.FINISHED, result_json=result)

    async def _put(self, chunks: list[bytes]) -> None:
        """Queue the held chunks for the stream (emptying ``chunks``)."""
        for raw in chunks:
            await self.writer.put_raw(StreamEntry.CHUNK, raw)
            self.sent += 1
        chunks.clear()

    def _usage_json(self) -> dict[str, Any]:
        u = self.usage or Usage()
        out: dict[str, Any] = {
            "prompt_tokens": u.prompt,
            "completion_tokens": u.completion,
            "total_tokens": u.prompt + u.completion,
        }
        if u.counted:
            out["estimated"] = True
        return out

    def _observe_done(self, completion: int) -> None:
        elapsed = time.monotonic() - self.started
        if completion > 0 and elapsed > 0:
            self.recorder.observe("tokens_per_s", completion / elapsed, self.label)

    async def _stopped(self) -> Outcome:
        if self.stop is Stop.CANCEL:
            return await self._ended("canceled", "Canceled while running.", canceled())
        if not self.sent:  # nothing reached the client: another backend runs it
            return Outcome(RunEnd.RELEASE)
        why = (
            "its backend stopped answering"
            if self.stop is Stop.BACKEND_DOWN
            else "its worker stopped"
        )
        code = ErrorCode.BACKEND_ERROR if self.stop is Stop.BACKEND_DOWN else ErrorCode.WORKER_LOST
        return await self._ended(code, f"The stream ended early: {why}.")

    async def _ended(self, code: str, message: str, outcome: Outcome | None = None) -> Outcome:
        """A failed run: its stream (when it has one) ends with an error entry."""
        outcome = outcome or Outcome.fail(code, message)
        if not self.streaming:
            return outcome
        try:
            await self.writer.put(StreamEntry.ERROR, outcome.error or {"code": code})
            await self.writer.flush()
        except Fenced:
            return Outcome(RunEnd.ABANDON)
        return outcome


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _has_text(chunk: dict[str, Any]) -> bool:
    """Whether a streamed chunk carries a token: its text (empty while a character's
    bytes are incomplete), as the servers stream one token a chunk. The role-only
    first chunk and the finish-only last one carry none."""
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("content"), str):
            return True
        if isinstance(choice.get("text"), str) and choice.get("finish_reason") is None:
            return True
    return False


def _finish_reason(chunk: dict[str, Any]) -> Any:
    for choice in chunk.get("choices") or []:
        if isinstance(choice, dict) and choice.get("finish_reason"):
            return choice["finish_reason"]
    return None
