"""The one way a request is admitted, for every route that submits (``POST /tasks``,
bulk or not, ``/v1/embeddings``, the generation routes): the class's state from the
pool snapshot the maintenance loop keeps, the submit script's verdict, and, before a
``no_workers`` refusal, one more look with a fresh snapshot (the cached one may
predate a worker, or a bigger card, that just registered: only refusals pay for it).
What was accepted or refused is counted here, once; a refusal is raised."""

from __future__ import annotations

from dispatcher.api.deps import Services
from dispatcher.api.refusals import REFUSED, refusal
from dispatcher.api.store import Record, Submission, SubmitResult

__all__ = ["admit"]


async def admit(svc: Services, sub: Submission, records: list[Record]) -> SubmitResult:
    """Submit ``records`` (one task's, a bulk's, a request's chunks) for ``sub``'s
    tenant in its class, admitted whole or refused whole: the 429/503 is raised; an
    accepted request, a replay or a reused Idempotency-Key comes back (its answer's
    signals, pressure and Retry-After, are the script's: ``SubmitResult``)."""
    state = (await svc.pool.cached()).admitting(sub.cls, sub.task_type, sub.routed)
    result = await svc.store.submit_records(sub, records, state)
    if result.verdict == "no_workers":
        fresh = await svc.pool.snapshot()
        state = fresh.admitting(sub.cls, sub.task_type, sub.routed)
        result = await svc.store.submit_records(sub, records, state)
    items = sum(r.items for r in records)
    if result.verdict == "accepted":
        svc.recorder.count("submitted", sub.cls, sub.task_type, n=items)
    elif result.verdict in REFUSED:
        svc.recorder.count("rejected", sub.cls, result.verdict)
        raise refusal(result, state, sub)
    return result
