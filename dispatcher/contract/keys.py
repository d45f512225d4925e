"""Every Redis key gpulane reads or writes, built here and nowhere else.

Layout (one Redis database; Redis Cluster is not supported because scripts touch keys
they discover, such as a dead worker's in-flight lists):

RQ's own keys (kept in RQ's format so ``rq info``, rq-dashboard and KEDA see the queues)::

    rq:queue:<class>                 LIST   ids of queued tasks in arrival order; the
                                            head is served next, except under fair share
                                            (tenants configured), where lanes decide
    rq:queues                        SET    RQ's index of queue keys
    rq:job:<id>                      HASH   the task: RQ's job fields plus gpulane's
                                            (field list in dispatcher.contract.jobs)

RQ's worker registry (RQ 3's format, so ``rq info``, rq-dashboard and ``Worker.all``
list gpulane's workers; written by register/heartbeat, removed with the worker by
unregister and the reaper; every key expires one lease after the last heartbeat)::

    rq:workers                       SET    keys rq:worker:<name> of live workers
    rq:workers:<class>               SET    the same, per queue the worker serves
    rq:worker:<name>                 HASH   RQ's worker fields (birth, last_heartbeat,
                                            queues, state, current_job, pid, hostname,
                                            ...; list in dispatcher.contract.workers)
    rq:worker:<name>:executions      SET    <task id>:<attempt> of the running task
    rq:execution:<id>:<attempt>      HASH   RQ's execution record of that run

gpulane's keys::

    gpulane:file:<id>                STRING uploaded document bytes; deleted at the end
    gpulane:catalog                  HASH   task type -> JSON {schema, description, ...}
                                            as published by the workers serving it
    gpulane:catalog:publisher:<digest>:<host>:<ppid>
                                     STRING "publishing" | "done": the catalog of the
                                            task_modules whose digest this is, by one
                                            process of the API whose processes share
                                            that host and parent (SET NX PX): N
                                            processes run one catalog subprocess
    gpulane:workers                  ZSET   worker name -> lease deadline (ms, Redis clock)
    gpulane:worker:<name>            HASH   what a worker is and does (GET /workers)
    gpulane:inflight:<name>:<class>  LIST   the task the worker holds (0 or 1 id, or a
                                            batch's ids); tasks move here from
                                            rq:queue:<class> atomically
    gpulane:parked:<class>           ZSET   workers parked waiting for that class ->
                                            rank (1000 / speed) x 2^32 + GPU memory
                                            free for a task (MB; 2^31-1: no limit); a
                                            submit wakes the lowest score that fits
                                            (fastest, then best fit). Earlier versions
                                            kept a SET gpulane:idle:<class>; the new
                                            name lets a leftover one break nothing
    gpulane:parked:<class>:<type>    ZSET   the same, for a routed type (a backend
                                            model's): the backend workers serving it
    gpulane:wake:<name>              LIST   doorbell a parked worker blocks on
    gpulane:control:<name>           LIST   ids of running tasks the worker must cancel
    gpulane:beat:<name>              STRING the name of the worker's last heartbeat
                                            folded in (EX 1 h; outlives the worker
                                            hash, which a reaper or a re-register
                                            deletes): one sent again folds nothing twice
    gpulane:stats:<class>            HASH   decayed mean run time: sum, weight, at_ms
    gpulane:bytes:<class>            STRING upload bytes held by the class's unfinished
                                            tasks, for max_queued_bytes: INCRBY in
                                            submit.lua, DECRBY when a task ends
    gpulane:extra:<class>            STRING items queued in the class beyond one per
                                            record (a chunk of n adds n - 1), so that
                                            LLEN rq:queue:<class> + this = items queued,
                                            what max_queued and the wait estimate count;
                                            INCRBY / DECRBY as a chunk joins / leaves the
                                            class list; deleted by a submit that finds the
                                            list empty
    gpulane:lane:<class>:<tenant>    LIST   fair share: the tenant's queued ids in the
                                            class, oldest first (each id is also in
                                            rq:queue:<class>, which keeps arrival order)
    gpulane:lanes:<class>            ZSET   fair share: tenants with a non-empty lane ->
                                            virtual start tag of their next task; the
                                            smallest is served next
    gpulane:fair:<class>             HASH   fair share: v (the class's virtual clock),
                                            t:<tenant> (an idle tenant's next tag),
                                            w:<tenant> (its weight, written by submits),
                                            x:<tenant> (its lane's items beyond one per
                                            record, as gpulane:extra:<class>),
                                            c:<tenant> (weighted cost of its last item
                                            charged), d:<type> (the type's device time
                                            per item, microseconds, an exponential mean
                                            of its laned finishes)
    gpulane:metrics                  HASH   pool-wide counters and histogram buckets
    gpulane:idem:<tenant>:<digest>   STRING "<task id> <request fingerprint>" owning an
                                            Idempotency-Key
    gpulane:tenant:<tenant>:tasks    ZSET   a tenant's queued and running task ids
                                            (created ms), for max_in_flight
    gpulane:rate:<tenant>            HASH   the tenant's token bucket: tokens, at_ms
    gpulane:tpm:<tenant>             HASH   the tenant's model-token bucket (its tpm):
                                            tokens, at_ms; charged max_tokens at
                                            admission, settled with the real usage
    gpulane:usage:<minute>           HASH   device time used in that minute (Redis
                                            time, minutes since the epoch), integer
                                            microseconds: u|<tenant>|<class>|<type>, and
                                            t|<tenant> (its total, for device quotas);
                                            written by worker heartbeats, expires
                                            usage_retention_s after its last write
    gpulane:usage:minutes            ZSET   minute -> minute, of every usage bucket kept
    gpulane:parts:<id>               HASH   the results of a task's parts: <k> -> part k's
                                            entries (a JSON list), n:<k> -> how many
                                            (dispatcher.contract.parts); expires with
                                            its task
    gpulane:stream:<id>              STREAM a generation's chunks as its backend worker
                                            relays them (fields k: chunk | end | error,
                                            d: JSON); any API process reads it; expires
                                            stream_ttl_s after its last entry
    gpulane:reaper:lock              STRING one reaper at a time (SET NX PX)
    gpulane:reaper:last              STRING Redis time of the last reaper pass (ms)
    gpulane:gpu:<uuid>:<slot>        STRING name of the worker holding that claim slot of
                                            the GPU (slots 0..per_gpu-1), PX lease_ttl;
                                            taken and renewed by gpu_lease.lua

One pub/sub channel (not a key; PUBLISH/SUBSCRIBE)::

    gpulane:events                   a task id, published whenever that task's status or
                                     progress changed (claim, finish, cancel, release,
                                     reaper, worker progress; '<id> started' and
                                     '<id> progress' for changes that cannot end it);
                                     each API process holds one subscription and wakes
                                     its waiters (api/waiters.py)

GPU claims are keyed by the card's NVML UUID alone, not by host name: a UUID names
one physical card (or MIG instance) worldwide, while a host name is per container, so
``docker compose up --scale worker=4`` replicas on one machine, each with its own
host name, must still meet on the same key for the same card.

Lua scripts get the same functions through :func:`lua_prelude`, generated from this
module, so a layout change here reaches every script.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = [
    "CATALOG",
    "EVENTS",
    "METRICS",
    "REAPER_LAST",
    "REAPER_LOCK",
    "RQ_QUEUES",
    "RQ_WORKERS",
    "USAGE_MINUTES",
    "WORKERS",
    "beat",
    "catalog_publisher",
    "control",
    "fair",
    "file",
    "gpu_claim",
    "idem",
    "inflight",
    "job",
    "lane",
    "lanes",
    "lua_prelude",
    "parked",
    "parked_type",
    "parts",
    "queue",
    "queued_bytes",
    "queued_extra",
    "rate",
    "rq_execution",
    "rq_worker",
    "rq_worker_executions",
    "rq_workers_of",
    "stats",
    "stream",
    "tenant_tasks",
    "tpm",
    "usage",
    "wake",
    "worker",
]

_RQ = "rq:"
_P = "gpulane:"

RQ_QUEUES = _RQ + "queues"
RQ_WORKERS = _RQ + "workers"
CATALOG = _P + "catalog"
WORKERS = _P + "workers"
METRICS = _P + "metrics"
REAPER_LOCK = _P + "reaper:lock"
REAPER_LAST = _P + "reaper:last"
EVENTS = _P + "events"  # pub/sub channel: ids of tasks whose status or progress changed
USAGE_MINUTES = _P + "usage:minutes"  # the minutes that have a usage bucket

# One table drives both the Python functions and the Lua prelude:
# name -> (prefix, argument names, suffix).
_TEMPLATES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "queue": (_RQ + "queue:", ("cls",), ""),
    "job": (_RQ + "job:", ("task_id",), ""),
    "rq_worker": (_RQ + "worker:", ("name",), ""),
    "rq_workers_of": (_RQ + "workers:", ("cls",), ""),
    "rq_worker_executions": (_RQ + "worker:", ("name",), ":executions"),
    "rq_execution": (_RQ + "execution:", ("task_id", "attempt"), ""),
    "file": (_P + "file:", ("task_id",), ""),
    "worker": (_P + "worker:", ("name",), ""),
    "inflight": (_P + "inflight:", ("name", "cls"), ""),
    "parked": (_P + "parked:", ("cls",), ""),
    "parked_type": (_P + "parked:", ("cls", "task_type"), ""),
    "stream": (_P + "stream:", ("task_id",), ""),
    "parts": (_P + "parts:", ("task_id",), ""),
    "tpm": (_P + "tpm:", ("tenant",), ""),
    "usage": (_P + "usage:", ("minute",), ""),
    "lane": (_P + "lane:", ("cls", "tenant"), ""),
    "lanes": (_P + "lanes:", ("cls",), ""),
    "fair": (_P + "fair:", ("cls",), ""),
    "wake": (_P + "wake:", ("name",), ""),
    "control": (_P + "control:", ("name",), ""),
    "beat": (_P + "beat:", ("name",), ""),
    "stats": (_P + "stats:", ("cls",), ""),
    "queued_bytes": (_P + "bytes:", ("cls",), ""),
    "queued_extra": (_P + "extra:", ("cls",), ""),
    "idem": (_P + "idem:", ("tenant", "digest"), ""),
    "tenant_tasks": (_P + "tenant:", ("tenant",), ":tasks"),
    "rate": (_P + "rate:", ("tenant",), ""),
    "gpu_claim": (_P + "gpu:", ("uuid", "slot"), ""),
    "catalog_publisher": (_P + "catalog:publisher:", ("digest", "group"), ""),
}


def _build(name: str, *parts: str) -> str:
    prefix, _, suffix = _TEMPLATES[name]
    return prefix + ":".join(parts) + suffix


def queue(cls: str) -> str:
    return _build("queue", cls)


def job(task_id: str) -> str:
    return _build("job", task_id)


def rq_worker(name: str) -> str:
    return _build("rq_worker", name)


def rq_workers_of(cls: str) -> str:
    return _build("rq_workers_of", cls)


def rq_worker_executions(name: str) -> str:
    return _build("rq_worker_executions", name)


def rq_execution(task_id: str, attempt: int) -> str:
    return _build("rq_execution", task_id, str(attempt))


def file(task_id: str) -> str:
    return _build("file", task_id)


def worker(name: str) -> str:
    return _build("worker", name)


def inflight(name: str, cls: str) -> str:
    return _build("inflight", name, cls)


def parked(cls: str) -> str:
    return _build("parked", cls)


def parked_type(cls: str, task_type: str) -> str:
    return _build("parked_type", cls, task_type)


def stream(task_id: str) -> str:
    return _build("stream", task_id)


def parts(task_id: str) -> str:
    return _build("parts", task_id)


def tpm(tenant: str) -> str:
    return _build("tpm", tenant)


def usage(minute: int) -> str:
    return _build("usage", str(minute))


def lane(cls: str, tenant: str) -> str:
    return _build("lane", cls, tenant)


def lanes(cls: str) -> str:
    return _build("lanes", cls)


def fair(cls: str) -> str:
    return _build("fair", cls)


def wake(name: str) -> str:
    return _build("wake", name)


def control(name: str) -> str:
    return _build("control", name)


def beat(name: str) -> str:
    return _build("beat", name)


def stats(cls: str) -> str:
    return _build("stats", cls)


def queued_bytes(cls: str) -> str:
    return _build("queued_bytes", cls)


def queued_extra(cls: str) -> str:
    return _build("queued_extra", cls)


def idem(tenant: str, digest: str) -> str:
    return _build("idem", tenant, digest)


def tenant_tasks(tenant: str) -> str:
    return _build("tenant_tasks", tenant)


def rate(tenant: str) -> str:
    return _build("rate", tenant)


def gpu_claim(uuid: str, slot: int) -> str:
    return _build("gpu_claim", uuid, str(slot))


def catalog_publisher(digest: str, group: str) -> str:
    return _build("catalog_publisher", digest, group)


def lua_prelude(used: Collection[str]) -> str:
    """Lua table ``K`` with the key builders (and constant keys) named in ``used``,
    prepended to a script. Redis runs a script's whole text on every call, so a script
    carries only the builders it names."""
    lines = ["local K = {}"]
    for name, (prefix, args, suffix) in _TEMPLATES.items():
        if name not in used:
            continue
        body = " .. ':' .. ".join(args) + (f" .. '{suffix}'" if suffix else "")
        lines.append(f"function K.{name}({', '.join(args)}) return '{prefix}' .. {body} end")
    for name, value in (
        ("RQ_QUEUES", RQ_QUEUES),
        ("RQ_WORKERS", RQ_WORKERS),
        ("CATALOG", CATALOG),
        ("WORKERS", WORKERS),
        ("METRICS", METRICS),
        ("REAPER_LOCK", REAPER_LOCK),
        ("REAPER_LAST", REAPER_LAST),
        ("EVENTS", EVENTS),
        ("USAGE_MINUTES", USAGE_MINUTES),
    ):
        if name in used:
            lines.append(f"K.{name} = '{value}'")
    return "\n".join(lines) + "\n"
