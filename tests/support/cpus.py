"""Reading the `taskset -c` list form a CPU worker reports as its device's `cpus`,
parsed here rather than by the code under test (dispatcher.contract.cpus writes it)."""

from __future__ import annotations


def cpu_set(text: str) -> set[int]:
    """``0-1,3`` -> {0, 1, 3}."""
    out: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out
