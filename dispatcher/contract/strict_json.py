"""JSON as gpulane takes it from clients (the API, ``gpulane submit``): ``NaN``,
``Infinity`` and numbers past a double's range (``1e999``) are not numbers a task, a
record or Redis could carry back, so they are refused, never turned into floats.

:func:`loads_strict` parses them to :class:`NonFinite` markers, so the API can say
where in a request one sits (``dispatcher.api.submission.check_value``);
:func:`loads_finite` refuses them at once, for callers that only need yes or no.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["NonFinite", "loads_finite", "loads_strict", "number"]


class NonFinite:
    """What ``NaN``, ``Infinity``, ``-Infinity`` and numbers past float's range parse
    to: the text that was sent, for the message refusing it."""

    def __init__(self, text: str) -> None:
        self.text = text


def number(text: str) -> float | NonFinite:
    """A JSON number with a fraction or exponent (or a form field's text); one past
    float's range would be an infinity."""
    value = float(text)
    return value if math.isfinite(value) else NonFinite(text)


def loads_strict(text: str | bytes) -> Any:
    """JSON with non-finite numbers as :class:`NonFinite` markers. Raises ValueError (or
    RecursionError) for what is not JSON at all."""
    return json.loads(text, parse_constant=NonFinite, parse_float=number)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a number a task can carry")
    return value


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads_finite(text: str | bytes) -> Any:
    """JSON with non-finite numbers refused: ValueError saying which."""
    return json.loads(text, parse_constant=_refuse, parse_float=_finite)
