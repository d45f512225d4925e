"""How far a PDF inflates, measured before the PDF library decodes it.

A small PDF can hold a Flate stream that inflates a thousandfold (a 1 MB file that
decodes to 1 GB drove a worker to 2.1 GB RSS). :func:`check_inflation` inflates each
Flate stream in bounded slices, keeping nothing, and stops as soon as one stream or
the whole file passes its limit, so the check itself costs little memory, and time
only up to the limit.
"""

from __future__ import annotations

import re
import zlib

__all__ = ["MAX_STREAM_BYTES", "MAX_TOTAL_BYTES", "check_inflation"]

MiB = 1024 * 1024
MAX_STREAM_BYTES = 256 * MiB  # one decoded stream (a page's content, an object stream)
MAX_TOTAL_BYTES = 1024 * MiB  # all Flate streams of one document together
_IN_SLICE = 64 * 1024
_OUT_SLICE = 4 * MiB
_STREAM = re.compile(rb"(?<!end)stream\r?\n")


def _inflated_size(data: memoryview, start: int, limit: int) -> int:
    """Bytes the zlib stream at ``start`` inflates to, counting at most past ``limit``;
    0 when it is not a zlib stream (another filter, or none)."""
    inflater = zlib.decompressobj()
    size = 0
    pos = start
    try:
        while not inflater.eof and pos < len(data) and size <= limit:
            out = inflater.decompress(data[pos : pos + _IN_SLICE], _OUT_SLICE)
            pos += _IN_SLICE
            size += len(out)
            while inflater.unconsumed_tail and not inflater.eof and size <= limit:
                out = inflater.decompress(inflater.unconsumed_tail, _OUT_SLICE)
                if not out:  # no progress: never spin on hostile input
                    break
                size += len(out)
    except zlib.error:
        return size
    return size


def check_inflation(
    data: bytes, per_stream: int = MAX_STREAM_BYTES, total: int = MAX_TOTAL_BYTES
) -> str | None:
    """None when every Flate stream stays within the limits, else why not."""
    view = memoryview(data)
    spent = 0
    for match in _STREAM.finditer(data):
        size = _inflated_size(view, match.end(), min(per_stream, total - spent))
        if size > per_stream:
            return f"a stream inflates past {per_stream // MiB} MiB"
        spent += size
        if spent > total:
            return f"its streams inflate past {total // MiB} MiB in all"
    return None
