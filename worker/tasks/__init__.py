"""Task modules shipped with gpulane (``--tasks worker.tasks.builtin`` is the default)."""

__all__: list[str] = []
