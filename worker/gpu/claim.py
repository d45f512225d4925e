"""Claiming a GPU before the worker pins it, so two workers never share a card by
mistake: ``docker compose up --scale worker=4`` gives every replica every GPU (Compose
cannot hand each replica its own), and the replicas sort it out here, through Redis.

A claim is a slot key ``gpulane:gpu:<uuid>:<slot>`` holding the worker's name with a
lease (``lease_ttl_s``), taken with gpu_lease.lua (SET NX PX semantics), renewed by
the heartbeat (compare-and-renew) and deleted on exit (compare-and-delete). A killed
worker's claim expires within one lease, and a waiting worker takes the card at its
next look (every ``heartbeat_interval_s``). ``per_gpu`` slots per card let that many
workers share one.

Preference order for ``--gpu auto``: slot 0 of every card, then slot 1 of every
card..., so with ``per_gpu`` 2 and 4 cards the first four workers get a card each.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import RedisError

from dispatcher.contract.backoff import Backoff
from dispatcher.contract.settings import Settings
from worker.broker import Broker
from worker.gpu.devices import Device
from worker.state import WorkerState

__all__ = ["Claim", "claim_device"]

log = logging.getLogger("gpulane.worker")

Claim = tuple[Device, tuple[str, int]]


def _slots(candidates: list[Device], per_gpu: int) -> list[tuple[Device, tuple[str, int]]]:
    return [(d, (d.uuid or "", slot)) for slot in range(per_gpu) for d in candidates]


def claim_device(
    broker: Broker,
    state: WorkerState,
    candidates: list[Device],
    per_gpu: int,
    settings: Settings,
) -> Claim | None:
    """Claim a slot on one of ``candidates`` (GPUs), waiting while all are taken.
    None when stopping, or when ``gpu_wait_s`` passed without a free slot."""
    slots = _slots(candidates, per_gpu)
    started = time.monotonic()
    backoff = Backoff(cap_s=5.0)
    waiting = False
    while not state.stopping:
        try:
            index, holders = broker.gpu_take([slot for _, slot in slots])
        except RedisError as exc:
            log.warning("redis unreachable while claiming a GPU, retrying: %s", exc)
            time.sleep(backoff.next())
            continue
        backoff.reset()
        if index is not None:
            device, slot = slots[index]
            if waiting:
                log.info(
                    "%s freed after %.1f s of waiting",
                    device.label,
                    time.monotonic() - started,
                    extra={"worker": state.name},
                )
            return device, slot
        if not waiting:
            waiting = True
            _announce_wait(state, candidates, per_gpu, holders)
        if settings.gpu_wait_s is not None and time.monotonic() - started >= settings.gpu_wait_s:
            log.error(
                "no GPU became free within gpu_wait_s=%g s; exiting",
                settings.gpu_wait_s,
                extra={"worker": state.name},
            )
            return None
        _sleep(state, settings.heartbeat_interval_s)
    return None


def _announce_wait(
    state: WorkerState, candidates: list[Device], per_gpu: int, holders: list[str]
) -> None:
    which = (
        f"{candidates[0].label} ({candidates[0].uuid})"
        if len(candidates) == 1
        else f"all {len(candidates)} GPUs"
    )
    share = f", {per_gpu} workers per GPU" if per_gpu > 1 else ""
    reason = f"waiting for a free GPU: {which} claimed{share} by {', '.join(sorted(set(holders)))}"
    state.set("waiting_for_gpu", reason)
    log.warning("%s; it takes the first one freed", reason, extra={"worker": state.name})


def _sleep(state: WorkerState, seconds: float) -> None:
    """Sleep, but wake within a tenth of a second of a stop request."""
    deadline = time.monotonic() + seconds
    while not state.stopping and time.monotonic() < deadline:
        time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
