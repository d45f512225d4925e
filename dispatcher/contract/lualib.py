"""The Lua helper libraries (``dispatcher/contract/lua/lib/*.lua``) and which of them a
script carries.

Helpers are split by concern: time and numbers, the doorbell, queued-item counts, fair
share, queueing, fencing, loss and requeue, RQ's worker registry, the reaper. A script
carries only the libraries it uses: those defining a name its text (or an included
library's) mentions, found by name, so a script never declares its needs by hand and
cannot fall out of step with them. Libraries go in the order of :data:`LIBRARIES`,
each after those it uses (Lua resolves a local at its definition).
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

__all__ = ["LIBRARIES", "defined", "libraries_for", "text"]

# In dependency order: each uses only those before it.
LIBRARIES = (
    "base", "doorbell", "counts", "fair", "queue", "runs", "parts", "loss", "rq", "reap",
)  # fmt: skip

_DEFINES = re.compile(r"^local (?:function )?([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)
_NAME = re.compile(r"(?<![.:\w])[A-Za-z_][A-Za-z0-9_]*")  # not a field (K.wake)


@cache
def text(name: str) -> str:
    return (resources.files("dispatcher.contract") / "lua" / "lib" / f"{name}.lua").read_text()


@cache
def defined(name: str) -> frozenset[str]:
    """The top-level names library ``name`` defines (its local functions and constants)."""
    return frozenset(_DEFINES.findall(text(name)))


def _mentions(source: str) -> set[str]:
    code = "\n".join(line.split("--", 1)[0] for line in source.splitlines())  # no comments
    return set(_NAME.findall(code))


def libraries_for(body: str) -> list[str]:
    """The libraries a script of this text needs, in :data:`LIBRARIES` order."""
    wanted: set[str] = set()
    pending = _mentions(body)
    while True:
        more = {lib for lib in LIBRARIES if lib not in wanted and defined(lib) & pending}
        if not more:
            return [lib for lib in LIBRARIES if lib in wanted]
        wanted |= more
        for lib in more:
            pending |= _mentions(text(lib))
