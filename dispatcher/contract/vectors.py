"""Embedding vectors as OpenAI's ``encoding_format: "base64"`` packs them: base64 of
little-endian float32, the one packing the worker writes and the API reads.

Why a task result may hold a vector this way: a chunk of 64 vectors of 384 floats is
about 500 KB as JSON numbers and 130 KB packed, and on 2 CPU cores writing it cost the
worker 1.5 ms (``tolist`` and orjson) against 0.3 ms packed, and reading it back cost
the API 0.9 ms against 0.06 ms: on a GPU, as long as the forward pass itself. Packed,
the API answers a base64 client (the official SDK's default) without unpacking.

The float32 values are the model's own, so unpacking gives exactly the floats
``tolist()`` gives: a client asking for ``float`` reads the same numbers either way.
"""

from __future__ import annotations

import array
import base64
import binascii
import math
import sys
from collections.abc import Sequence
from typing import Literal

__all__ = [
    "BASE64",
    "FLOAT",
    "EncodingFormat",
    "VectorError",
    "check_floats",
    "dimensions",
    "pack",
    "pack_floats",
    "unpack",
]

EncodingFormat = Literal["float", "base64"]  # OpenAI's encoding_format, in request models
FLOAT: EncodingFormat = "float"
BASE64: EncodingFormat = "base64"

_LITTLE = sys.byteorder == "little"


class VectorError(ValueError):
    """A packed vector that is not base64 of whole float32 values."""


def pack(little_endian_f32: bytes) -> str:
    """Base64 of float32 bytes already in little-endian order (numpy ``astype("<f4")``)."""
    return base64.b64encode(little_endian_f32).decode("ascii")


def check_floats(values: Sequence[float]) -> array.array[float]:
    """``values`` as float32, or VectorError unless they are one or more numbers, each
    finite as a float32 (1e39 would pack as inf: a base64 client would read another
    number than a float client)."""
    try:
        packed = array.array("f", values)
    except (TypeError, ValueError, OverflowError) as exc:
        raise VectorError(f"not a list of numbers: {exc}") from None
    _check(packed)
    return packed


def pack_floats(values: Sequence[float]) -> str:
    """Base64 of ``values`` as little-endian float32 (checked: :func:`check_floats`)."""
    packed = check_floats(values)
    if not _LITTLE:
        packed.byteswap()
    return pack(packed.tobytes())


def _check(values: array.array[float]) -> None:
    # A sum of float32 values cannot overflow a double: inf or NaN here is one of them.
    if not values or not math.isfinite(sum(values)):
        what = "no values" if not values else "a value that is NaN or inf"
        raise VectorError(f"the vector holds {what}")


def _raw(text: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise VectorError(f"not base64: {exc}") from None
    if len(raw) % 4:
        raise VectorError(f"{len(raw)} bytes are not whole float32 values")
    return raw


def unpack(text: str) -> list[float]:
    """The floats of a packed vector, or VectorError (not base64 of one or more finite
    float32 values)."""
    values = array.array("f", _raw(text))
    if not _LITTLE:
        values.byteswap()
    _check(values)
    return values.tolist()


def dimensions(vector: str) -> int:
    """How many values a packed vector holds, from its length alone: VectorError where
    that length cannot be base64 of one or more whole float32 values.
    Its characters and values are checked where it is unpacked; passed through to a
    base64 client, a bad one fails that client's decoding, loudly (decoding every vector
    to check it would cost the API ~5 us per vector, 10 ms per call of 2,048, on 2 CPU
    cores). The worker that packs checks its values are finite (``worker.tasks.embed``)."""
    padding = len(vector) - len(vector.rstrip("="))
    size = len(vector) * 3 // 4 - padding
    if not vector or len(vector) % 4 or padding > 2 or size % 4:
        raise VectorError(f"{len(vector)} characters are not base64 of whole float32 values")
    return size // 4
