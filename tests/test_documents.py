"""``document.extract`` across the pool: every page back, in order, from page ranges run
as parts on several workers; read back by page range; bad documents fail clearly.
Real Redis, real API, real worker processes, real PDFs (``support/pdf.py``; pypdf
encrypts one)."""

from __future__ import annotations

import io
import itertools
from typing import Any

import httpx
import pypdf
import pytest
from conftest import WorkerFactory, wait_status
from support.pdf import make_pdf

from dispatcher.contract.parts import EntryRange, part_id
from worker.tasks.document import MAX_PART_PAGES, MIN_PART_PAGES, part_ranges


def _post(http: httpx.Client, pdf: bytes, args: str | None = None) -> dict[str, Any]:
    data = {"args": args} if args else {}
    response = http.post("/tasks", files={"file": ("doc.pdf", pdf, "application/pdf")}, data=data)
    assert response.status_code == 202, response.text
    body: dict[str, Any] = response.json()
    return body


def _encrypted(pdf: bytes, password: str) -> bytes:
    writer = pypdf.PdfWriter(clone_from=io.BytesIO(pdf))
    writer.encrypt(password, algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def test_part_ranges_keep_every_worker_busy_and_bound_a_loss() -> None:
    # Four parts per worker, consecutive, covering every page once.
    ranges = part_ranges(1, 2415, workers=4)
    assert len(ranges) == 16 and ranges[0] == EntryRange(1, 151) and ranges[-1].last == 2415
    assert all(b.first == a.last + 1 for a, b in itertools.pairwise(ranges))
    # A lone worker still gets ranges no larger than a lost worker may redo.
    alone = part_ranges(1, 2415, workers=1)
    assert max(r.count for r in alone) <= MAX_PART_PAGES
    assert sum(r.count for r in alone) == 2415
    # Small documents are not cut finer than a part is worth.
    assert part_ranges(1, 20, workers=8) == [EntryRange(1, 10), EntryRange(11, 20)]
    assert min(r.count for r in part_ranges(1, 100, workers=8)) >= MIN_PART_PAGES
    # Pages read by OCR (a second or more each) are worth a part each.
    assert part_ranges(1, 6, workers=2, min_pages=1) == [EntryRange(n, n) for n in range(1, 7)]
    assert len(part_ranges(1, 100, workers=2, min_pages=1)) == 8
    assert part_ranges(5, 9, workers=2, per_part=2) == [
        EntryRange(5, 6),
        EntryRange(7, 8),
        EntryRange(9, 9),
    ]


def test_every_page_comes_back_in_order_from_several_workers(
    http: httpx.Client, start_worker: WorkerFactory
) -> None:
    start_worker("w1")
    start_worker("w2")
    texts = [f"Page {n} of the manual" for n in range(1, 121)]
    task = _post(http, make_pdf(texts, title="Manual"))
    record = wait_status(http, task["id"], {"succeeded"}, 60)
    result = record["result"]
    assert result["pages"] == 120 and result["extracted_pages"] == 120
    assert result["metadata"]["Title"] == "Manual"
    assert [p["page"] for p in result["text"]] == list(range(1, 121))
    assert [p["text"] for p in result["text"]] == texts
    assert {p["source"] for p in result["text"]} == {"text"}
    assert record["parts"]["count"] == 8  # 4 per worker, 15 pages each
    workers = {http.get(f"/tasks/{part_id(task['id'], k)}").json()["worker"] for k in range(8)}
    assert workers == {"w1", "w2"}
    ranged = http.get(f"/tasks/{task['id']}/result", params={"pages": "31-45"}).json()
    assert [p["page"] for p in ranged["text"]] == list(range(31, 46))
    assert ranged["pages"] == 120


def test_a_page_range_and_max_pages(http: httpx.Client, start_worker: WorkerFactory) -> None:
    start_worker()
    pdf = make_pdf([f"p{n}" for n in range(1, 31)])
    task = _post(http, pdf, '{"pages": "11-30", "max_pages": 5, "pages_per_part": 2}')
    record = wait_status(http, task["id"], {"succeeded"}, 30)
    assert [p["text"] for p in record["result"]["text"]] == ["p11", "p12", "p13", "p14", "p15"]
    assert record["result"]["extracted_pages"] == 5 and record["parts"]["count"] == 3
    # Read back by the document's page numbers, which start at 11 here.
    ranged = http.get(f"/tasks/{task['id']}/result?pages=12-13").json()
    assert [p["text"] for p in ranged["text"]] == ["p12", "p13"]
    assert http.get(f"/tasks/{task['id']}/result?pages=1-3").status_code == 416
    outside = _post(http, pdf, '{"pages": "25-40"}')
    error = wait_status(http, outside["id"], {"failed"})["error"]
    assert error["code"] == "pages_out_of_range" and "30 pages" in error["message"]


@pytest.mark.parametrize("pages", ["0-3", "5-", "a", "1-2-3"])
def test_a_malformed_page_range_is_refused_at_submit(
    known_types: None, http: httpx.Client, pages: str
) -> None:
    response = http.post(
        "/tasks",
        files={"file": ("doc.pdf", make_pdf(["x"]), "application/pdf")},
        data={"args": f'{{"pages": "{pages}"}}'},
    )
    assert response.status_code == 422, response.text


def test_an_encrypted_document_needs_its_password(
    http: httpx.Client, start_worker: WorkerFactory
) -> None:
    start_worker()
    locked = _encrypted(make_pdf(["the secret page"]), "open-sesame")
    without = wait_status(http, _post(http, locked)["id"], {"failed"})["error"]
    assert without["code"] == "document_encrypted" and "password" in without["message"]
    wrong = _post(http, locked, '{"password": "guess"}')
    error = wait_status(http, wrong["id"], {"failed"})["error"]
    assert error["code"] == "document_encrypted" and "wrong" in error["message"]
    right = _post(http, locked, '{"password": "open-sesame"}')
    record = wait_status(http, right["id"], {"succeeded"})
    assert [p["text"] for p in record["result"]["text"]] == ["the secret page"]


def test_a_damaged_document_fails_before_any_part(
    http: httpx.Client, start_worker: WorkerFactory
) -> None:
    start_worker()
    damaged = make_pdf(["a", "b"])[:200]  # cut short: no pages, no cross-reference
    record = wait_status(http, _post(http, damaged)["id"], {"failed"})
    assert record["error"]["code"] == "invalid_document"
    assert record["parts"] is None  # nothing was queued
