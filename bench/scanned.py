"""Scanned documents made from real ones, and how close OCR comes to their text.

:func:`scan` renders pages of a text PDF to images (pypdfium2) and writes them back
as an image-only PDF, one JPEG per page, as a scanner or a "print to image" makes
them: no text layer, so ``document.extract`` must read every page by OCR. The source's
own text layer (:func:`page_texts`) is the ground truth :func:`cer` compares OCR with.
"""

from __future__ import annotations

import io
import re
from typing import Any

import numpy as np

__all__ = ["cer", "normalise", "page_texts", "scan"]

SCAN_DPI = 150  # an office scanner's default for documents
JPEG_QUALITY = 80


def scan(pdf: bytes, first: int = 1, last: int | None = None, dpi: int = SCAN_DPI) -> bytes:
    """Pages ``first``..``last`` (1-based; default to the end) of ``pdf`` as an
    image-only PDF of the same page sizes."""
    import pypdfium2 as pdfium

    source = pdfium.PdfDocument(pdf)
    out = pdfium.PdfDocument.new()
    try:
        last = len(source) if last is None else last
        for number in range(first, last + 1):
            _scan_page(source[number - 1], out, dpi)
        buffer = io.BytesIO()
        out.save(buffer)
        return buffer.getvalue()
    finally:
        out.close()
        source.close()


def _scan_page(page: Any, out: Any, dpi: int) -> None:
    import pypdfium2 as pdfium

    width, height = page.get_size()
    image = page.render(scale=dpi / 72, grayscale=True).to_pil()
    jpeg = io.BytesIO()
    image.save(jpeg, format="JPEG", quality=JPEG_QUALITY)
    jpeg.seek(0)
    target = out.new_page(width, height)
    picture = pdfium.PdfImage.new(out)
    picture.load_jpeg(jpeg, inline=True)  # the JPEG itself, not a decoded bitmap: small
    picture.set_matrix(pdfium.PdfMatrix().scale(width, height))
    target.insert_obj(picture)
    target.gen_content()
    page.close()


def page_texts(pdf: bytes, first: int = 1, last: int | None = None) -> list[str]:
    """The text layer of pages ``first``..``last``, as ``document.extract`` reads it."""
    import pypdfium2 as pdfium

    doc = pdfium.PdfDocument(pdf)
    try:
        last = len(doc) if last is None else last
        out = []
        for number in range(first, last + 1):
            page = doc[number - 1]
            textpage = page.get_textpage()
            out.append(textpage.get_text_bounded())
            textpage.close()
            page.close()
        return out
    finally:
        doc.close()


def normalise(text: str) -> str:
    """Whitespace runs as one space, trimmed: OCR and a text layer break lines and
    space words differently, which is layout, not a misread character."""
    return re.sub(r"\s+", " ", text).strip()


def cer(truth: str, seen: str) -> float:
    """Character error rate: the edit distance (insertions, deletions, substitutions)
    from ``truth`` to ``seen``, over the length of ``truth``, both normalised."""
    ref, hyp = normalise(truth), normalise(seen)
    if not ref:
        return 0.0 if not hyp else 1.0
    return _distance(ref, hyp) / len(ref)


def _distance(a: str, b: str) -> int:
    """Levenshtein distance, one row at a time over ``b`` as a numpy vector (pages are
    thousands of characters: a pure-Python table would take seconds a page)."""
    target = np.frombuffer(b.encode("utf-32-le"), dtype=np.uint32)
    steps = np.arange(len(b) + 1)
    row = steps.copy()
    codes = np.frombuffer(a.encode("utf-32-le"), dtype=np.uint32)
    for index, code in enumerate(codes, start=1):
        substitute = row[:-1] + (target != code)
        delete = row[1:] + 1
        best = np.minimum(substitute, delete)
        # insertions run along the row: new[j] = min(best[j], new[j-1] + 1), which is
        # a running minimum of (value - j) shifted back by j.
        new = np.empty_like(row)
        new[0] = index
        new[1:] = best
        row = np.minimum.accumulate(new - steps) + steps
    return int(row[-1])
