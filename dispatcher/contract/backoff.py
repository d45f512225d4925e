"""Capped exponential backoff with jitter, for every loop that waits on Redis."""

from __future__ import annotations

import random

__all__ = ["Backoff"]


class Backoff:
    """``next()`` returns a delay in [c/2, c) with c = min(cap, initial * 2**n): spread,
    but never a near-zero retry storm; ``reset()`` after success."""

    def __init__(self, initial_s: float = 0.1, cap_s: float = 5.0) -> None:
        self.initial_s = initial_s
        self.cap_s = cap_s
        self.failures = 0

    def next(self) -> float:
        ceiling = min(self.cap_s, self.initial_s * 2**self.failures)
        self.failures += 1
        return random.uniform(ceiling / 2, ceiling)  # noqa: S311 - jitter, not crypto

    def reset(self) -> None:
        self.failures = 0
