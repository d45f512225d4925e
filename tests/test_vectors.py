"""Packed vectors (``dispatcher.contract.vectors``): OpenAI's base64 of little-endian
float32, written by the worker and read by the API; and the catalog's reading of which
types take ``encoding_format``."""

from __future__ import annotations

import base64
import json
import struct

import pytest

from dispatcher.api.task_types import _parse
from dispatcher.contract import vectors


def test_a_packed_vector_is_openais_little_endian_float32_and_unpacks_to_the_same_floats() -> None:
    values = [0.1, -2.5, 3.0e-8, 1.0, -0.0, 65504.0]
    packed = vectors.pack_floats(values)
    raw = base64.b64decode(packed)
    as_f32 = list(struct.unpack(f"<{len(values)}f", raw))  # what a client decodes
    assert vectors.unpack(packed) == as_f32
    assert as_f32 == pytest.approx(values, rel=1e-7)
    assert vectors.pack(raw) == packed
    assert [vectors.dimensions(vectors.pack_floats([1.0] * n)) for n in (1, 2, 3, 384)] == [
        1,
        2,
        3,
        384,
    ]
    assert vectors.dimensions([1.0, 2.0]) == 2


@pytest.mark.parametrize("bad", ["abc", "AAAA", "AA==", "AAAAAAA="])
def test_a_length_that_cannot_be_whole_float32s_is_refused(bad: str) -> None:
    with pytest.raises(vectors.VectorError):
        vectors.dimensions(bad)


@pytest.mark.parametrize("bad", ["!!!!!!!!", "AAA", "AAAAAAA=", "AAAA AAA"])
def test_unpacking_refuses_what_is_not_base64_of_whole_float32s(bad: str) -> None:
    with pytest.raises(vectors.VectorError):
        vectors.unpack(bad)


def _entry(properties: dict[str, object]) -> bytes:
    schema = {"type": "object", "properties": properties}
    return json.dumps({"schema": schema, "model": "m"}).encode()


@pytest.mark.parametrize(
    ("field", "packs"),
    [
        ({"enum": ["float", "base64"], "type": "string"}, True),
        ({"const": "base64"}, True),
        ({"enum": ["float"]}, False),
        ({"type": "string"}, False),
        (None, False),
    ],
)
def test_a_type_is_asked_for_base64_only_where_its_args_take_it(
    field: dict[str, object] | None, packs: bool
) -> None:
    properties: dict[str, object] = {"text": {"type": "string"}}
    if field is not None:
        properties["encoding_format"] = field
    info = _parse("t", _entry(properties))
    assert info is not None and info.packs_base64 is packs
