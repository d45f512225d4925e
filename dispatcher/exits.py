"""Exit statuses of ``gpulane worker`` that mean something to whoever restarts it.

They live in ``dispatcher/`` because the supervisor explains them in its status lines
and must not import worker code (it never loads GPU libraries).
"""

from __future__ import annotations

__all__ = ["EXIT_CONFIG", "EXIT_NO_GPU", "EXIT_STUCK", "EXIT_UNHEALTHY", "describe"]

EXIT_CONFIG = 2  # bad flags or configuration, or a name another live worker holds
EXIT_STUCK = 70  # a task ignored its timeout in native code; it was reported failed
EXIT_UNHEALTHY = 71  # GPU fault, device lost or hung, or GPU claim lost; task handed back
EXIT_NO_GPU = 75  # no GPU claim became free within gpu_wait_s (EX_TEMPFAIL)

_MEANING = {
    EXIT_CONFIG: "configuration error",
    EXIT_STUCK: "a task was stuck past its timeout",
    EXIT_UNHEALTHY: "unhealthy: its GPU faulted, stopped answering or was claimed by another",
    EXIT_NO_GPU: "no free GPU within gpu_wait_s",
}


def describe(status: int) -> str:
    """A few words on what an exit status means, or '' for an ordinary one."""
    if status < 0:
        return f"killed by signal {-status}"
    return _MEANING.get(status, "")
