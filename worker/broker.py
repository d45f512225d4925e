"""A worker's Redis operations, each one call of a Lua script (or one command).

The broker holds no state about tasks; the loop and the heartbeat own that. Redis
errors propagate: the loops that call these methods decide how to wait and retry.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from redis import Redis
from redis.exceptions import RedisError, ResponseError

from dispatcher import __version__
from dispatcher.contract import keys
from dispatcher.contract.connect import ReplicaLag
from dispatcher.contract.metrics import Drained
from dispatcher.contract.reap import Reaped, lease_options, parse_reaped, reap_options
from dispatcher.contract.scripts import ReleaseVerdict, SyncScripts, as_text, options
from dispatcher.contract.scripts import verdict as script_verdict
from dispatcher.contract.settings import FairCost, Settings
from dispatcher.contract.workers import RqCurrent, rq_worker_view
from worker.claims import (
    Beat,
    Claimed,
    Finished,
    Report,
    parse_claimed,
    parse_finished,
    parse_lease,
)

__all__ = ["Broker"]


_CLAIMS_KEPT = 64  # claim options remembered (they vary with the GPU memory free)
# Records one finish.lua call reports: a batch's (64 by default) in one call, a larger
# one in several, so that no call holds Redis, which runs one script at a time, for
# much longer than a batch of 64 takes (a few ms on a slow machine); and results one
# call carries past its first record's: Redis holds a command's arguments whole before
# it runs (a client's query buffer is capped at 1 GB, where it drops the connection),
# and 64 results of up to max_result_bytes each would be a gigabyte.
FINISH_PER_CALL = 64
FINISH_BYTES_PER_CALL = 8 * 1024 * 1024
# The reports a call carries, by index: (True: an answer for each, as finish.lua gives;
# False: one answer, split.lua's, for its one run).
Carried = tuple[bool, list[int]]


class Broker:
    def __init__(
        self,
        client: Redis,
        settings: Settings,
        name: str,
        classes: list[str],
        types: list[str] | None = None,
    ) -> None:
        self.client = client
        # A backend worker's routed types: it takes only those (claim.lua). None: an
        # in-process worker, which takes every type but the routed ones.
        self.types = types
        self.settings = settings
        self.name = name
        self.classes = classes  # served, in priority order
        self._scripts = SyncScripts(client)
        self._acks = settings.min_replica_acks
        self._ack_timeout_ms = max(1, int(settings.replica_ack_timeout_s * 1000))
        self._wake_key = keys.wake(name)
        self._aging = {
            cls: int(cfg.promote_after_s * 1000)
            for cls, cfg in settings.classes.items()
            if cfg.promote_after_s is not None and cls in classes
        }
        self._address: str | None = None  # as Redis sees this client, for RQ's registry
        # Doorbell order among parked workers: lower rings first (claim.lua's park score).
        self._rank = round(1000 / settings.worker_speed)
        self._by_time = settings.fair_share_by == FairCost.DEVICE_TIME
        self._claims: dict[tuple[Any, ...], str] = {}  # claim options by their arguments

    def _rq_view(self, info: dict[str, str], current: RqCurrent | None) -> dict[str, Any]:
        """The worker as RQ's worker registry shows it (``rq info``, rq-dashboard)."""
        if self._address is None:
            try:  # as RQ's own workers find theirs; CLIENT INFO needs Redis 6.2
                self._address = str(self.client.client_info()["addr"])
            except ResponseError:
                self._address = "unknown"
        return rq_worker_view(info, self.classes, current, self._address, f"gpulane {__version__}")

    def _run_acked(self, name: str, opts: str, *payload: bytes | str) -> Any:
        """One script that must survive a failover (a claim, a release): its reply, or
        the error Redis gave it; see :meth:`_run_all_acked`."""
        reply = self._run_all_acked([(name, (opts, *payload))])[0]
        if isinstance(reply, RedisError):
            raise reply
        return reply

    def _run_all_acked(self, calls: Sequence[tuple[str, Sequence[bytes | str]]]) -> list[Any]:
        """Scripts in one round trip, each atomic on its own (a refused one is its error
        in the list). With ``min_replica_acks`` they count only once that many replicas
        hold them: one WAIT after them all, and :class:`ReplicaLag` (an outage: the
        loop retries; claims with ``redeliver``, reports as they are) carrying the
        replies when fewer confirmed in time or the WAIT failed."""
        wait = (self._acks, self._ack_timeout_ms) if self._acks else None
        replies = self._scripts.run_many(calls, wait)
        if wait is None:
            return replies
        acks = replies.pop()
        if isinstance(acks, RedisError) or int(acks) < self._acks:
            names = ",".join(sorted({name for name, _ in calls}))
            why = f"{names}: {acks} of {self._acks} replicas confirmed it in time"
            raise ReplicaLag(why, replies)
        return replies

    def _lease_opts(self) -> dict[str, Any]:
        return {**lease_options(self.settings), "worker": self.name}

    def register(self, info: dict[str, str], catalog: dict[str, Any]) -> list[Reaped] | None:
        """Publish the worker; None if a live worker holds the name. Returns what an
        earlier process of this name left in flight and was given back."""
        opts = options(
            **self._lease_opts(),
            info=info,
            catalog={name: json.dumps(entry) for name, entry in catalog.items()},
            rq=self._rq_view(info, None),
        )
        reply = self._scripts.run("register", opts)
        if as_text(reply[0]) == "name_in_use":
            return None
        return parse_reaped(reply[1])

    def claim(
        self,
        was_idle: bool,
        device_json: str,
        redeliver: bool = False,
        batch: dict[str, int] | None = None,
        mem_mb: int | None = None,
        running: dict[str, int] | None = None,
    ) -> list[Claimed]:
        """The next task (or, for a type in ``batch`` {type: max size}, the next batch),
        moved into this worker's in-flight list; empty when there is none (the worker
        is parked). ``redeliver`` after a claim whose reply was lost returns what that
        claim took (every task it holds but the attempts in ``running``, {id: attempt},
        which it runs already). ``mem_mb``: GPU memory free for a task (None: no limit);
        tasks that need more are left for other workers."""
        opts = self.claim_options(was_idle, device_json, redeliver, batch, mem_mb, running)
        reply = self._run_acked("claim", opts)
        return [self._claimed(task) for task in reply or []]

    def claim_options(
        self,
        was_idle: bool,
        device_json: str,
        redeliver: bool = False,
        batch: dict[str, int] | None = None,
        mem_mb: int | None = None,
        running: dict[str, int] | None = None,
    ) -> str:
        """:meth:`claim`'s script options, for a claim sent with the last report.

        Remembered by their arguments: a busy worker sends the same claim with every
        report, and encoding it was a fortieth of its CPU per no-op task."""
        types = None if self.types is None else tuple(self.types)  # a backend's, set late
        runs = tuple((running or {}).items()) if redeliver else ()
        key = (was_idle, device_json, redeliver, mem_mb, tuple((batch or {}).items()), types, runs)
        opts = self._claims.get(key)
        if opts is None:
            if len(self._claims) >= _CLAIMS_KEPT:  # free GPU memory moves: start over
                self._claims.clear()
            opts = self._claims[key] = self._claim_options(
                device_json,
                mem_mb,
                was_idle=was_idle,
                redeliver=redeliver,
                batch=batch or {},
                rank=self._rank,
                **({"running": dict(runs)} if runs else {}),
            )
        return opts

    def claim_more(
        self, cls: str, task_type: str, n: int, device_json: str, mem_mb: int | None = None
    ) -> tuple[bool, list[Claimed]]:
        """More queued tasks of ``task_type``, up to ``n`` items, from the head of ``cls``
        for a short batch. Returns (stop waiting: a higher class has work or another type
        heads the queue, the tasks taken)."""
        more = {"class": cls, "type": task_type, "n": n}
        opts = self._claim_options(device_json, mem_mb, more=more)
        reply = self._run_acked("claim", opts)
        return bool(int(reply[0])), [self._claimed(task) for task in reply[1:]]

    def _claim_options(self, device_json: str, mem_mb: int | None, **extra: Any) -> str:
        """claim.lua's options: this worker, its classes and aging, its device and the
        GPU memory it has free (absent: no limit), plus what the call adds."""
        return options(
            worker=self.name,
            classes=self.classes,
            aging=self._aging,
            device=device_json,
            **({} if mem_mb is None else {"mem": mem_mb}),
            **({} if self.types is None else {"types": self.types}),
            fair_time=self._by_time,
            **extra,
        )

    def _claimed(self, reply: list[Any]) -> Claimed:
        return parse_claimed(reply, self.settings.class_timeout_s)

    def unpark(self) -> None:
        """Stop being woken for work, passing on a doorbell taken on the way out."""
        types = {} if self.types is None else {"types": self.types}
        opts = options(worker=self.name, classes=self.settings.class_names, **types)
        self._scripts.run("unpark", opts)

    def wait_for_work(self, timeout_s: float) -> bool:
        """Block until a submit rings this worker's doorbell; False on timeout."""
        return self.client.blpop([self._wake_key], timeout=timeout_s) is not None

    def finish(
        self,
        task: Claimed,
        status: str,
        result_json: str = "",
        error: dict[str, Any] | None = None,
        progress: dict[str, Any] | None = None,
    ) -> Finished:
        """Record the outcome; returns ('ok', ended_ms), or ('duplicate' | 'gone' |
        'fenced', None)."""
        reply = self.finish_many([Report(task, status, result_json, error, progress)])[0]
        if isinstance(reply, RedisError):
            raise reply
        return reply

    def finish_and_claim(
        self, reports: Sequence[Report], claim_opts: str
    ) -> tuple[list[Finished | RedisError], list[Claimed] | RedisError]:
        """:meth:`finish_many`, then the next claim (:meth:`claim_options`) in the same
        round trip: a busy worker spends one round trip per task, not two. The claim's
        reply is its own: an error there (or too few replica acks, raised as
        :class:`ReplicaLag` for the reports) means the claim may have run, to be asked
        again with ``redeliver``."""
        finished, claimed = self._finish(reports, claim_opts)
        assert claimed is not None  # a claim went
        return finished, claimed

    def finish_many(self, reports: Sequence[Report]) -> list[Finished | RedisError]:
        """Record several outcomes (a batch's) in one round trip, in one finish.lua call
        per :data:`FINISH_PER_CALL` records (a split has its own split.lua call), each
        record on its own: a report Redis refused (its call refused whole, or its own
        error) is its exception in the list. With ``min_replica_acks`` one WAIT covers
        them all, and too few acks raise :class:`ReplicaLag` with the replies, for the
        whole set (sent again whole: finish.lua answers 'duplicate' to an outcome it
        already holds)."""
        return self._finish(reports, None)[0]

    def _finish(
        self, reports: Sequence[Report], claim_opts: str | None
    ) -> tuple[list[Finished | RedisError], list[Claimed] | RedisError | None]:
        """The reports' answers and, with ``claim_opts``, the claim's (None without)."""
        calls, carried = self._report_calls(reports)
        if claim_opts is not None:
            calls.append(("claim", (claim_opts,)))
        n = len(carried)
        try:
            replies = self._run_all_acked(calls)
        except ReplicaLag as exc:
            raise ReplicaLag(str(exc), _spread(exc.replies[:n], carried, len(reports))) from None
        finished = _spread(replies[:n], carried, len(reports))
        if claim_opts is None:
            return finished, None
        claimed = replies[n]
        if isinstance(claimed, RedisError):
            return finished, claimed
        return finished, [self._claimed(task) for task in claimed or []]

    def _report_calls(
        self, reports: Sequence[Report]
    ) -> tuple[list[tuple[str, Sequence[bytes | str]]], list[Carried]]:
        """The scripts that record ``reports``, and which reports each call carries:
        finish.lua for up to :data:`FINISH_PER_CALL` records (and
        :data:`FINISH_BYTES_PER_CALL` of results) at a time, split.lua for each split."""
        calls: list[tuple[str, Sequence[bytes | str]]] = []
        carried: list[Carried] = []
        plain = [k for k, report in enumerate(reports) if report.split is None]
        for group in _groups(plain, [len(reports[k].result_json) for k in plain]):
            opts = "[" + ",".join(self._finish_options(reports[k]) for k in group) + "]"
            calls.append(("finish", (opts, *(reports[k].result_json for k in group))))
            carried.append((True, group))
        for k, report in enumerate(reports):
            if report.split is not None:
                calls.append(("split", self._split_argv(report)))
                carried.append((False, [k]))
        return calls, carried

    def _split_argv(self, report: Report) -> tuple[bytes | str, ...]:
        """split.lua's arguments for a run that split into parts."""
        split = report.split
        assert split is not None
        task = report.claimed
        opts = options(
            id=task.task_id,
            worker=self.name,
            **{"class": task.cls},
            attempt=task.attempt,
            classes=self.settings.class_names,
            ttl_s=self.settings.result_ttl_s,
            type=split.task_type,
            gpu_mb=split.gpu_memory_mb,
            merge=split.into,
            flatten=split.flatten,
            first=split.first,
            result=json.dumps(split.result, separators=(",", ":")),
            file=split.file,
            **({"labels": list(split.labels)} if split.labels is not None else {}),
        )
        return (opts, *split.calls)

    def live_workers(self, cls: str) -> int:
        """Workers registered as serving ``cls`` (RQ's per-queue index, kept by their
        heartbeats): what a task sizes its parts by."""
        return int(self.client.scard(keys.rq_workers_of(cls)))

    def _finish_options(self, report: Report) -> str:
        task = report.claimed
        return options(
            id=task.task_id,
            worker=self.name,
            **{"class": task.cls},
            attempt=task.attempt,
            status=report.status,
            error=json.dumps(report.error) if report.error else "",
            progress=json.dumps(report.progress) if report.progress else "",
            ttl_s=self.settings.result_ttl_s,
            # Fair share settles a laned task's charge with it (device_time mode only).
            **({"device_us": round(report.device_s * 1e6)} if self._by_time else {}),
            **({"entries": report.entries} if task.parent else {}),
        )

    def release(
        self, task: Claimed, at_head: bool = True, fault: dict[str, Any] | None = None
    ) -> ReleaseVerdict:
        """Give the task back (head: shutdown; tail: retry) without counting a loss; with
        a ``fault`` ({code, message}) as a lost attempt, which may fail the task."""
        opts = options(
            **self._lease_opts(),
            id=task.task_id,
            attempt=task.attempt,
            at_head=at_head,
            **({"fault": fault} if fault else {}),
            **{"class": task.cls},
        )
        released: ReleaseVerdict = script_verdict(self._run_acked("release", opts), ReleaseVerdict)
        return released

    # GPU claims (gpu_lease.lua): slots are (uuid, slot number) pairs.

    def _gpu_options(self, op: str, slots: list[tuple[str, int]]) -> str:
        return options(
            op=op,
            worker=self.name,
            ttl_ms=int(self.settings.lease_ttl_s * 1000),
            slots=[list(slot) for slot in slots],
        )

    def _gpu(self, op: str, slots: list[tuple[str, int]]) -> Any:
        return self._scripts.run("gpu_lease", self._gpu_options(op, slots))

    def gpu_take(self, slots: list[tuple[str, int]]) -> tuple[int | None, list[str]]:
        """Claim the first free slot: (its index in ``slots``, []) or (None, holders)."""
        reply = self._gpu("take", slots)
        if int(reply[0]) > 0:
            return int(reply[0]) - 1, []
        return None, [as_text(holder) for holder in reply[1:]]

    def gpu_release(self, slot: tuple[str, int]) -> bool:
        return bool(self._gpu("release", [slot]))

    def stream_options(self, task: Claimed) -> str:
        """stream.lua's options for this run of ``task`` (its fencing, the stream's TTL):
        the backend worker sends it on its asyncio client (worker/backend/stream.py)."""
        return options(
            id=task.task_id,
            worker=self.name,
            attempt=task.attempt,
            ttl_ms=int(self.settings.stream_ttl_s * 1000),
        )

    def stream_length(self, task: Claimed) -> int:
        """Entries the task's stream holds (written by earlier attempts, for a re-run)."""
        return int(self.client.xlen(keys.stream(task.task_id)))

    def settle_tokens(self, task: Claimed, used: int) -> int:
        """Give back what the task's tpm charge held beyond the tokens it used."""
        return int(self._scripts.run("tokens", options(op="settle", id=task.task_id, used=used)))

    def progress(self, task: Claimed, fraction: float, message: str) -> bool:
        """Publish a running task's progress and tell the API's waiters (progress.lua);
        False when fenced (a later attempt owns the task)."""
        fraction = round(fraction, 4)
        opts = options(id=task.task_id, worker=self.name, attempt=task.attempt, fraction=fraction)
        value = json.dumps({"fraction": fraction, "message": message})
        return bool(self._scripts.run("progress", opts, value))

    def beat(
        self,
        info: dict[str, str],
        current: RqCurrent | None,
        drained: Drained,
        tau_s: float,
        task: Claimed | None = None,
        gpu_slot: tuple[str, int] | None = None,
        seq: str = "",
        ack: Sequence[str] = (),
    ) -> Beat:
        """One heartbeat in one round trip: a reaper pass, then renew the lease and
        publish the worker (``current``: the task it runs, for RQ's registry) and flush
        metrics, then renew the GPU claim. Each script stands alone: a refused one (Redis
        full refuses the reaper, which may write) is its error in the :class:`Beat`.
        ``seq`` names the beat (sent again after a lost reply, with the same ``drained``
        and ``ack``, it folds nothing twice; '' folds always); ``ack``: the cancels the
        last answered beat returned, which leave the control list now."""
        running = {"task": {"id": task.task_id, "attempt": task.attempt}} if task else {}
        beat = options(
            **running,
            seq=seq,
            ack=list(ack),
            worker=self.name,
            ttl_ms=int(self.settings.lease_ttl_s * 1000),
            tau_s=tau_s,
            info=info,
            rq=self._rq_view(info, current),
            counters=drained.counters,
            floats=drained.floats,
            runs=drained.runs,
            usage=drained.usage,
            usage_ttl_s=self.settings.usage_retention_s,
        )
        calls = [("reap", [reap_options(self.settings)]), ("heartbeat", [beat])]
        if gpu_slot is not None:
            calls.append(("gpu_lease", [self._gpu_options("renew", [gpu_slot])]))
        reap, heartbeat, *gpu = self._scripts.run_many(calls)
        return Beat(
            reaped=reap if isinstance(reap, RedisError) else parse_reaped(reap),
            lease=heartbeat if isinstance(heartbeat, RedisError) else parse_lease(heartbeat),
            gpu=(gpu[0] if isinstance(gpu[0], RedisError) else as_text(gpu[0])) if gpu else None,
        )

    def unregister(self) -> list[Reaped]:
        return parse_reaped(self._scripts.run("unregister", options(**self._lease_opts())))


def _groups(indexes: list[int], sizes: list[int]) -> list[list[int]]:
    """``indexes`` in order, cut into finish.lua calls: a call ends at
    :data:`FINISH_PER_CALL` records, or before a result that would take it past
    :data:`FINISH_BYTES_PER_CALL` (a larger result goes in a call of its own)."""
    groups: list[list[int]] = []
    group: list[int] = []
    carried = 0
    for k, size in zip(indexes, sizes, strict=True):
        if group and (len(group) == FINISH_PER_CALL or carried + size > FINISH_BYTES_PER_CALL):
            groups.append(group)
            group, carried = [], 0
        group.append(k)
        carried += size
    if group:
        groups.append(group)
    return groups


def _spread(replies: Sequence[Any], carried: list[Carried], n: int) -> list[Finished | RedisError]:
    """Each of ``n`` reports' answer, from the replies of the calls that carried them:
    a finish.lua call answers for each of its records; a call Redis refused whole (or
    that never ran) answers with its error for each."""
    out: dict[int, Finished | RedisError] = {}
    for reply, (each, group) in zip(replies, carried, strict=True):
        if isinstance(reply, RedisError):
            for k in group:
                out[k] = reply
        elif each:  # finish.lua: an answer per record
            for k, one in zip(group, reply, strict=True):
                out[k] = parse_finished(one)
        else:  # split.lua: one run's
            out[group[0]] = parse_finished(reply)
    return [out[k] for k in range(n)]
