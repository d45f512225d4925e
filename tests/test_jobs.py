"""The stored call: one fixed entry point, JSON only, anything else refused."""

from __future__ import annotations

import json
import pickle
import zlib

import pytest

from dispatcher.contract.jobs import (
    ENTRY_POINT,
    CallRefused,
    FileMeta,
    decode_call,
    encode_call,
    iso_ms,
)


def test_round_trip() -> None:
    meta = FileMeta("a.pdf", "application/pdf", 10)
    call = decode_call(encode_call("document.extract", {"max_pages": 2}, meta))
    assert (call.task_type, call.args, call.file) == ("document.extract", {"max_pages": 2}, meta)
    payload = json.loads(zlib.decompress(encode_call("echo", {})))
    assert payload == [ENTRY_POINT, None, ["echo", {}], {}]  # what RQ's JSONSerializer reads


def test_entry_points_resolve_to_the_refusing_function() -> None:
    # What RQ's import_attribute would find for the tag and for older jobs' name.
    import importlib

    from dispatcher.contract.jobs import LEGACY_ENTRY_POINTS

    for entry in (ENTRY_POINT, *LEGACY_ENTRY_POINTS):
        module, _, name = entry.rpartition(".")
        assert callable(getattr(importlib.import_module(module), name)), entry


@pytest.mark.parametrize(
    ("text", "window"), [("hi", 512), ("h" * 300, 1024), ("x" * 3000, 4096), ("y" * 99_000, 32768)]
)
def test_a_call_is_compressed_with_the_window_its_size_needs(text: str, window: int) -> None:
    """zlib's default window and memory (about 256 KB of state set up per call) cost a
    small call ten times its compression; the window sized to the call (and the 262
    bytes deflate cannot reach) is written in the stream's header (CINFO), and any
    zlib reader (RQ's) inflates it."""
    data = encode_call("embed", {"text": text})
    assert data[0] & 0x0F == zlib.DEFLATED and 1 << ((data[0] >> 4) + 8) == window
    assert json.loads(zlib.decompress(data))[2] == ["embed", {"text": text}]
    assert decode_call(data).args == {"text": text}


@pytest.mark.parametrize(
    "data",
    [
        zlib.compress(json.dumps(["os.system", None, ["rm -rf /"], {}]).encode()),
        zlib.compress(json.dumps([ENTRY_POINT, "obj", ["echo", {}], {}]).encode()),
        zlib.compress(json.dumps([ENTRY_POINT, None, ["echo"], {}]).encode()),
        zlib.compress(json.dumps([ENTRY_POINT, None, ["echo", {}], {"shell": True}]).encode()),
        zlib.compress(
            json.dumps([ENTRY_POINT, None, ["echo", {}], {"file": {"name": 1}}]).encode()
        ),
        zlib.compress(pickle.dumps(("os.system", None, ("id",), {}))),
        b"not even compressed",
    ],
)
def test_refuses_anything_else(data: bytes) -> None:
    with pytest.raises(CallRefused):
        decode_call(data)


def test_refuses_decompression_bombs() -> None:
    bomb = zlib.compress(b"[" + b" " * (80 * 1024 * 1024) + b"]")
    with pytest.raises(CallRefused, match="larger"):
        decode_call(bomb)


def test_iso_ms() -> None:
    assert iso_ms(0) == "1970-01-01T00:00:00.000Z"
    assert iso_ms(1_764_694_133_123) == "2025-12-02T16:48:53.123Z"
    assert iso_ms(None) is None


def test_the_scripts_final_set_is_the_one_table() -> None:
    # Lua's FINAL is generated from FINAL_STATUSES, once, ahead of every script.
    from dispatcher.contract.jobs import FINAL_STATUSES, lua_statuses
    from dispatcher.contract.scripts import source

    generated = lua_statuses()
    assert all(f"{status} = true" in generated for status in FINAL_STATUSES)
    assert generated.count("= true") == len(FINAL_STATUSES) == 4  # stopped included
    for name in ("finish", "cancel", "get"):
        assert source(name).count("local FINAL =") == 1
