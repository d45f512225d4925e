"""OCR for scanned pages: RapidOCR (PP-OCRv4 detection and recognition as ONNX) on
onnxruntime, used by ``document.extract`` for a page without a text layer.

Why RapidOCR: its package ships the weights (nothing downloads at run time), it runs
on onnxruntime's CPU provider everywhere and on its CUDA provider where
``onnxruntime-gpu`` is installed, and it needs no Paddle or torch. Install it with the
``ocr`` extra (``pip install 'gpulane[ocr]'``); without it a page that needs OCR fails
its task with ``ocr_unavailable`` instead of coming back silently empty.

The engine loads on the first page that needs it, once per worker process, on the
worker's device: the CUDA provider when the worker is pinned to a GPU and onnxruntime
offers it (:func:`providers`), else the CPU with as many threads as the process may
run on (``taskset``, a container's cpuset), so workers sharing a CPU host can be given
their own cores rather than all of them oversubscribing every core.
"""

from __future__ import annotations

import os
import threading
import unicodedata
from dataclasses import dataclass
from typing import Any

__all__ = ["DPI", "Line", "OcrUnavailable", "lines", "ocr_page", "providers"]

# 200 dpi: PP-OCR reads body text (9-12 pt) reliably from ~150 dpi up; 300 dpi costs
# twice the pixels for no accuracy on such text. The long side is capped at the size
# RapidOCR would shrink it to anyway (its max_side_len), so rendering spends nothing
# on pixels the detector throws away.
DPI = 200
MAX_SIDE_PX = 2000
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"

_lock = threading.Lock()
_engines: dict[bool, Any] = {}  # use the GPU? -> the RapidOCR engine, once loaded


class OcrUnavailable(RuntimeError):
    """The OCR engine cannot run here (the ``ocr`` extra is not installed)."""


def providers(device_kind: str, available: list[str]) -> list[str]:
    """onnxruntime providers for a worker on a ``device_kind`` ("gpu" or "cpu") device,
    in preference order: CUDA first only on a GPU worker whose onnxruntime has it."""
    if device_kind == "gpu" and CUDA in available:
        return [CUDA, CPU]
    return [CPU]


def _engine(device_kind: str) -> Any:
    """The RapidOCR engine for this process, loaded on first use."""
    try:
        import onnxruntime
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as exc:
        raise OcrUnavailable(
            f"the OCR engine is not installed ({exc.name}); install gpulane[ocr]"
        ) from exc
    gpu = providers(device_kind, onnxruntime.get_available_providers())[0] == CUDA
    with _lock:  # a worker running two parts at once still loads the models once
        if gpu not in _engines:
            _engines[gpu] = RapidOCR(
                det_use_cuda=gpu,
                cls_use_cuda=gpu,
                rec_use_cuda=gpu,
                intra_op_num_threads=len(os.sched_getaffinity(0)),
                print_verbose=False,
            )
        return _engines[gpu]


@dataclass(frozen=True)
class Line:
    """One recognised box: its text and where it sits (pixels, top-left origin)."""

    text: str
    top: float
    bottom: float
    left: float


def lines(boxes: list[Line]) -> str:
    """The boxes as text in reading order: boxes whose vertical extents overlap by
    half the shorter one are one line, left to right, joined by a space; lines top to
    bottom, joined by newlines. (The detector finds words and phrases, not lines.)"""
    rows: list[list[Line]] = []
    for box in sorted(boxes, key=lambda b: (b.top, b.left)):
        row = rows[-1] if rows else None
        if row is not None and _same_row(row, box):
            row.append(box)
        else:
            rows.append([box])
    return "\n".join(" ".join(b.text for b in sorted(row, key=lambda b: b.left)) for row in rows)


def _same_row(row: list[Line], box: Line) -> bool:
    top = min(b.top for b in row)
    bottom = max(b.bottom for b in row)
    overlap = min(bottom, box.bottom) - max(top, box.top)
    return overlap >= 0.5 * min(bottom - top, box.bottom - box.top)


def ocr_page(page: Any, device_kind: str = "cpu") -> str:
    """The text of a pypdfium2 page, read by OCR from its rendering."""
    engine = _engine(device_kind)
    width, height = page.get_size()  # PDF points, 1/72 inch
    scale = min(DPI / 72, MAX_SIDE_PX / max(width, height, 1))
    bitmap = page.render(scale=scale, grayscale=True)
    try:
        image = bitmap.to_numpy()
        found, _elapsed = engine(image)
    finally:
        bitmap.close()
    boxes = [
        Line(
            text=text,
            top=min(y for _x, y in box),
            bottom=max(y for _x, y in box),
            left=min(x for x, _y in box),
        )
        for box, text, _score in (found or [])
    ]
    # NFKC: the PP-OCR recogniser (trained on Chinese and English) writes some Latin
    # punctuation as its full-width forms (U+FF08 for "(", U+FF0C for ","); NFKC
    # folds them to what the page shows.
    return unicodedata.normalize("NFKC", lines(boxes))
