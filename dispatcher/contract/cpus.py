"""Which CPUs a worker may run on: ``gpulane up``'s CPU workers each get a share.

A model on the CPU runs its operators on as many threads as the process may use CPUs
(libgomp under torch, OpenBLAS under numpy and onnxruntime as ``worker.tasks.ocr``
sizes it all read the affinity mask at start). Two workers that may each use every
core run twice the threads the host has, and OpenMP's threads wait for one another
at every operator: a thread that lost its core to the other worker holds up its
sibling, which spins meanwhile. Measured (``bench cpu_share``, 2 cores, one
``/v1/embeddings`` call of 2,048 texts; ``docs/design.md`` §9): two such workers ran
at 0.58x of one in-process ``model.encode``, two workers on one core each at 0.95x
(one worker alone 0.89x).

So ``up`` gives each CPU worker its own share of the CPUs it may itself use (a
container's cpuset, ``taskset``), as it gives each GPU worker its own card: the
child is pinned between fork and exec (:func:`pin`), before any library counts its
CPUs. More workers than CPUs share them round-robin, one CPU each. The worker reports
its set as its device's ``cpus`` (:func:`describe`), so ``GET /workers`` shows it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["allowed", "describe", "pin", "shares"]


def allowed() -> list[int]:
    """The CPUs this process may run on, in order (all of them where the platform
    cannot tell)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def shares(cpus: list[int], count: int) -> list[list[int]]:
    """``cpus`` split among ``count`` workers: contiguous runs (neighbouring cores
    share caches) as equal as they can be, the larger first; with fewer CPUs than
    workers, one CPU each, round-robin."""
    if count < 1 or not cpus:
        raise ValueError("shares need at least one CPU and one worker")
    if count >= len(cpus):
        return [[cpus[i % len(cpus)]] for i in range(count)]
    size, extra = divmod(len(cpus), count)
    out, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        out.append(cpus[start:end])
        start = end
    return out


def describe(cpus: Iterable[int]) -> str:
    """``0-3,8,10-11``: the list form ``taskset -c`` and ``Cpus_allowed_list`` use."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def pin(cpus: list[int]) -> None:
    """Restrict this process (and what it starts) to ``cpus``; nothing where the
    platform has no affinity (macOS). Run in a child before exec: async-signal-safe
    enough (one system call, no locks taken)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
