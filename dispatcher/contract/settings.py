"""gpulane's one settings object.

Read once at process start by :func:`load_settings` and passed down; no other module
reads the environment. Sources, strongest first:

1. values given in code (the CLI's flags),
2. environment variables prefixed ``GPULANE_`` (``GPULANE_REDIS_URL``, ``GPULANE_PORT``,
   nested values as JSON: ``GPULANE_CLASSES='{"batch": {"max_queued": 10}}'``),
3. the TOML file named by ``GPULANE_CONFIG`` (any field below, plus the ``[classes.*]``
   tables and ``[[tenants]]``),
4. the defaults here.

An unknown key anywhere in the file is an error, never silently ignored.
"""

from __future__ import annotations

import json
import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from redis.connection import parse_url

__all__ = [
    "ClassConfig",
    "FairCost",
    "ReportOverlap",
    "Settings",
    "SettingsError",
    "TenantConfig",
    "TypeConfig",
    "load_settings",
]

_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MiB = 1024 * 1024


class SettingsError(ValueError):
    """The configuration cannot be used; the message says which key and why."""


class ClassConfig(BaseModel):
    """Admission limits and defaults of one task class (a Redis queue)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_queued: int = Field(
        1000, ge=1, description="Refuse (503 queue_full) past this many queued items."
    )
    max_queued_bytes: int = Field(
        1 << 30,
        ge=1024,
        description="Refuse (503 queue_full) an upload that would bring the uploads held "
        "by the class's unfinished tasks (they live in Redis) over this many bytes.",
    )
    max_wait_s: float = Field(
        3600.0, gt=0, description="Refuse when the estimated wait of a new task exceeds this."
    )
    reject_without_workers: bool = Field(
        False, description="Refuse (503 no_workers) when no live worker serves the class."
    )
    default_timeout_s: float | None = Field(
        None, gt=0, description="Run-time limit of a task that names none; global default if unset."
    )
    promote_after_s: float | None = Field(
        None,
        gt=0,
        description="A task of this class waiting longer is served before higher classes' "
        "newer tasks on shared workers, so the class cannot starve.",
    )


class TypeConfig(BaseModel):
    """Operator overrides for one task type (``[types."<name>"]``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_max_size: int | None = Field(
        None, ge=1, le=1024, description="Largest batch of a batched type; 1 turns batching off."
    )
    batch_max_wait_ms: float | None = Field(
        None, ge=0, le=10_000, description="How long a short batch waits for more tasks."
    )


class FairCost(StrEnum):
    """What fair share charges a tenant for a turn (``fair_share_by``)."""

    DEVICE_TIME = "device_time"
    TASKS = "tasks"


class ReportOverlap(StrEnum):
    """When a worker reports a batch while it runs the next (``report_overlap``)."""

    AUTO = "auto"  # on a GPU: the card need not wait on the report
    ALWAYS = "always"
    NEVER = "never"  # the next claim rides with the report: one round trip a batch


class TenantConfig(BaseModel):
    """One API client: who it is, how its key is checked and what it may use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Tenant id, in keys and logs.")
    key_sha256: list[str] = Field(
        min_length=1, description="Hex SHA-256 of each accepted bearer key."
    )
    rate: float = Field(20.0, gt=0, description="Requests per second (token bucket refill).")
    burst: int = Field(40, ge=1)
    max_in_flight: int = Field(100, ge=1, description="Queued plus running tasks at once.")
    weight: float = Field(
        1.0,
        ge=0.01,
        le=1000,
        description="Share of the pool under fair share: tenants with queued work in a class "
        "are served in proportion to their weights.",
    )
    classes: list[str] | None = Field(None, description="Classes it may submit to; all if unset.")
    admin: bool = False
    tpm: int | None = Field(
        None,
        ge=1,
        description="Model tokens per minute (prompt plus completion) for generation routes; "
        "unset: no budget. `max_tokens` is charged at admission and settled with the real "
        "usage; over it, 429 with Retry-After.",
    )
    device_seconds_per_hour: float | None = Field(
        None,
        gt=0,
        description="Device-seconds its tasks may use in any hour (a rolling window of the "
        "last 60 minutes, held in Redis for every API replica); unset: no quota. Over it, "
        "submits get 429 with Retry-After until enough of the hour has rolled off.",
    )
    generation_class: str | None = Field(
        None,
        description="Class of its /v1/chat/completions and /v1/completions requests; unset: "
        "`generation_class` of the settings. The X-Gpulane-Class header overrides both.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _TENANT.match(value):
            raise ValueError(
                f"tenant name {value!r} must be 1-64 letters, digits, '_', '.' or '-', "
                "starting with a letter or digit"
            )
        return value

    @field_validator("key_sha256", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("key_sha256")
    @classmethod
    def _hex(cls, value: list[str]) -> list[str]:
        for digest in value:
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError("key_sha256 must be 64 lowercase hex digits")
        return value


def _default_classes() -> dict[str, ClassConfig]:
    return {
        # Items, not requests: one /v1/embeddings call may bring 2,048 of them.
        "interactive": ClassConfig(max_queued=10_000, max_wait_s=30, reject_without_workers=True),
        "batch": ClassConfig(max_queued=100_000, max_wait_s=3600, promote_after_s=300),
    }


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "gpulane"


class Settings(BaseSettings):
    """Every tunable of gpulane. Field names map to ``GPULANE_<NAME>`` variables."""

    model_config = SettingsConfigDict(
        env_prefix="GPULANE_", extra="forbid", frozen=True, validate_default=True
    )

    # Where things are.
    redis_url: str | None = Field(
        None,
        description="Shared Redis. Unset: `gpulane up` starts a private one. With "
        "`redis_sentinels`, only its credentials and database number are used.",
    )
    redis_sentinels: list[str] = Field(
        default_factory=list,
        max_length=16,
        description='Sentinels as "host:port" (JSON list in the environment). Set: the '
        "master is found through them and followed across a failover.",
    )
    redis_sentinel_master: str = Field(
        "gpulane", min_length=1, max_length=128, description="The master name they monitor."
    )
    redis_sentinel_username: str | None = Field(None, description="ACL user of the sentinels.")
    redis_sentinel_password: str | None = Field(None, description="Password of the sentinels.")
    min_replica_acks: int = Field(
        0,
        ge=0,
        le=16,
        description="POST /tasks answers 202 only once this many replicas hold the task "
        "(Redis WAIT), else 503 store_unavailable; workers' claims and reports wait the "
        "same way and are retried. 0: no wait.",
    )
    replica_ack_timeout_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="How long POST /tasks, and a worker's claims and reports, wait for "
        "those replica acks.",
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    data_dir: Path = Field(default_factory=_default_data_dir)
    api_workers: int = Field(
        1, ge=1, le=64, description="API processes serving the port (uvicorn workers)."
    )
    api_url: str | None = Field(None, description="Where `gpulane submit/status` find the API.")
    api_key: str | None = Field(None, description="Bearer key `gpulane submit/status` send.")

    # Classes (priority order = table order) and tenants.
    classes: dict[str, ClassConfig] = Field(default_factory=_default_classes)
    default_class: str = Field("batch", description="Class of a submission that names none.")
    tenants: list[TenantConfig] = Field(default_factory=list)
    fair_share: bool = Field(
        True,
        description="With tenants configured, tenants with queued work in a class take turns "
        "(weighted by their `weight`, FIFO within a tenant); off, or without tenants: each "
        "class is one FIFO queue.",
    )
    fair_share_by: FairCost = Field(
        FairCost.DEVICE_TIME,
        description="What a turn costs under fair share: `device_time` (the device time the "
        "task's worker measured, so tenants get device time in proportion to their weights) "
        "or `tasks` (one per item, whatever it costs to run).",
    )
    usage_retention_s: int = Field(
        7 * 86400,
        ge=3600,
        le=90 * 86400,
        description="How long the per-minute device-time usage (GET /usage, device quotas) "
        "is kept.",
    )
    types: dict[str, TypeConfig] = Field(
        default_factory=dict, description="Per task type overrides (batch policy)."
    )

    # Input limits.
    max_body_bytes: int = Field(1 * MiB, ge=1024, description="JSON request body limit.")
    max_file_bytes: int = Field(32 * MiB, ge=1024, description="Uploaded document limit.")
    max_result_bytes: int = Field(16 * MiB, ge=1024, description="A task's JSON result limit.")
    bulk_max_tasks: int = Field(
        10_000, ge=1, le=100_000, description="Tasks one bulk POST /tasks may carry."
    )
    bulk_max_body_bytes: int = Field(
        64 * MiB,
        ge=1024,
        description="Body limit of a bulk POST /tasks (a JSON array or JSON Lines).",
    )
    default_file_task: str = "document.extract"

    # Slow and hostile clients (per API process).
    header_timeout_s: float = Field(
        10.0, gt=0, description="A request's line and headers must arrive within this (408)."
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="A request's whole body must arrive within this of its headers."
    )
    max_connections: int = Field(
        1000, ge=1, description="Open connections per API process; past it: 503 server_busy."
    )

    # OpenAI-compatible entry (``/v1/embeddings``): each input is one task of this class.
    openai_class: str | None = Field(
        None,
        description="Class of /v1/embeddings tasks; unset: `interactive` if configured, "
        "else default_class.",
    )
    openai_timeout_s: float = Field(
        60.0, gt=0, description="How long /v1/embeddings waits for its tasks (then 504)."
    )
    openai_max_body_bytes: int = Field(
        24 * MiB, ge=1024, description="/v1/embeddings body limit (2,048 inputs of 8,192 chars)."
    )
    openai_max_input_chars: int = Field(8192, ge=1, description="Characters per input.")
    openai_result_ttl_s: int = Field(
        300,
        ge=1,
        description="How long /v1/embeddings' task records are kept once the route has "
        "answered from them (at most result_ttl_s; a call that failed keeps result_ttl_s).",
    )

    # Generation through backend workers (``/v1/chat/completions``, ``/v1/completions``).
    generation_class: str | None = Field(
        None,
        description="Class of generation requests; unset: `interactive` if configured, "
        "else default_class (a tenant's generation_class and X-Gpulane-Class override).",
    )
    generation_timeout_s: float = Field(
        600.0, gt=0, description="Run-time limit of a generation (its task's timeout)."
    )
    generation_max_body_bytes: int = Field(
        4 * MiB, ge=1024, description="Body limit of the generation routes."
    )
    default_max_tokens: int = Field(
        1024,
        ge=1,
        description="What a tpm budget charges at admission for a request with no max_tokens.",
    )
    stream_ttl_s: float = Field(
        600.0, gt=0, description="How long a generation's stream is kept after its last chunk."
    )
    backend_probe_interval_s: float = Field(
        1.0, gt=0, description="How often a backend worker checks that its server answers."
    )
    backend_slots: int = Field(
        8,
        ge=1,
        le=1024,
        description="Tasks a backend worker holds at once when neither --slots nor the server "
        "says (llama.cpp's /props total_slots).",
    )

    # Task lifetime.
    default_timeout_s: float = Field(600.0, gt=0)
    max_timeout_s: float = Field(3600.0, gt=0)
    max_gpu_memory_mb: int = Field(
        262_144,
        ge=1,
        description="Largest GPU memory a task may ask for (`gpu_memory_mb` in POST /tasks or "
        "a type's declaration); more is 422: no card is that large.",
    )
    result_ttl_s: int = Field(86_400, ge=1, description="How long final records are kept.")
    idempotency_ttl_s: int = Field(86_400, ge=1)
    default_run_s: float = Field(
        1.0, gt=0, description="Run-time guess for wait estimates before any task finished."
    )

    # Waiting for results (Prefer: wait, GET /tasks/<id>?wait=N, the event stream).
    wait_max_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Longest `Prefer: wait` or `?wait=` honoured; longer requests are clamped.",
    )
    events_max_s: float = Field(
        300.0, gt=0, description="An event stream (GET /tasks/<id>/events) closes after this."
    )
    events_keepalive_s: float = Field(
        15.0, gt=0, description="Comment line sent on a quiet event stream this often."
    )

    # Liveness.
    heartbeat_interval_s: float = Field(1.0, gt=0)
    lease_ttl_s: float = Field(3.0, gt=0)
    max_attempts: int = Field(3, ge=1, description="Lost attempts before a task fails.")
    shutdown_grace_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, how long a running task may finish before it is handed back.",
    )
    timeout_grace_s: float = Field(
        10.0,
        ge=0,
        description="How long a task that ignores its timeout may run on before its worker exits.",
    )
    health_file: Path | None = Field(
        None,
        description="Worker: a JSON file rewritten every heartbeat for `python -m worker.probe` "
        "(Kubernetes exec probes); unset: none.",
    )

    # Worker pool.
    cpu_workers: int = Field(2, ge=1, description="Workers `up --workers auto` starts with no GPU.")
    cpu_pinning: bool = Field(
        True,
        description="`up` pins each CPU worker to its own share of the CPUs, so their "
        "model threads do not contend; false: every worker may run on all of them.",
    )
    task_modules: list[str] = Field(
        default_factory=lambda: ["worker.tasks.builtin"],
        description="Modules whose @task functions workers load (`worker --tasks` overrides).",
    )
    catalog_on_start: bool = Field(
        True,
        description="The API publishes the task types of task_modules at start (from a "
        "subprocess, CUDA hidden), so they are known before any worker is ready.",
    )
    worker_speed: float = Field(
        1.0,
        ge=0.01,
        le=100,
        description="Worker: relative speed of its device (`worker --speed`), e.g. 2 on a card "
        "twice as fast as the pool's others: a submit wakes the fastest parked worker that "
        "fits the task.",
    )
    per_gpu: int = Field(
        1,
        ge=1,
        le=64,
        description="Workers that may share one GPU (claim slots per card; `worker --per-gpu`). "
        "Use the same value for every worker of a host.",
    )
    gpu_wait_s: float | None = Field(
        None,
        ge=0,
        description="How long a worker waits for a free GPU before it exits with status 75; "
        "unset: as long as it takes (an extra replica stands by for a card).",
    )
    gpu_sample_timeout_s: float = Field(
        10.0,
        gt=0,
        description="An NVML sample unanswered this long means the device stopped answering: "
        "the worker hands its task back, reports itself unhealthy and exits.",
    )
    max_worker_rss_mb: int | None = Field(
        None,
        ge=64,
        description="A worker whose resident memory is above this after a task (reported "
        "first) exits with status 72 to be restarted fresh; unset: never.",
    )
    report_overlap: ReportOverlap = Field(
        ReportOverlap.AUTO,
        description="Worker: report a batch from a thread of its own while the next one runs "
        "(`always`), or inline with the next claim in one round trip (`never`); `auto`: "
        "in the background on a GPU, where the card would otherwise wait on the report.",
    )
    fault_point: Literal["", "after_claim"] = Field(
        "", description="Testing only: a worker SIGKILLs itself at this point."
    )

    # Logs.
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        # Parsed here, as every Redis client of gpulane will parse it, so a mistake stops
        # every command at start with one line rather than as a traceback at the first
        # connection. The URL is not echoed: it may hold a password.
        if value is not None:
            try:
                parse_url(value)  # type: ignore[no-untyped-call]
            except ValueError as exc:
                example = "redis://host:6379/0 or unix:///path/redis.sock"
                raise ValueError(f"not a Redis URL ({exc}), e.g. {example}") from None
        return value

    @field_validator("redis_sentinels")
    @classmethod
    def _host_ports(cls, value: list[str]) -> list[str]:
        for address in value:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f'redis_sentinels entry {address!r} must be "host:port"')
        return value

    @field_validator("classes")
    @classmethod
    def _class_names(cls, value: dict[str, ClassConfig]) -> dict[str, ClassConfig]:
        if not value:
            raise ValueError("at least one class is needed")
        for name in value:
            if not _NAME.match(name):
                raise ValueError(f"class name {name!r} must match {_NAME.pattern}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.lease_ttl_s <= self.heartbeat_interval_s:
            raise ValueError("lease_ttl_s must be longer than heartbeat_interval_s")
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError("default_timeout_s must not exceed max_timeout_s")
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not a configured class")
        named = [("generation_class", self.generation_class)]
        named += [(f"tenant {t.name} generation_class", t.generation_class) for t in self.tenants]
        for name, value in named:
            if value is not None and value not in self.classes:
                raise ValueError(f"{name} {value!r} is not a configured class")
        if self.openai_class is not None and self.openai_class not in self.classes:
            raise ValueError(f"openai_class {self.openai_class!r} is not a configured class")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant names must be unique")
        digests = [d for t in self.tenants for d in t.key_sha256]
        if len(set(digests)) != len(digests):
            raise ValueError("each key_sha256 must belong to one tenant, once")
        for tenant in self.tenants:
            unknown = set(tenant.classes or ()) - set(self.classes)
            if unknown:
                raise ValueError(f"tenant {tenant.name!r} names unknown classes {sorted(unknown)}")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config = os.environ.get("GPULANE_CONFIG")
        if config:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(config)))
        return tuple(sources)

    def environment(self, *names: str) -> dict[str, str]:
        """``GPULANE_<NAME>`` variables that give a child process these fields' values
        (unset ones left out): a child reads its settings from the environment, so a
        value that came from a flag reaches it only this way."""
        values = self.model_dump(mode="json", include=set(names))
        return {
            f"GPULANE_{name.upper()}": value if isinstance(value, str) else json.dumps(value)
            for name, value in values.items()
            if value is not None
        }

    # Derived values used in several places.
    @property
    def redis_url_or_default(self) -> str:
        return self.redis_url or "redis://127.0.0.1:6379/0"

    @property
    def generation_task_class(self) -> str:
        if self.generation_class is not None:
            return self.generation_class
        return "interactive" if "interactive" in self.classes else self.default_class

    @property
    def openai_task_class(self) -> str:
        """The class /v1/embeddings submits to."""
        if self.openai_class is not None:
            return self.openai_class
        return "interactive" if "interactive" in self.classes else self.default_class

    @property
    def redis_remote(self) -> bool:
        """A shared Redis is configured (a URL or sentinels): `up` starts none."""
        return self.redis_url is not None or bool(self.redis_sentinels)

    @property
    def class_names(self) -> list[str]:
        """Classes in priority order, highest first."""
        return list(self.classes)

    def class_timeout_s(self, name: str) -> float:
        return self.classes[name].default_timeout_s or self.default_timeout_s


def load_settings(**overrides: Any) -> Settings:
    """Build the settings once; raise :class:`SettingsError` with a readable message."""
    config = os.environ.get("GPULANE_CONFIG")
    if config and not Path(config).is_file():
        raise SettingsError(f"GPULANE_CONFIG names {config!r}, which is not a readable file")
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from exc
    except ValueError as exc:  # TOML decode errors
        raise SettingsError(f"invalid gpulane settings: {exc}") from exc


def _describe(exc: ValidationError) -> str:
    """One paragraph naming each bad key and why, without pydantic's URLs."""
    problems = []
    for error in exc.errors(include_url=False)[:10]:
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        problems.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    return "invalid gpulane settings: " + "; ".join(problems)
