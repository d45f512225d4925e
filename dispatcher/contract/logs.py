"""Logging for every gpulane process: ``text`` for people, ``json`` for machines.

Log calls pass context as ``extra`` (``worker``, ``task``, ``class``, ``type``,
``elapsed_s``...); both formats print it, so one line per task transition carries the
task id, class, type, worker and elapsed time (a batch of several records: one line
each way naming its tasks, ``worker/tasklog.py``).

Identical warnings and errors (same logger, level and text) are let through once per
``REPEAT_WINDOW_S``; the next one through carries ``repeated=<n>``, the number held
back meanwhile. A Redis outage or a flood of bad clients is a few lines, not thousands.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import UTC, datetime
from typing import Any

__all__ = ["REPEAT_WINDOW_S", "RepeatFilter", "configure_logging"]

REPEAT_WINDOW_S = 30.0

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {
    "message",
    "asctime",
    "taskName",
    "color_message",  # uvicorn's ANSI copy of the message
}


def _context(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class TextFormatter(logging.Formatter):
    """``HH:MM:SS.mmm LEVEL logger: message  [key=value ...]``, UTC."""

    def __init__(self) -> None:
        super().__init__()
        self._second = -1  # the whole second _clock was formatted for
        self._clock = ""

    def _moment(self, created: float) -> str:
        # A busy worker logs thousands of lines a second: strftime once per second.
        second = int(created)
        if second != self._second:
            self._second, self._clock = second, time.strftime("%H:%M:%S", time.gmtime(second))
        return f"{self._clock}.{int((created - second) * 1000):03d}"

    def format(self, record: logging.LogRecord) -> str:
        moment = self._moment(record.created)
        pairs = " ".join(f"{k}={v}" for k, v in _context(record).items())
        line = f"{moment} {record.levelname:<7} {record.name}: {record.getMessage()}"
        if pairs:
            line += f"  [{pairs}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **_context(record),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class RepeatFilter(logging.Filter):
    """Rate-limits identical warnings and errors (module docstring)."""

    _MAX_KEYS = 1000  # distinct messages remembered; forgotten all at once past it

    def __init__(self, window_s: float = REPEAT_WINDOW_S) -> None:
        super().__init__()
        self.window_s = window_s
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, record.getMessage()[:300])
        now = time.monotonic()
        first, held = self._seen.get(key, (-self.window_s, 0))
        if now - first < self.window_s:
            self._seen[key] = (first, held + 1)
            return False
        if len(self._seen) >= self._MAX_KEYS:
            self._seen.clear()
        self._seen[key] = (now, 0)
        if held:
            record.repeated = held
        return True


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    # Neither format prints the caller's file and line, the thread or the process, so
    # no record looks them up (the logging HOWTO's "Optimization"): a worker writes two
    # lines per task, and the frame walk and getpid took 2 of a line's 13.6 us.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RepeatFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
