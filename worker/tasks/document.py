"""``document.extract``: every page's text, across the pool, scanned pages by OCR.

A document runs as parts (``ctx.map``): the task opens the PDF once to check it (a
decompression bomb, a damaged or encrypted file fail here, before anything is queued),
reads its page count and metadata, and splits the pages into ranges; each range is a
part any worker of the class takes, so a long document keeps the whole pool busy and
a worker lost mid-document costs one range. The parts' pages come back merged in
order under ``text``; ``GET /tasks/<id>/result?pages=a-b`` reads a range back.

Range size (:func:`part_ranges`): at least four parts per live worker of the class (a
fast worker takes more ranges than a slow one, so none idles at the end), but no part
under :data:`MIN_PART_PAGES` pages (a part costs a claim, a report and opening the PDF
again, a few milliseconds, beside a millisecond a text page) and none over
:data:`MAX_PART_PAGES` (what a lost worker redoes, at most). A document that will be
read by OCR (``ocr="always"``, or a sampled page without a text layer) has parts down
to one page: an OCR page costs a second or more, far beyond a part's fixed cost.
``pages_per_part`` overrides it.

OCR (``worker.tasks.ocr``, extra ``gpulane[ocr]``): ``ocr="auto"`` reads a page by OCR
when its text layer is empty, ``"always"`` every page, ``"never"`` none. Each page says
where its text came from: ``source`` is ``"text"`` or ``"ocr"``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dispatcher.contract.parts import RANGE_PATTERN, EntryRange, parse_range
from worker.registry import Split, TaskCanceled, TaskContext, TaskFailure, UploadedFile, task
from worker.tasks.inflate import check_inflation

__all__ = ["MAX_PART_PAGES", "MIN_PART_PAGES", "ExtractArgs", "part_ranges"]

MIN_PART_PAGES = 8
MAX_PART_PAGES = 200
PARTS_PER_WORKER = 4
SAMPLED_PAGES = 8  # pages looked at to tell a scan (OCR pages) from a text document

Ocr = Literal["auto", "always", "never"]


class ExtractArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pages: str | None = Field(
        None,
        pattern=RANGE_PATTERN,
        description="The pages to extract, 1-based: '7' or '1-100'. Default: every page.",
    )
    max_pages: int | None = Field(
        None, ge=1, le=100_000, description="At most this many pages (from the first asked)."
    )
    password: str | None = Field(None, max_length=256, description="For encrypted PDFs.")
    ocr: Ocr = Field(
        "auto",
        description="OCR pages without a text layer (auto), every page (always) or none (never).",
    )
    pages_per_part: int | None = Field(
        None, ge=1, le=1000, description="Pages per part; default: sized to the pool."
    )


def part_ranges(
    first: int,
    last: int,
    workers: int,
    per_part: int | None = None,
    min_pages: int = MIN_PART_PAGES,
) -> list[EntryRange]:
    """Pages ``first``..``last`` cut into consecutive ranges for ``workers`` workers
    (module docstring), none under ``min_pages`` unless the document is, as even as
    whole pages allow; or into ranges of ``per_part``."""
    count = last - first + 1
    if per_part is not None:
        return [
            EntryRange(start, min(start + per_part - 1, last))
            for start in range(first, last + 1, per_part)
        ]
    parts = min(PARTS_PER_WORKER * max(workers, 1), count // min_pages)
    parts = max(parts, math.ceil(count / MAX_PART_PAGES), 1)
    size, longer = divmod(count, parts)  # the first `longer` ranges take one page more
    out = []
    start = first
    for index in range(parts):
        end = start + size + (1 if index < longer else 0) - 1
        out.append(EntryRange(start, end))
        start = end + 1
    return out


def _open(upload: UploadedFile, password: str | None, checked: bool = False) -> Any:
    """The PDF, opened; TaskFailure for one that is a bomb, damaged or locked.
    ``checked``: its streams were already inflated and counted (a part: its task checked
    the same upload, which no one can change), a fifth of a second for 6 MB saved."""
    import pypdfium2 as pdfium  # here: workers without documents start lighter

    too_much = None if checked else check_inflation(upload.data)
    if too_much:  # before the PDF library decodes it: a decompression bomb stays small
        raise TaskFailure(
            "document_too_large", f"{upload.name!r} is refused: {too_much} when decoded."
        )
    try:
        return pdfium.PdfDocument(upload.data, password=password)
    except pdfium.PdfiumError as exc:
        if getattr(exc, "err_code", None) == pdfium.raw.FPDF_ERR_PASSWORD:
            why = "the password given is wrong" if password else "send its password in args"
            raise TaskFailure(
                "document_encrypted", f"{upload.name!r} is encrypted: {why} (password)."
            ) from exc
        raise TaskFailure(
            "invalid_document", f"{upload.name!r} is not a readable PDF: {exc}."
        ) from exc


def _wanted(args: ExtractArgs, total: int) -> EntryRange:
    asked = parse_range(args.pages) if args.pages else EntryRange(1, total)
    if asked.last > total:
        raise TaskFailure(
            "pages_out_of_range",
            f"pages={asked} is out of range: the document has {total} pages (1-{total}).",
        )
    if args.max_pages is not None and asked.count > args.max_pages:
        asked = EntryRange(asked.first, asked.first + args.max_pages - 1)
    return asked


@task("document.extract", file="required")
def extract(args: ExtractArgs, ctx: TaskContext) -> dict[str, Any] | Split:
    """Extract every page's text and the metadata of a PDF (OCR for scanned pages)."""
    assert ctx.file is not None  # file="required": the API refuses submissions without one
    pdf = _open(ctx.file, args.password, checked=ctx.parent is not None)
    try:
        total = len(pdf)
        if ctx.parent is not None:  # a part: its range of pages
            return {"text": _pages(pdf, _wanted(args, total), args.ocr, ctx)}
        metadata = pdf.get_metadata_dict(skip_empty=True)
        wanted = _wanted(args, total) if total else EntryRange(1, 1)
        scanned = total > 0 and _needs_ocr(pdf, wanted, args.ocr)
    finally:
        pdf.close()
    result = {"pages": total, "extracted_pages": 0, "metadata": metadata}
    if total == 0:
        return {**result, "text": []}
    ranges = part_ranges(
        wanted.first,
        wanted.last,
        ctx.workers(),
        args.pages_per_part,
        min_pages=1 if scanned else MIN_PART_PAGES,
    )
    part_args = args.model_dump(exclude={"pages", "max_pages", "pages_per_part"}, exclude_none=True)
    return ctx.map(
        "document.extract",
        [{**part_args, "pages": str(r)} for r in ranges],
        into="text",
        flatten=True,
        result={**result, "extracted_pages": wanted.count},
        first=wanted.first,
        labels=[f"document.extract pages {r}" for r in ranges],
    )


def _needs_ocr(pdf: Any, wanted: EntryRange, ocr: Ocr) -> bool:
    """Will pages of ``wanted`` be read by OCR? A few pages spread over it are looked at:
    a scan is usually scanned throughout (a mixed document may be cut coarser)."""
    if ocr != "auto":
        return ocr == "always"
    step = max(wanted.count // SAMPLED_PAGES, 1)
    for number in range(wanted.first, wanted.last + 1, step):
        page = pdf[number - 1]
        try:
            if not _text_layer(page).strip():
                return True
        finally:
            page.close()
    return False


def _text_layer(page: Any) -> str:
    textpage = page.get_textpage()
    try:
        return str(textpage.get_text_bounded())
    finally:
        textpage.close()


def _pages(pdf: Any, wanted: EntryRange, ocr: Ocr, ctx: TaskContext) -> list[dict[str, Any]]:
    """The pages of ``wanted``, each {page, text, source}, with progress."""
    out = []
    for number in range(wanted.first, wanted.last + 1):
        if ctx.cancelled():  # never a short list: the part ends canceled
            raise TaskCanceled(f"canceled at page {number}")
        page = pdf[number - 1]
        try:
            out.append(_page(page, number, ocr, ctx.device.get("kind", "cpu")))
        finally:
            page.close()
        done = number - wanted.first + 1
        ctx.progress(done / wanted.count, f"page {number} ({done} of {wanted.count})")
    return out


def _page(page: Any, number: int, ocr: Ocr, device_kind: str) -> dict[str, Any]:
    text = _text_layer(page)
    # auto: a page with no text layer (a scan) is read by OCR; a page whose layer holds
    # any text keeps it (its fonts say what the characters are; OCR can only guess).
    if ocr == "never" or (ocr == "auto" and text.strip()):
        return {"page": number, "text": text, "source": "text"}
    from worker.tasks import ocr as reader  # the `ocr` extra: only when a page needs it

    try:
        return {"page": number, "text": reader.ocr_page(page, device_kind), "source": "ocr"}
    except reader.OcrUnavailable as exc:
        raise TaskFailure("ocr_unavailable", f"Page {number} needs OCR: {exc}") from exc
