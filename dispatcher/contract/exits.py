"""Every exit status gpulane's commands use, in one place.

The command line's (``gpulane submit``, ``status`` and the rest): 0 ok, 1 the task (or
command) failed, 2 usage or configuration error, 3 the API or Redis was unavailable,
130 interrupted (Ctrl-C).
And those of ``gpulane worker`` that mean something to whoever restarts it, which the
supervisor explains in its status lines (it must not import worker code).
"""

from __future__ import annotations

__all__ = [
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_NO_GPU",
    "EXIT_OK",
    "EXIT_RECYCLED",
    "EXIT_STUCK",
    "EXIT_UNAVAILABLE",
    "EXIT_UNHEALTHY",
    "EXIT_USAGE",
    "describe",
]

EXIT_OK = 0
EXIT_FAILED = 1  # the task ended failed or canceled, or the command failed
EXIT_USAGE = 2  # bad flags or arguments (argparse's own status)
EXIT_UNAVAILABLE = 3  # the API or Redis could not be reached, or refused the request
EXIT_INTERRUPTED = 130  # Ctrl-C while `submit --wait` waited (128 + SIGINT, as shells say)

EXIT_CONFIG = 2  # bad flags or configuration, or a name another live worker holds
EXIT_STUCK = 70  # a task ignored its timeout in native code; it was reported failed
EXIT_UNHEALTHY = 71  # GPU fault, device lost or hung, or GPU claim lost; task handed back
EXIT_RECYCLED = 72  # its memory passed max_worker_rss_mb after a task (reported first)
EXIT_NO_GPU = 75  # no GPU claim became free within gpu_wait_s (EX_TEMPFAIL)

_MEANING = {
    EXIT_CONFIG: "configuration error",
    EXIT_STUCK: "a task was stuck past its timeout",
    EXIT_UNHEALTHY: "unhealthy: its GPU faulted, stopped answering or was claimed by another",
    EXIT_NO_GPU: "no free GPU within gpu_wait_s",
    EXIT_RECYCLED: "recycled: its memory passed max_worker_rss_mb after a task",
}


def describe(status: int) -> str:
    """A few words on what an exit status means, or '' for an ordinary one."""
    if status < 0:
        return f"killed by signal {-status}"
    return _MEANING.get(status, "")
