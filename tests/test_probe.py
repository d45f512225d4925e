"""worker.probe: the health file the worker writes each heartbeat, and the exec probes
Kubernetes runs against it (`python -m worker.probe live|ready`), both directions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import WorkerFactory

from testkit import wait_for
from worker.probe import check, main, read_health, write_health

REPO = Path(__file__).resolve().parents[1]


def _write(path: Path, age_s: float, ready: bool = True, state: str = "idle") -> None:
    """A health file whose beat is ``age_s`` old (what write_health writes, back-dated)."""
    beat = time.time() - age_s
    path.write_text(json.dumps({"state": state, "ready": ready, "beat_unix": beat, "name": "w"}))


def test_write_health_writes_the_documented_json(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    before = time.time()
    write_health(path, "busy", True, "node-a.17")
    raw = json.loads(path.read_text())
    assert set(raw) == {"state", "ready", "beat_unix", "name"}
    assert (raw["state"], raw["ready"], raw["name"]) == ("busy", True, "node-a.17")
    assert before <= raw["beat_unix"] <= time.time()
    write_health(path, "stopping", False, "node-a.17")  # replaces, leaves no temp file
    assert read_health(path).state == "stopping"
    assert not read_health(path).ready
    assert [p.name for p in tmp_path.iterdir()] == ["health.json"]


def test_write_health_is_atomic_for_a_concurrent_reader(tmp_path: Path) -> None:
    """A probe reading while the heartbeat rewrites the file sees a whole file every
    time (a plain truncate-and-write would show it empty or cut now and then)."""
    path = tmp_path / "health.json"
    write_health(path, "idle", True, "w" * 2000)
    done = threading.Event()

    def writer() -> None:
        for i in range(3000):
            write_health(path, "idle" if i % 2 else "busy", True, "w" * 2000)
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    reads = 0
    while not done.is_set():
        assert read_health(path).name == "w" * 2000
        reads += 1
    thread.join()
    assert reads > 10
    assert [p.name for p in tmp_path.iterdir()] == ["health.json"]


def test_live_follows_the_age_of_the_beat(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    _write(path, age_s=0.5)
    assert check("live", path, max_age_s=3)[0]
    _write(path, age_s=5)
    passed, why = check("live", path, max_age_s=3)
    assert not passed
    assert "last heartbeat 5." in why
    # A not-ready worker whose heartbeat runs (loading, waiting for a GPU) is alive.
    _write(path, age_s=0.5, ready=False, state="waiting_for_gpu")
    assert check("live", path, max_age_s=3)[0]


def test_ready_needs_ready_and_a_fresh_beat(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    _write(path, age_s=0.5, ready=True)
    assert check("ready", path, max_age_s=3)[0]
    _write(path, age_s=0.5, ready=False, state="starting")
    passed, why = check("ready", path, max_age_s=3)
    assert not passed
    assert "starting" in why
    _write(path, age_s=10, ready=True)  # ready once, but the heartbeat stopped
    assert not check("ready", path, max_age_s=3)[0]


@pytest.mark.parametrize(
    "content",
    [
        "",
        "{",
        "[]",
        '{"state": "idle", "ready": "yes", "beat_unix": 1, "name": "w"}',
        '{"state": "idle", "ready": true, "beat_unix": "now", "name": "w"}',
        '{"state": "idle", "ready": true, "beat_unix": true, "name": "w"}',
        '{"state": "idle", "ready": true, "name": "w"}',
    ],
)
def test_a_broken_file_fails_both_probes(tmp_path: Path, content: str) -> None:
    path = tmp_path / "health.json"
    path.write_text(content)
    for mode in ("live", "ready"):
        passed, why = check(mode, path, max_age_s=3600)
        assert not passed
        assert "unreadable" in why


def test_a_missing_file_fails_both_probes(tmp_path: Path) -> None:
    for mode in ("live", "ready"):
        passed, why = check(mode, tmp_path / "absent.json", max_age_s=3600)
        assert not passed
        assert "no health file" in why


def test_main_takes_the_path_and_max_age_from_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "health.json"
    _write(path, age_s=20)
    assert main(["live", "--file", str(path), "--max-age-s", "30"]) == 0
    assert main(["live", "--file", str(path), "--max-age-s", "10"]) == 1
    assert "last heartbeat" in capsys.readouterr().out


def _probe(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m worker.probe` as Kubernetes runs it: settings from GPULANE_* only."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPULANE_")}
    clean["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "worker.probe", *args],
        env={**clean, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_command_reads_the_health_file_setting_and_the_heartbeat(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    _write(path, age_s=0)
    # Default heartbeat 1 s: the default max age is 3 s.
    assert _probe("live", GPULANE_HEALTH_FILE=str(path)).returncode == 0
    assert _probe("ready", GPULANE_HEALTH_FILE=str(path)).returncode == 0
    _write(path, age_s=4, ready=True)
    stale = _probe("live", GPULANE_HEALTH_FILE=str(path))
    assert stale.returncode == 1
    assert "max 3 s" in stale.stdout
    assert _probe("ready", GPULANE_HEALTH_FILE=str(path)).returncode == 1
    # A slower heartbeat stretches the default: 3 x 10 s (the file is 4 s old and more
    # by now: far inside it, however slow the probes above were to start).
    slow = {"GPULANE_HEARTBEAT_INTERVAL_S": "10", "GPULANE_LEASE_TTL_S": "30"}
    assert _probe("live", GPULANE_HEALTH_FILE=str(path), **slow).returncode == 0
    _write(path, age_s=0, ready=False, state="starting")
    assert _probe("live", GPULANE_HEALTH_FILE=str(path)).returncode == 0
    not_ready = _probe("ready", GPULANE_HEALTH_FILE=str(path))
    assert not_ready.returncode == 1
    assert "not ready: state starting" in not_ready.stdout


def test_the_command_fails_without_a_health_file_setting(tmp_path: Path) -> None:
    result = _probe("live")
    assert result.returncode == 1
    assert "GPULANE_HEALTH_FILE" in result.stdout
    assert _probe("live", GPULANE_HEALTH_FILE=str(tmp_path / "none.json")).returncode == 1
    assert _probe("bogus").returncode == 2


def test_a_real_worker_passes_its_probes_until_it_stops(
    tmp_path: Path, start_worker: WorkerFactory
) -> None:
    """A serving worker with GPULANE_HEALTH_FILE is live and ready; once it has stopped
    it is neither."""
    path = tmp_path / "health.json"
    worker = start_worker(env={"GPULANE_HEALTH_FILE": str(path)})  # returns once serving
    wait_for(path.exists, 10, what="the first health file")
    env = {
        "GPULANE_HEALTH_FILE": str(path),
        # The probe's own max age (3 x its heartbeat), not the worker's: 3 s leaves a
        # one-shot probe room on a loaded machine; the worker rewrites every 0.2 s.
        "GPULANE_HEARTBEAT_INTERVAL_S": "1",
        "GPULANE_LEASE_TTL_S": "3",
    }
    assert read_health(path).name == worker.name
    wait_for(lambda: _probe("ready", **env).returncode == 0, 10, what="the ready probe")
    assert _probe("live", **env).returncode == 0
    assert worker.terminate() == 0
    wait_for(lambda: _probe("live", **env).returncode == 1, 10, what="the live probe to fail")
    assert _probe("ready", **env).returncode == 1
