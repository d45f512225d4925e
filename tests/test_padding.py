"""``worker.padding``: a model batch split into passes of like lengths, and the pass
cost it is split by (pure functions; the real model's passes: ``test_embed.py``)."""

from __future__ import annotations

import itertools
import random

import pytest

from worker import padding


def _cost(parts: list[list[int]], lengths: list[int], pass_tokens: float) -> float:
    return sum(pass_tokens + len(part) * max(lengths[i] for i in part) for part in parts)


def _cheapest(lengths: list[int], pass_tokens: float) -> float:
    """Every way to cut the longest-first order into contiguous parts, by brute force."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    best = float("inf")
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        parts, part = [], [order[0]]
        for i, cut in zip(order[1:], cuts, strict=True):
            if cut:
                parts.append(part)
                part = []
            part.append(i)
        parts.append(part)
        best = min(best, _cost(parts, lengths, pass_tokens))
    return best


def test_like_lengths_run_as_one_pass_in_batch_order() -> None:
    assert padding.by_length([20, 22, 18, 21] * 16, 40.0) == [list(range(64))]
    assert padding.by_length([200, 10], 1e9) == [[0, 1]]  # a pass dearer than the padding
    assert padding.by_length([200, 10, 20], float("inf")) == [[0, 1, 2]]  # never split
    assert padding.by_length([7], 8.0) == [[0]]
    assert padding.by_length([], 8.0) == [[]]


def test_mixed_lengths_split_longest_first_ties_in_batch_order() -> None:
    lengths = [10, 200, 12, 198, 10, 200]
    assert padding.by_length(lengths, 8.0) == [[1, 5, 3], [2, 0, 4]]


def test_a_split_must_save_more_than_a_tenth() -> None:
    """At 8 tokens a pass: [16, 4] as one pass costs 40, split 36 (a tenth saved, not
    more): one pass. [40, 4, 4] costs 128 as one, 64 split (half saved): split."""
    assert padding.MIN_SAVING == 0.1
    assert padding.by_length([16, 4], 8.0) == [[0, 1]]
    assert padding.by_length([17, 4], 8.0) == [[0], [1]]  # 37 against 42: more than a tenth
    assert padding.by_length([40, 4, 4], 8.0) == [[0], [1, 2]]
    # 64 rows of 20 and 2 of 22: 1,460 as one pass, 1,340 split (8 %): one pass; with
    # 2 of 30, 1,988 against 1,356 (32 %): split.
    assert padding.by_length([20] * 64 + [22] * 2, 8.0) == [list(range(66))]
    assert padding.by_length([20] * 64 + [30] * 2, 8.0) == [[64, 65], list(range(64))]


@pytest.mark.parametrize("seed", range(40))
def test_the_split_is_the_cheapest_or_saves_too_little(seed: int) -> None:
    """Against brute force over every contiguous cut of the sorted order: a split is
    the cheapest there is; one pass means no split saves ``MIN_SAVING`` of its cost.
    Every index is in exactly one part, each part longest first."""
    rng = random.Random(seed)
    lengths = [
        rng.choice([rng.randint(3, 30), rng.randint(3, 256)]) for _ in range(rng.randint(2, 11))
    ]
    pass_tokens = rng.choice([8.0, 40.0, 300.0, 3000.0])
    parts = padding.by_length(lengths, pass_tokens)
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    best, one = (
        _cheapest(lengths, pass_tokens),
        _cost([list(range(len(lengths)))], lengths, pass_tokens),
    )
    if len(parts) == 1:
        assert best >= (1 - padding.MIN_SAVING) * one
    else:
        assert _cost(parts, lengths, pass_tokens) == pytest.approx(best)
        for part in parts:
            assert [lengths[i] for i in part] == sorted((lengths[i] for i in part), reverse=True)


def test_pass_cost_is_the_fixed_time_over_the_time_per_token() -> None:
    """A device whose pass takes 5 ms plus 0.1 ms a token: the fixed cost is 50 tokens'
    worth. The doubling stops once the tokens dominate; the result is clamped."""
    seen: list[tuple[int, int]] = []

    def cpu(rows: int, length: int) -> float:
        seen.append((rows, length))
        return 0.005 + 0.0001 * rows * length

    assert padding.measure_pass_tokens(cpu) == pytest.approx(50.0)
    assert max(rows for rows, _ in seen) == 8  # 8 x 64 tokens: 56 ms, over 4 x 5.8 ms
    assert seen[0] == (8, 64)  # warmed up before the lone text is timed

    def gpu(rows: int, length: int) -> float:  # 2 ms a pass, 0.5 us a token
        return 0.002 + 5e-7 * rows * length

    assert padding.measure_pass_tokens(gpu) == pytest.approx(4000.0)
    largest: list[int] = []

    def flat(rows: int, length: int) -> float:  # the tokens never dominate: the cap
        largest.append(rows)
        return 0.001

    assert padding.measure_pass_tokens(flat) == padding.MAX_PASS_TOKENS
    assert max(largest) == padding.MAX_ROWS
    assert (
        padding.measure_pass_tokens(lambda rows, length: rows * length) == padding.MIN_PASS_TOKENS
    )
