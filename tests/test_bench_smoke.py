"""The benchmarks still run: each scenario at ``--smoke`` size (a few seconds each).

Numbers at this size mean nothing; the test only checks that every scenario starts its
processes, measures, and writes its markdown table and chart (``make bench`` runs them
for real).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.scenarios import SCENARIOS  # every scenario the bench runs is smoke-tested

REPO = Path(__file__).resolve().parents[1]


# Seconds a scenario's smoke run may take; documents starts three pools and reads
# pages by OCR on the CPU (about 50 s on 2 idle cores); cpu_share starts three
# `gpulane up`, each loading the embedding model in its workers (about 55 s).
LIMITS_S = {"documents": 170, "cpu_share": 120}


@pytest.mark.parametrize(
    "scenario",
    [pytest.param(s, marks=pytest.mark.timeout(LIMITS_S.get(s, 85) + 5)) for s in SCENARIOS],
)
def test_scenario_smoke(scenario: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench", scenario, "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=LIMITS_S.get(scenario, 85),
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = (tmp_path / f"{scenario}.md").read_text()
    assert report.startswith(f"## {scenario} (smoke)")
    assert "Command: `python -m bench" in report and "cores" in report
    assert "| " in report  # at least one table
    assert (tmp_path / f"{scenario}.png").stat().st_size > 1000
    assert (tmp_path / f"{scenario}.json").exists()
    assert (tmp_path / "summary.md").exists()


def test_mixed_models_reduce_to_balancing_on_equal_speeds() -> None:
    """On workers of one speed the mixed-speed models are balancing's, task for task."""
    from bench import hetero
    from bench import trace as tr

    trace = tr.make_trace(300, 4, 0.9)
    speeds = [1.0] * 4

    def times(tasks: list[tr.Task]) -> list[tuple[float, float, float]]:
        return [(t.created, t.started, t.ended) for t in tasks]

    # Which free worker takes a task differs (lowest index, earliest freed); times do not.
    assert times(hetero.central(trace, speeds, hetero.fastest(speeds))) == times(
        hetero.ideal(trace)
    )
    assert times(hetero.central(trace, speeds, hetero.random_pick(1))) == times(hetero.ideal(trace))
    # (round-robin and least connections on equal speeds: tests/test_bench_models.py)
    slow = hetero.central(trace, [2.0] * 4, hetero.fastest([2.0] * 4))
    assert [t.ended - t.started for t in slow] == pytest.approx([2 * s for s in trace.services])


def test_mixed_doorbell_with_declared_speeds_is_the_ideal() -> None:
    """gpulane's doorbell order (rank from the declared speed, then name) on the mixed
    pool's workers, named slow first, is fastest free first, task for task."""
    from bench import hetero
    from bench.scenarios import mixed

    cfg = mixed.SIZES["quick"]
    trace = mixed.make_trace(cfg, 0.9)
    ideal = hetero.central(trace, cfg.speeds, hetero.fastest(cfg.speeds))
    assert mixed.declared(trace, cfg) == ideal
    assert sorted(cfg.names("pull"))[0].endswith("S1")  # by name alone: slow first


@pytest.mark.timeout(120)
def test_the_benches_driving_the_scripts_still_run() -> None:
    """``bench.redis_cost`` and ``bench.batch_report`` call the Lua scripts directly, so
    a script's changed options break them where no scenario would notice (redis_cost
    went stale that way once): each measures a small run, every figure positive."""
    from bench import batch_report, redis_cost

    cost = redis_cost.measure(200)
    assert all(cost[k] > 0 for k in ("submit_cpu_us", "claim_finish_cpu_us", "batched_cpu_us"))
    assert "| Redis CPU, claim + finish |" in redis_cost.report(cost, 200)
    times = batch_report.measure(1)
    assert set(times) == {"loopback", "relay"}
    assert all(ms > 0 for by_mode in times.values() for ms in by_mode.values())
    assert "| relay |" in batch_report.report(times, 1)
