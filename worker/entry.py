"""``worker.entry.run``: the entry point jobs named before the stable tag
``gpulane.run`` (:data:`dispatcher.contract.jobs.ENTRY_POINT`). Jobs still queued from
those versions run as before (:data:`dispatcher.contract.jobs.LEGACY_ENTRY_POINTS`), and
a plain ``rq worker`` calling this gets the same refusal as the tag's."""

from __future__ import annotations

from gpulane import run

__all__ = ["run"]
