"""Exec probes for a worker in Kubernetes: ``python -m worker.probe live|ready``.

A worker with the ``health_file`` setting (``GPULANE_HEALTH_FILE``) rewrites that file
on every heartbeat with :func:`write_health`::

    {"state": "idle", "ready": true, "beat_unix": 1767225600.25, "name": "pod-x.1"}

``live`` succeeds while the last beat is younger than ``--max-age-s`` (default: three
heartbeat intervals): the heartbeat thread, which renews the worker's lease, is running.
``ready`` also needs ``ready`` to be true: the worker registered, published its task
types, loaded its task modules and serves (``idle`` or ``busy``).

Exit status 0 when the check passes, 1 when it fails (and a line on stdout saying why,
which Kubernetes shows in the pod's events), 2 for bad arguments. The probe reads one
small file and touches neither Redis nor the GPU, so it stays cheap and answers even
while the worker is busy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["Health", "check", "main", "read_health", "write_health"]

Mode = Literal["live", "ready"]
STALE_BEATS = 3  # default max age, in heartbeat intervals


@dataclass(frozen=True)
class Health:
    state: str
    ready: bool
    beat_unix: float
    name: str


def write_health(path: str | os.PathLike[str], state: str, ready: bool, name: str) -> None:
    """Replace the health file atomically: a probe reads the old or the new file, never
    a part of one (a temporary file in the same folder, then ``os.replace``)."""
    target = Path(path)
    body = json.dumps({"state": state, "ready": ready, "beat_unix": time.time(), "name": name})
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(body)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def read_health(path: str | os.PathLike[str]) -> Health:
    """The file's content. Raises ``OSError`` when it cannot be read, ``ValueError`` when
    it is not JSON, ``TypeError`` when it is not what :func:`write_health` writes."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise TypeError("not a JSON object")
    state, ready, beat, name = (raw.get(k) for k in ("state", "ready", "beat_unix", "name"))
    if not isinstance(state, str) or not isinstance(ready, bool) or not isinstance(name, str):
        raise TypeError("state, ready or name missing or of the wrong type")
    if isinstance(beat, bool) or not isinstance(beat, int | float):
        raise TypeError("beat_unix missing or not a number")
    return Health(state, ready, float(beat), name)


def check(
    mode: Mode, path: str | os.PathLike[str], max_age_s: float, now: float | None = None
) -> tuple[bool, str]:
    """(passed, why) for one probe of ``mode`` against the health file at ``path``."""
    try:
        health = read_health(path)
    except FileNotFoundError:
        return False, f"no health file {path} (the heartbeat has not started)"
    except (OSError, ValueError, TypeError) as exc:
        return False, f"unreadable health file {path}: {exc}"
    age = max((time.time() if now is None else now) - health.beat_unix, 0.0)
    if age > max_age_s:
        return False, f"last heartbeat {age:.1f} s ago (max {max_age_s:g} s), state {health.state}"
    if mode == "ready" and not health.ready:
        return False, f"not ready: state {health.state}"
    return True, f"{mode}: {health.name} {health.state}, beat {age:.1f} s ago"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m worker.probe", description="Kubernetes exec probe of a gpulane worker."
    )
    parser.add_argument("mode", choices=["live", "ready"])
    parser.add_argument("--file", type=Path, help="health file (default: the health_file setting)")
    parser.add_argument(
        "--max-age-s",
        type=float,
        help=f"oldest beat that passes (default: {STALE_BEATS} x heartbeat_interval_s)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    path: Path | None = ns.file
    max_age_s: float | None = ns.max_age_s
    if path is None or max_age_s is None:
        from dispatcher.contract.settings import SettingsError, load_settings  # only when needed

        try:
            settings = load_settings()
        except SettingsError as exc:
            print(exc)
            return 1
        path = path or settings.health_file
        if max_age_s is None:
            max_age_s = STALE_BEATS * settings.heartbeat_interval_s
    if path is None:
        print("no health file: set GPULANE_HEALTH_FILE (the worker writes it) or pass --file")
        return 1
    passed, why = check(ns.mode, path, max_age_s)
    print(why)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
