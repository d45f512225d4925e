"""CPU shares for `gpulane up`'s CPU workers (dispatcher.contract.cpus), and a child
pinned by the supervisor's preexec hook really running on its share."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dispatcher.contract import cpus
from dispatcher.ops.supervisor import _child_setup


@pytest.mark.parametrize(
    ("given", "count", "expected"),
    [
        ([0, 1], 2, [[0], [1]]),
        ([0, 1, 2, 3, 4, 5, 6, 7], 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),  # the larger share first
        ([0, 1, 2, 3, 4, 5, 6], 3, [[0, 1, 2], [3, 4], [5, 6]]),
        ([2, 3, 8, 9], 2, [[2, 3], [8, 9]]),  # a cpuset's own numbers, in order
        ([0, 1], 3, [[0], [1], [0]]),  # more workers than CPUs: one each, round-robin
        ([5], 2, [[5], [5]]),
        ([0, 1, 2, 3], 1, [[0, 1, 2, 3]]),
    ],
)
def test_shares_split_the_cpus_among_the_workers(
    given: list[int], count: int, expected: list[list[int]]
) -> None:
    got = cpus.shares(given, count)
    assert got == expected
    assert sorted({c for share in got for c in share}) == given  # every CPU used


@pytest.mark.parametrize(("given", "count"), [([], 2), ([0, 1], 0)])
def test_shares_refuse_nothing_to_share(given: list[int], count: int) -> None:
    with pytest.raises(ValueError, match="at least one CPU"):
        cpus.shares(given, count)


@pytest.mark.parametrize(
    ("given", "text"),
    [([0], "0"), ([0, 1, 2, 3], "0-3"), ([8, 0, 1, 3, 10, 11], "0-1,3,8,10-11"), ([4, 4], "4")],
)
def test_describe_writes_the_taskset_list_form(given: list[int], text: str) -> None:
    assert cpus.describe(given) == text


def test_a_child_pinned_by_the_supervisor_runs_on_its_share_only() -> None:
    """The preexec hook pins before exec: the child's own affinity, and what torch's
    and numpy's thread pools would count (``os.sched_getaffinity``), is its share."""
    share, before = cpus.allowed()[-1:], os.sched_getaffinity(0)
    probe = "import os; print(sorted(os.sched_getaffinity(0)))"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        preexec_fn=_child_setup(share),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(share)
    assert os.sched_getaffinity(0) == before  # pinned in the child, not in this process
