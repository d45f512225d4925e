"""OCR for pages without a text layer (``worker/tasks/ocr.py``): scanned pages come back
as text marked ``source: "ocr"``, the ``ocr`` argument decides which pages are read, and
a worker without the ``ocr`` extra fails such a page clearly instead of returning it
empty. Real RapidOCR models on the CPU, real worker processes, real PDFs whose scanned
pages are images rendered from text pages (``support/pdf.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import WorkerFactory, wait_status
from support.pdf import make_scanned_pdf

from bench.scanned import cer
from worker.tasks import ocr

PAGES = [
    "Invoice 2041: total due 1,250.00 EUR",
    "Shipping address: 14 Harbour Road, Leith",
    "The quick brown fox jumps over the lazy dog",
]


def _extract(http: httpx.Client, pdf: bytes, args: str | None = None) -> dict[str, Any]:
    data = {"args": args} if args else {}
    response = http.post("/tasks", files={"file": ("scan.pdf", pdf, "application/pdf")}, data=data)
    assert response.status_code == 202, response.text
    return wait_status(http, response.json()["id"], {"succeeded", "failed"}, 90)


def test_the_cuda_provider_only_on_a_gpu_worker_that_has_it() -> None:
    with_cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert ocr.providers("gpu", with_cuda) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert ocr.providers("gpu", ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert ocr.providers("cpu", with_cuda) == ["CPUExecutionProvider"]


def test_boxes_read_as_lines_top_to_bottom_left_to_right() -> None:
    boxes = [
        ocr.Line("world", top=10, bottom=30, left=120),
        ocr.Line("second", top=52, bottom=70, left=10),
        ocr.Line("Hello", top=12, bottom=31, left=10),  # a little lower, same line
        ocr.Line("line", top=50, bottom=71, left=90),
    ]
    assert ocr.lines(boxes) == "Hello world\nsecond line"
    assert ocr.lines([]) == ""


def test_scanned_pages_come_back_as_text(http: httpx.Client, start_worker: WorkerFactory) -> None:
    start_worker()
    record = _extract(http, make_scanned_pdf(PAGES, scanned={2, 3}))
    assert record["status"] == "succeeded", record["error"]
    pages = record["result"]["text"]
    assert [p["source"] for p in pages] == ["text", "ocr", "ocr"]
    assert record["parts"]["count"] == 3  # a scan: parts down to a page each
    assert pages[0]["text"] == PAGES[0]  # the text layer, exactly
    for page, truth in zip(pages[1:], PAGES[1:], strict=True):
        assert cer(truth, page["text"]) < 0.1, page["text"]


def test_the_ocr_argument_decides_which_pages_are_read(
    http: httpx.Client, start_worker: WorkerFactory
) -> None:
    start_worker()
    pdf = make_scanned_pdf(PAGES[:2], scanned={2})
    always = _extract(http, pdf, '{"ocr": "always"}')["result"]["text"]
    assert [p["source"] for p in always] == ["ocr", "ocr"]
    assert cer(PAGES[0], always[0]["text"]) < 0.1
    never = _extract(http, pdf, '{"ocr": "never"}')["result"]["text"]
    assert [(p["source"], p["text"].strip()) for p in never] == [("text", PAGES[0]), ("text", "")]


def test_a_worker_without_the_ocr_extra_fails_the_page_clearly(
    http: httpx.Client, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    # The extra not installed: its package cannot be imported (first on the path).
    missing = tmp_path / "rapidocr_onnxruntime"
    missing.mkdir()
    (missing / "__init__.py").write_text(
        'raise ImportError("No module named rapidocr_onnxruntime", name="rapidocr_onnxruntime")\n'
    )
    repo = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": os.pathsep.join(map(str, [tmp_path, repo, repo / "tests" / "support"]))}
    start_worker(env=env)
    text_only = _extract(http, make_scanned_pdf(PAGES[:1], scanned=set()))
    assert text_only["status"] == "succeeded"  # pages with a text layer need no OCR
    record = _extract(http, make_scanned_pdf(PAGES[:2], scanned={2}))
    assert record["status"] == "failed"
    assert record["error"]["code"] == "ocr_unavailable"
    assert "Page 2" in record["error"]["message"] and "gpulane[ocr]" in record["error"]["message"]


@pytest.mark.parametrize("text", ["", "   \n"])
def test_character_error_rate(text: str) -> None:
    assert cer("abc def", "abc def") == 0.0
    assert cer("abc def", "abcdef") == pytest.approx(1 / 7)  # one space lost
    assert cer("abc", "  abc\n") == 0.0  # layout whitespace is not an error
    assert cer(text, "") == 0.0 and cer(text, "x") == 1.0
