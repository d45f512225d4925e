"""The built-in task types: ``echo``, ``sleep`` and ``document.extract``."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from worker.registry import TaskContext, TaskFailure, task
from worker.tasks.inflate import check_inflation

__all__ = ["EchoArgs", "ExtractArgs", "SleepArgs"]


class EchoArgs(BaseModel):
    """Any JSON object; it comes back as the result."""

    model_config = ConfigDict(extra="allow")


@task("echo")
def echo(args: EchoArgs, ctx: TaskContext) -> dict[str, Any]:
    """Return the arguments as the result (a health check through the whole path)."""
    return args.model_dump()


class SleepArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seconds: float = Field(1.0, ge=0, le=86_400, description="How long the task runs.")


@task("sleep")
def sleep(args: SleepArgs, ctx: TaskContext) -> dict[str, Any]:
    """Hold the worker for `seconds`, reporting progress: the synthetic GPU task."""
    if args.seconds < 0.5:  # benchmark-sized: no progress writes on the hot path
        time.sleep(args.seconds)
        return {"slept_s": args.seconds}
    start = time.monotonic()
    end = start + args.seconds
    tick = max(0.1, args.seconds / 20)
    while (left := end - time.monotonic()) > 0:
        if ctx.cancelled():
            break
        time.sleep(min(tick, left))
        done = min(1.0, (time.monotonic() - start) / args.seconds)
        ctx.progress(done, f"slept {time.monotonic() - start:.1f} of {args.seconds:g} s")
    return {"slept_s": round(time.monotonic() - start, 3)}


class ExtractArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_pages: int = Field(1000, ge=1, le=100_000, description="Extract at most this many pages.")
    password: str | None = Field(None, max_length=256, description="For encrypted PDFs.")


@task("document.extract", file="required")
def extract(args: ExtractArgs, ctx: TaskContext) -> dict[str, Any]:
    """Extract the text of each page and the metadata of a PDF."""
    import pypdfium2 as pdfium  # imported here so workers without documents start lighter

    assert ctx.file is not None  # file="required": the API refuses submissions without one
    too_much = check_inflation(ctx.file.data)
    if too_much:  # before the PDF library decodes it: a decompression bomb stays small
        raise TaskFailure(
            "document_too_large", f"{ctx.file.name!r} is refused: {too_much} when decoded."
        )
    try:
        pdf = pdfium.PdfDocument(ctx.file.data, password=args.password)
    except pdfium.PdfiumError as exc:
        raise TaskFailure(
            "invalid_document", f"{ctx.file.name!r} is not a readable PDF: {exc}."
        ) from exc
    try:
        total = len(pdf)
        count = min(total, args.max_pages)
        pages = []
        for index in range(count):
            page = pdf[index]
            textpage = page.get_textpage()
            try:
                pages.append({"page": index + 1, "text": textpage.get_text_bounded()})
            finally:
                textpage.close()
                page.close()
            ctx.progress((index + 1) / count, f"page {index + 1} of {count}")
        return {
            "pages": total,
            "extracted_pages": count,
            "metadata": pdf.get_metadata_dict(skip_empty=True),
            "text": pages,
        }
    finally:
        pdf.close()
