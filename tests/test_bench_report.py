"""bench/report.py's judged(): the verdict comes from the goal text the targets table
shows, so the two cannot disagree."""

from __future__ import annotations

import pytest

from bench.report import judged


def test_a_bound_is_the_first_number_after_the_comparison() -> None:
    assert judged("p99", "-", 4.2, "<= 5 ms").met is True
    assert judged("p99", "-", 4.2, "<= 5 ms").measured == "4.20 ms"
    assert judged("rate", "-", 1499.0, ">= 1,500/s", digits=0).measured == "1,499/s"
    assert judged("rate", "-", 1499.0, ">= 1,500/s").met is False
    assert judged("memory", "-", 51.0, "<= +50 MB", "+51.0 MB").met is False
    assert judged("speedup", "-", 0.9, ">= 0.8 N, whole", "1.80x", also=False).met is False


def test_within_a_share_of_a_centre() -> None:
    assert judged("split", "-", 2.75, "3 : 1 +- 10 %").measured == "2.75 : 1"
    assert judged("split", "-", 2.65, "3 : 1 +- 10 %").met is False
    assert judged("sum", "-", 1.019, "1 +- 2 %", digits=3).met is True


def test_a_goal_it_cannot_read_is_an_error() -> None:
    with pytest.raises(ValueError, match="cannot read"):
        judged("x", "-", 1.0, "~0.3x")
