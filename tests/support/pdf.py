"""A minimal, valid PDF writer for tests: one text line per page, an Info title."""

from __future__ import annotations


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def make_pdf(pages: list[str], title: str = "gpulane sample") -> bytes:
    objects: list[bytes] = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"",  # pages, filled below
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        f"<< /Title ({_escape(title)}) /Producer (gpulane tests) >>".encode(),
    ]
    kids = []
    for text in pages:
        stream = f"BT /F1 18 Tf 72 720 Td ({_escape(text)}) Tj ET".encode()
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream))
        content_ref = len(objects)
        objects.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % content_ref
        )
        kids.append(len(objects))
    objects[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (
        b" ".join(b"%d 0 R" % k for k in kids),
        len(kids),
    )
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for offset in offsets:
        out += b"%010d 00000 n \n" % offset
    out += b"trailer\n<< /Size %d /Root 1 0 R /Info 4 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        xref,
    )
    return bytes(out)


def make_bomb_pdf(decoded_mib: int) -> bytes:
    """A one-page PDF whose content stream is small compressed and ``decoded_mib`` MiB
    inflated (blanks, then one text line): a decompression bomb."""
    import zlib

    packer = zlib.compressobj(9)
    blank = b" " * (1024 * 1024)
    packed = b"".join(packer.compress(blank) for _ in range(decoded_mib))
    packed += packer.compress(b"BT /F1 18 Tf 72 720 Td (boom) Tj ET") + packer.flush()
    good = make_pdf(["x"])
    plain = b"BT /F1 18 Tf 72 720 Td (x) Tj ET"
    old = b"<< /Length %d >>\nstream\n%s\nendstream" % (len(plain), plain)
    new = b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream" % (len(packed), packed)
    body = good.replace(old, new)
    # The cross-reference offsets are now wrong; PDF readers rebuild them (pdfium does).
    return body


def make_scanned_pdf(pages: list[str], scanned: set[int] | None = None) -> bytes:
    """:func:`make_pdf`'s document with the pages numbered in ``scanned`` (1-based;
    default: all) replaced by images of themselves, as a scanner makes them: no text
    layer on those pages (``bench/scanned.py`` renders them)."""
    import io

    import pypdfium2 as pdfium

    from bench.scanned import scan

    text = make_pdf(pages)
    images = pdfium.PdfDocument(scan(text))
    source = pdfium.PdfDocument(text)
    out = pdfium.PdfDocument.new()
    for number in range(1, len(pages) + 1):
        donor = images if scanned is None or number in scanned else source
        out.import_pages(donor, [number - 1])
    buffer = io.BytesIO()
    out.save(buffer)
    for doc in (out, source, images):
        doc.close()
    return buffer.getvalue()
