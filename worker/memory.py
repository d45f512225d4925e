"""The worker process's resident memory, for ``max_worker_rss_mb``."""

from __future__ import annotations

import os
import resource
import sys

__all__ = ["rss_bytes"]


def rss_bytes() -> int:
    """Resident set size now (Linux: /proc/self/statm); elsewhere the peak so far."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB else
