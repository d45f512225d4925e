"""A task that splits into parts (fan-out / fan-in), as the worker, the scripts and the
API all see it (``docs/design.md`` §4, "Tasks that split into parts").

A handler may return ``ctx.map(type, items, ...)``: its task (the *parent*) then runs
as *parts*, one child task per item, queued in the parent's class, for its tenant,
leased and retried each on its own. Each part's result is stored as one entry list in
``gpulane:parts:<parent>``; when the last part succeeds the parent succeeds, its
result the parent's own fields plus the parts' lists concatenated in order under one
key (``merge``). A part that fails fails the parent (its error named) and cancels the
others; canceling the parent cancels its parts.

Parent hash fields: ``parts`` (how many), ``left`` (not yet succeeded), ``entries``
(entries stored so far), ``pbytes`` (their JSON bytes), ``merge`` (the merged list's
key), ``flatten`` (``1``: each part's result holds a list at ``merge``, concatenated;
``0``: each part's result is one entry), ``first`` (the number of the first entry, for
``?pages=``), ``psum`` (the parts' progress fractions summed), and ``result``: the
parent's own fields, written at the split. A part's: ``parent``, ``part`` (its index),
``merge`` and ``flatten`` (the parent's), ``pf`` (its last progress fraction).

The parts hash: field ``<k>`` holds part k's entries as a JSON list, ``n:<k>`` how many.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "MAX_PARTS",
    "PART_SEPARATOR",
    "RANGE_PATTERN",
    "EntryRange",
    "lua_part_id",
    "parse_range",
    "part_id",
]

# Parts one task may split into: each is a record, a claim and a report, and the
# parent's cancel walks them all in one script.
MAX_PARTS = 1000

# A part's id is its parent's, this, and its index: letters, digits and dashes only,
# as RQ's job ids, and never mistaken for a chunk item's `<chunk>.<k>`.
PART_SEPARATOR = "-p"

# An entry (page) range as a client writes it: "7" or "1-100", 1-based, inclusive.
RANGE_PATTERN = r"^[1-9][0-9]{0,6}(-[1-9][0-9]{0,6})?$"
_RANGE = re.compile(RANGE_PATTERN)


def part_id(parent: str, index: int) -> str:
    return f"{parent}{PART_SEPARATOR}{index}"


def lua_part_id() -> str:
    """The same id in Lua, generated into every script's prelude."""
    return f"local function part_id(p, k) return p .. '{PART_SEPARATOR}' .. k end\n"


@dataclass(frozen=True)
class EntryRange:
    """Entries ``first`` to ``last``, inclusive, as numbered by their task (pages)."""

    first: int
    last: int

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"

    @property
    def count(self) -> int:
        return self.last - self.first + 1


class BackwardRange(ValueError):
    """A well-formed range that ends before it starts: no result can satisfy it."""


def parse_range(text: str) -> EntryRange:
    """``"7"`` or ``"1-100"``; ValueError with a message a client can act on
    (:class:`BackwardRange` for ``"8-4"``)."""
    if not _RANGE.fullmatch(text):
        raise ValueError(f"a range is a number or two joined by '-', such as 1-100; got {text!r}")
    first, _, last = text.partition("-")
    out = EntryRange(int(first), int(last or first))
    if out.last < out.first:
        raise BackwardRange(f"range {text!r} ends before it starts")
    return out
