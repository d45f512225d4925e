"""Forward passes of like lengths: a model batch split where padding costs more than a pass.

A text model pads a batch to its longest input, so a batch of single inputs of mixed
lengths (32 clients sending one chunk each, 10-200 tokens) spends most of its forward
pass on padding: on 2 CPU cores batches of 32 and 64 such texts ran at 23-27 texts/s as
one pass, 48-50/s as passes of like lengths (this module's cut). ``/v1/embeddings``
already packs one request's inputs longest first (``dispatcher/api/routes/openai.py``);
this is the same idea for a batch that the worker put together from many requests.

The cost of a pass is modelled as ``pass_tokens + rows * longest``: a fixed cost per
pass (kernel launches, Python dispatch), in tokens' worth of work, plus the padded
tokens. :func:`measure_pass_tokens` measures the fixed cost on a GPU once at load (it
should be thousands of tokens there), so a GPU splits only where a batch's padding is
thousands of tokens; a CPU's is :data:`CPU_PASS_TOKENS`, and it splits wherever that
saves work. Attention's cost grows with the square of the length, so the model undercounts what
long padding costs: it errs towards one pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["CPU_PASS_TOKENS", "by_length", "measure_pass_tokens"]

# Bounds on a measured pass cost: a noisy timing changes how batches split, never more.
MIN_PASS_TOKENS = 8.0
MAX_PASS_TOKENS = 65_536.0
# The cost model is a model (a small pass does less per token than it says): a split
# must save this share of one pass's modelled cost, or the batch runs as one pass.
MIN_SAVING = 0.1
# The calibration's largest batch: 256 texts of 64 tokens, a served batch's tokens at
# most (64 texts of 256), so it reserves no device memory a real batch would not.
MAX_ROWS = 256
# A CPU's pass cost, not measured at load: all-MiniLM-L6-v2 on 2 cores measured 39-63
# tokens at five loads. On a CPU only batches of mixed lengths split, whose padding is
# hundreds of tokens a row, so tens more or less change little; a GPU's is unknown by
# orders of magnitude and is measured. The measurement also seemed to leave a CPU
# worker 2-7 % slower on like lengths (noisy: design §9), which this avoids.
CPU_PASS_TOKENS = 48.0


def by_length(lengths: Sequence[int], pass_tokens: float) -> list[list[int]]:
    """The batch's indices grouped into forward passes, cheapest in the cost model.

    One pass, in the batch's own order, unless splitting saves more than
    :data:`MIN_SAVING` of its cost; like lengths (the common case) are decided in one
    sum, since no split can save more than the padding less a pass. Otherwise the
    indices longest first (ties in batch order), cut into contiguous parts by dynamic
    programming over the distinct lengths: O(D^2) for D distinct lengths, at most the
    batch's size (64 for ``embed``) and the model's window (256)."""
    n = len(lengths)
    one = [list(range(n))]
    if n < 2:
        return one
    one_cost = pass_tokens + n * max(lengths)
    if n * max(lengths) - sum(lengths) - pass_tokens <= MIN_SAVING * one_cost:
        return one
    order = sorted(range(n), key=lambda i: -lengths[i])
    widths: list[int] = []  # distinct lengths, longest first
    ends: list[int] = []  # ends[k]: how many indices are as long as widths[k] or longer
    for position, i in enumerate(order, start=1):
        if widths and widths[-1] == lengths[i]:
            ends[-1] = position
        else:
            widths.append(lengths[i])
            ends.append(position)
    cost, cuts = _cheapest_cuts(widths, ends, pass_tokens)
    if cost >= (1 - MIN_SAVING) * one_cost:  # saves no more than the early exit allows
        return one
    return [order[start:end] for start, end in zip([0, *cuts[:-1]], cuts, strict=True)]


def _cheapest_cuts(
    widths: list[int], ends: list[int], pass_tokens: float
) -> tuple[float, list[int]]:
    """The least total cost, and where its parts end (positions in the sorted order).
    ``best[j]``: the cheapest passes over the first ``j`` groups; a part over groups
    ``i..j-1`` pads to ``widths[i]``, its longest."""
    groups = len(widths)
    best = [0.0] + [float("inf")] * groups
    start_of = [0] * (groups + 1)
    for j in range(1, groups + 1):
        for i in range(j):
            first = ends[i - 1] if i else 0
            cost = best[i] + pass_tokens + (ends[j - 1] - first) * widths[i]
            if cost < best[j]:
                best[j], start_of[j] = cost, i
    cuts: list[int] = []
    j = groups
    while j:
        cuts.append(ends[j - 1])
        j = start_of[j]
    return best[groups], cuts[::-1]


def measure_pass_tokens(run: Callable[[int, int], float], repeats: int = 3) -> float:
    """A pass's fixed cost in tokens' worth of work on the model's device.

    ``run(rows, length)`` makes one forward pass over ``rows`` texts of ``length``
    tokens and returns the seconds it took until its output was on the host (a GPU's
    work included, the inputs' making not). The lone short text's time is the fixed
    cost; the per-token cost comes from batches of 64-token texts doubled until one
    takes four times the lone text's (where the tokens, not the fixed cost, dominate:
    8 rows on a CPU, hundreds on a GPU; :data:`MAX_ROWS` at most). Each timing is the
    least of ``repeats``, after a few passes that warm the device up (a GPU's clocks
    rise under load: a cold lone text would count as a dear pass)."""
    for _ in range(repeats):
        run(8, 64)
    lone = _least(run, 1, 8, repeats)
    rows, length = 8, 64
    full = _least(run, rows, length, repeats)
    while full < 4 * lone and rows < MAX_ROWS:
        rows *= 2
        full = _least(run, rows, length, repeats)
    per_token = max(full - lone, 1e-9) / (rows * length - 8)
    fixed = lone / per_token - 8  # the lone text's own 8 tokens are not the pass's
    return min(max(fixed, MIN_PASS_TOKENS), MAX_PASS_TOKENS)


def _least(run: Callable[[int, int], float], rows: int, length: int, repeats: int) -> float:
    return min(run(rows, length) for _ in range(repeats))
