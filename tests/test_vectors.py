"""Packed vectors (``dispatcher.contract.vectors``): OpenAI's base64 of little-endian
float32, written by the worker and read by the API; and the catalog's reading of which
types take ``encoding_format``."""

from __future__ import annotations

import array
import base64
import struct

import pytest

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


@pytest.mark.parametrize("bad", ["", "abc", "AAAA", "AA==", "A===", "AAAAAA", "AAAAAAA="])
def test_a_length_that_cannot_be_whole_float32s_is_refused(bad: str) -> None:
    with pytest.raises(vectors.VectorError):
        vectors.dimensions(bad)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "!!!!!!!!",
        "AAA",
        "AAAAAAA=",
        "AAAA AAA",
        vectors.pack(array.array("f", [0.5, float("nan")]).tobytes()),
    ],
)
def test_unpacking_refuses_what_is_not_base64_of_whole_float32s(bad: str) -> None:
    with pytest.raises(vectors.VectorError):
        vectors.unpack(bad)


@pytest.mark.parametrize(
    "bad", [[], ["a"], [None], [1.0, 1e39], [float("inf")], [0.5, float("nan")]]
)
def test_packing_refuses_what_is_not_finite_float32_numbers(bad: list[object]) -> None:
    """1e39 would pack as inf: a base64 client would read another number than a float
    client of the same result."""
    with pytest.raises(vectors.VectorError):
        vectors.pack_floats(bad)  # type: ignore[arg-type]
