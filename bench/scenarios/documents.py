"""Scenario documents: whole documents across the pool (``document.extract`` as parts).

Real PDFs (``scripts/bench-pdfs.sh``: R's manuals from Debian's ``r-doc-pdf``):

- (t) ``refman.pdf``, the R reference manual, 2,415 pages with a text layer;
- (s) a scanned document: pages of ``R-intro.pdf`` rendered to 150 dpi JPEGs and written
  back as an image-only PDF (:mod:`bench.scanned`), every page read by OCR;

each on 1, 2 and 4 workers: seconds from submission to the merged result (Redis clock),
speedup against one worker beside MinerU's headline of 0.8-0.9 N for N GPUs, and a
check that the result is whole (every page, in order, the text layer's text). The
scanned pages' OCR is compared with the source's text layer: character error rate.

(k) A worker SIGKILLed mid-document (scanned pages, two workers, ranges of a few
pages): how many pages were done twice. The goal is at most one range.

On a CPU host each worker is pinned to one core (round robin), the lone one too: a
core stands for a device here, one worker each, as one worker per GPU. (Unpinned, a
lone OCR worker runs onnxruntime on every core and two workers share them.) So on 2
cores, 4 workers cannot beat 2: the speedup a GPU pool gets per card is what this
shows per core.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import httpx

from bench.glside import records
from bench.harness import REPO, Proc, Stack
from bench.report import Report, Table, Target, axes, figure, judged, save
from bench.scanned import cer, page_texts, scan
from dispatcher.contract.parts import part_id
from testkit import wait_for

CLASSES = ["interactive", "batch"]
MINERU = (0.8, 0.9)  # MinerU's multi-GPU speedup per GPU, its README's headline


@dataclass(frozen=True)
class Size:
    text_pages: int | None  # pages of refman.pdf (None: all 2,415)
    scan_pages: int  # pages of R-intro.pdf, scanned
    workers: tuple[int, ...]
    kill_pages: int
    kill_per_part: int


SIZES = {
    "smoke": Size(160, 1, (1, 2), kill_pages=4, kill_per_part=2),
    "quick": Size(None, 12, (1, 2, 4), kill_pages=8, kill_per_part=4),
    "full": Size(None, 100, (1, 2, 4), kill_pages=24, kill_per_part=8),
}


@dataclass
class Run:
    doc: str
    workers: int
    pages: int
    seconds: float
    whole: bool
    parts: int
    cer: float | None = None  # median over pages; scanned only
    cer_nospace: float | None = None  # the same, spaces removed from both


@cache
def _pdfs() -> Path:
    out = subprocess.run(
        [str(REPO / "scripts" / "bench-pdfs.sh")], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def _documents(cfg: Size) -> dict[str, tuple[bytes, list[str]]]:
    """name -> (the PDF, every page's true text)."""
    manual = (_pdfs() / "refman.pdf").read_bytes()
    if cfg.text_pages is not None:
        manual = first_pages(manual, cfg.text_pages)
    intro = (_pdfs() / "R-intro.pdf").read_bytes()
    return {
        "refman.pdf (text)": (manual, page_texts(manual)),
        f"R-intro.pdf, {cfg.scan_pages} pages scanned": (
            scan(intro, 1, cfg.scan_pages),
            page_texts(intro, 1, cfg.scan_pages),
        ),
    }


def first_pages(pdf: bytes, pages: int) -> bytes:
    """The first ``pages`` pages of ``pdf``, text layer kept (smoke size)."""
    import io

    import pypdfium2 as pdfium

    source = pdfium.PdfDocument(pdf)
    out = pdfium.PdfDocument.new()
    out.import_pages(source, list(range(pages)))
    buffer = io.BytesIO()
    out.save(buffer)
    out.close()
    source.close()
    return buffer.getvalue()


class Pool:
    """Redis, the API and ``n`` workers, each pinned to a core (round robin)."""

    def __init__(self, stack: Stack, n: int) -> None:
        self.stack = stack
        _, self.url = stack.gpulane_api(CLASSES)
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self.workers = [self._worker(i) for i in range(n)]

    def _worker(self, index: int) -> Proc:
        proc = self.stack.gpulane_worker(f"doc-{index}")
        cores = sorted(os.sched_getaffinity(0))
        # Threads the worker starts later (onnxruntime's, on its first OCR page) inherit it.
        os.sched_setaffinity(proc.pid, {cores[index % len(cores)]})
        self.stack.wait_idle(proc)
        return proc

    def submit(self, pdf: bytes, args: str = "{}") -> str:
        files = {"file": ("doc.pdf", pdf, "application/pdf")}
        response = self.http.post("/tasks", files=files, data={"args": args})
        response.raise_for_status()
        return str(response.json()["id"])

    def wait(self, task_id: str, timeout_s: float = 3600) -> dict[str, Any]:
        def final() -> dict[str, Any] | None:
            record: dict[str, Any] = self.http.get(f"/tasks/{task_id}?wait=5").json()
            return record if record["status"] in ("succeeded", "failed", "canceled") else None

        record: dict[str, Any] = wait_for(final, timeout_s, f"document {task_id}", interval_s=0.05)
        if record["status"] != "succeeded":
            raise RuntimeError(f"document {task_id} ended {record['status']}: {record['error']}")
        return record

    def warm(self, pdf: bytes) -> None:
        """Every worker has read a page by OCR (its models loaded) before a timed run."""
        warmed: set[str] = set()
        for _ in range(20):
            ids = [self.submit(pdf, '{"ocr": "always"}') for _ in self.workers]
            for task_id in ids:
                self.wait(task_id)
                warmed.add(self.http.get(f"/tasks/{part_id(task_id, 0)}").json()["worker"])
            if warmed >= {w.name for w in self.workers}:
                return
        raise RuntimeError(f"warm-up reached {sorted(warmed)} only")


def _timed(pool: Pool, name: str, pdf: bytes, truth: list[str], scanned: bool) -> Run:
    task_id = pool.submit(pdf)
    record = pool.wait(task_id)
    created, ended = (
        records(pool.stack.client(), [task_id])[0][k] for k in ("created_ms", "ended_ms")
    )
    pages = pool.http.get(f"/tasks/{task_id}/result").json()["text"]
    whole = [p["page"] for p in pages] == list(range(1, len(truth) + 1))
    if not scanned:
        whole = whole and [p["text"] for p in pages] == truth
    pairs = list(zip(truth, [p["text"] for p in pages], strict=False)) if scanned else []
    rates = [cer(t, seen) for t, seen in pairs]
    tight = [cer(t.replace(" ", ""), seen.replace(" ", "")) for t, seen in pairs]
    return Run(
        name,
        len(pool.workers),
        len(pages),
        (ended - created) / 1000,
        whole and all(p["source"] == ("ocr" if scanned else "text") for p in pages),
        record["parts"]["count"],
        statistics.median(rates) if rates else None,
        statistics.median(tight) if tight else None,
    )


def _throughput(cfg: Size) -> list[Run]:
    docs = _documents(cfg)
    one_page = scan((_pdfs() / "R-intro.pdf").read_bytes(), 1, 1)
    runs = []
    for n in cfg.workers:
        with Stack() as stack:
            pool = Pool(stack, n)
            pool.warm(one_page)
            for index, (name, (pdf, truth)) in enumerate(docs.items()):
                runs.append(_timed(pool, name, pdf, truth, scanned=index == 1))
    return runs


@dataclass
class Kill:
    range_pages: int
    parts: int
    done_at_kill: int  # pages of its range the killed worker had finished
    retried: int  # parts that ran twice
    whole: bool


def _kill(cfg: Size) -> Kill:
    intro = (_pdfs() / "R-intro.pdf").read_bytes()
    pdf, truth = scan(intro, 1, cfg.kill_pages), page_texts(intro, 1, cfg.kill_pages)
    with Stack() as stack:
        pool = Pool(stack, 2)
        task_id = pool.submit(pdf, json.dumps({"pages_per_part": cfg.kill_per_part}))
        count = -(-cfg.kill_pages // cfg.kill_per_part)
        victim = pool.workers[0]

        def part(k: int) -> dict[str, Any]:
            response = pool.http.get(f"/tasks/{part_id(task_id, k)}")
            record: dict[str, Any] = response.json() if response.status_code == 200 else {}
            return record

        def mid_range() -> tuple[int] | None:  # a tuple: part 0 is a falsy int
            for k in range(count):
                record = part(k)  # {} until the document has split
                progress = record.get("progress") or {}
                if record.get("worker") == victim.name and (progress.get("fraction") or 0) > 0:
                    return (k,) if record["status"] == "running" else None
            return None

        (lost,) = wait_for(mid_range, 900, "the victim to be mid-range", interval_s=0.05)
        os.kill(victim.pid, signal.SIGKILL)
        # The lease (3 s) outlives this read: the record still has the lost attempt's
        # last progress, from before the kill.
        fraction = part(lost)["progress"]["fraction"]
        pool.wait(task_id)
        pages = pool.http.get(f"/tasks/{task_id}/result").json()["text"]
        attempts = [part(k)["attempts"] for k in range(count)]
    return Kill(
        range_pages=cfg.kill_per_part,
        parts=count,
        done_at_kill=round(fraction * min(cfg.kill_per_part, cfg.kill_pages)),
        retried=sum(1 for a in attempts if a > 1),
        whole=[p["page"] for p in pages] == list(range(1, len(truth) + 1)),
    )


def run(size: str, outdir: Path) -> Report:
    cfg = SIZES[size]
    runs = _throughput(cfg)
    kill = _kill(cfg)
    report = Report("documents", size)
    report.tables.append(_speed_table(runs))
    scanned = [r for r in runs if r.cer is not None]
    report.tables.append(
        Table(
            "OCR against the text layer, scanned pages (median over pages)",
            "document | workers | pages | CER | CER, spaces ignored",
            [[r.doc, r.workers, r.pages, r.cer, r.cer_nospace] for r in scanned],
            "CER: edit distance over the true text's length, whitespace runs as one space. "
            "The PP-OCRv4 recogniser often runs English words together (no space between "
            "them): the second column counts only misread characters.",
        )
    )
    report.tables.append(
        Table(
            "A worker SIGKILLed mid-document (2 workers, scanned pages)",
            "pages | range (pages) | parts | parts run twice | pages redone | whole",
            [
                [
                    cfg.kill_pages,
                    kill.range_pages,
                    kill.parts,
                    kill.retried,
                    kill.done_at_kill,
                    kill.whole,
                ]
            ],
            "Pages redone: those of the lost range the killed worker had finished "
            "(its last progress before the kill); the range's other pages were not begun.",
        )
    )
    report.targets += _targets(runs, kill)
    report.charts.append(_chart(runs, outdir))
    report.notes.append(
        f"{os.cpu_count()} cores: each worker is pinned to one core (a core stands for a "
        "device), so speedup stops at the core count; on GPUs the same split spreads over "
        "cards."
    )
    report.write(outdir)
    return report


def _speedup(runs: list[Run], run: Run) -> float:
    one = next(r for r in runs if r.doc == run.doc and r.workers == 1)
    return one.seconds / run.seconds


def _speed_table(runs: list[Run]) -> Table:
    rows = []
    for r in runs:
        speedup, whole = _speedup(runs, r), "yes" if r.whole else "**no**"
        rows.append([r.doc, r.workers, r.pages, r.parts, r.seconds, r.pages / r.seconds])
        rows[-1] += [speedup, speedup / r.workers, whole]
    return Table(
        "The whole document, by workers (submission to merged result, Redis clock)",
        "document | workers | pages | parts | seconds | pages/s | speedup | per worker | whole",
        rows,
        f"MinerU's headline for N GPUs: {MINERU[0]}-{MINERU[1]} N. Whole: every page, in "
        "order, with the text layer's text (scanned: every page read by OCR).",
    )


def _targets(runs: list[Run], kill: Kill) -> list[Target]:
    cores = len(os.sched_getaffinity(0))
    out = []
    for doc in dict.fromkeys(r.doc for r in runs):
        mine = [r for r in runs if r.doc == doc]
        best = max(
            (r for r in mine if 1 < r.workers <= cores), key=lambda r: r.workers, default=None
        )
        if best is None:
            continue
        gain = _speedup(runs, best)
        out.append(
            judged(
                f"{doc}: whole, {best.workers} workers against 1",
                f"MinerU {MINERU[0]}-{MINERU[1]} N",
                gain / best.workers,
                f">= {MINERU[0]} N, whole",
                f"{gain:.2f}x ({gain / best.workers:.2f} N)",
                also=all(r.whole for r in mine),
            )
        )
    out.append(
        Target(
            "worker SIGKILLed mid-document: work redone",
            "the whole document (one task)",
            "<= one range",
            f"{kill.done_at_kill} pages, {kill.retried} range of {kill.range_pages} pages",
            kill.whole and kill.retried == 1 and kill.done_at_kill <= kill.range_pages,
        )
    )
    return out


def _chart(runs: list[Run], outdir: Path) -> str:
    fig, axis = figure(6.0, 3.2)
    counts = sorted({r.workers for r in runs})
    for doc in dict.fromkeys(r.doc for r in runs):
        mine = sorted((r for r in runs if r.doc == doc), key=lambda r: r.workers)
        axis.plot([r.workers for r in mine], [_speedup(runs, r) for r in mine], "o-", label=doc)
    axis.plot(counts, counts, ":", color="grey", label="N (ideal)")
    axis.fill_between(
        counts,
        [MINERU[0] * n for n in counts],
        [MINERU[1] * n for n in counts],
        alpha=0.2,
        label="MinerU 0.8-0.9 N",
    )
    axis.set_xticks(counts)
    x = f"workers (one core each; this machine has {os.cpu_count()})"
    axes(axis, "A whole document across the pool", x, "speedup against 1 worker", legend=7)
    return save(fig, outdir, "documents.png")
