"""Writing results: one markdown file (tables, targets, charts) per scenario, a JSON
copy of its target rows, and ``summary.md`` gathering the targets of every scenario
found in the results directory.

Every file names the command that produced it, the machine (cores, CPU model, load)
and the date, because absolute numbers only mean something next to those.
"""

from __future__ import annotations

import json
import operator
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def pct(values: list[float] | np.ndarray, q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; NaN for no values."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        return f"{value:,.{digits}f}"
    return str(value)


@dataclass
class Table:
    title: str
    columns: list[str] | str  # a str is the header as markdown writes it: "a | b | c"
    rows: list[list[Any]]
    note: str = ""

    def markdown(self) -> str:
        columns = self.columns.split(" | ") if isinstance(self.columns, str) else self.columns
        lines = [f"### {self.title}", ""]
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "---|" * len(columns))
        for row in self.rows:
            lines.append("| " + " | ".join(fmt(v) for v in row) + " |")
        if self.note:
            lines += ["", self.note]
        return "\n".join(lines) + "\n"


@dataclass
class Target:
    what: str
    baseline: str
    target: str
    measured: str
    met: bool | None  # None: informational, no verdict

    @property
    def verdict(self) -> str:
        return {True: "met", False: "**missed**", None: "-"}[self.met]


_BOUND = re.compile(r"(<=|>=) \+?([\d,.]+)(.*)")  # "<= 5 ms", ">= 1,500/s", "<= +50 MB"
_WITHIN = re.compile(r"([\d.]+)( : 1)? \+- ([\d.]+) %")  # "1 +- 2 %", "3 : 1 +- 10 %"
_COMPARE = {"<=": operator.le, ">=": operator.ge}


def judged(
    what: str,
    baseline: str,
    value: float,
    goal: str,
    shown: str | None = None,
    digits: int = 2,
    also: bool = True,
) -> Target:
    """A target whose verdict is ``value`` against the bound ``goal`` names, so the two
    cannot disagree: ``"<= 5 ms"``, ``">= 0.95x"`` (the first number after the
    comparison is the bound; text after it is the unit ``value`` is shown in unless
    ``shown`` says otherwise), or ``"3 : 1 +- 10 %"`` (within 10 % of 3). ``also``: a
    further condition the verdict needs (the result was whole, ...)."""
    if bound := _BOUND.fullmatch(goal):
        op, limit, unit = bound.groups()
        met = _COMPARE[op](value, float(limit.replace(",", "")))
        shown = shown if shown is not None else f"{value:,.{digits}f}{unit}"
    elif within := _WITHIN.fullmatch(goal):
        centre, share = float(within.group(1)), float(within.group(3)) / 100
        met = abs(value - centre) <= centre * share
        shown = shown if shown is not None else f"{value:.{digits}f}{within.group(2) or ''}"
    else:
        raise ValueError(f"a goal judged() cannot read: {goal!r}")
    return Target(what, baseline, goal, shown, met and also)


def info(what: str, baseline: str, measured: str, goal: str = "-") -> Target:
    """A row of the targets table with no verdict: a reference or a comparison."""
    return Target(what, baseline, goal, measured, None)


@dataclass
class Report:
    scenario: str
    size: str
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    charts: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    context: dict[str, str] = field(default_factory=dict)

    def write(self, outdir: Path = RESULTS) -> Path:
        outdir.mkdir(parents=True, exist_ok=True)
        self.context = self.context or machine()
        path = outdir / f"{self.scenario}.md"
        path.write_text(self.markdown())
        data: dict[str, Any] = {"scenario": self.scenario, "size": self.size}
        data["context"] = self.context
        data["targets"] = [asdict(t) for t in self.targets]
        (outdir / f"{self.scenario}.json").write_text(json.dumps(data, indent=1) + "\n")
        write_summary(outdir)
        return path

    def markdown(self) -> str:
        out = [f"## {self.scenario} ({self.size})", "", header(self.context), ""]
        if self.targets:
            out.append(targets_table(self.targets))
        out += [t.markdown() for t in self.tables]
        out += [f"![{name}]({name})\n" for name in self.charts]
        out += [f"- {note}" for note in self.notes]
        return "\n".join(out).rstrip() + "\n"


def targets_table(targets: list[Target], scenario: str | None = None) -> str:
    cols = ["what", "baseline", "target", "measured", "verdict"]
    if scenario is not None:
        cols = ["scenario", *cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for t in targets:
        row = [t.what, t.baseline, t.target, t.measured, t.verdict]
        lines.append("| " + " | ".join(([scenario] if scenario else []) + row) + " |")
    return "\n".join(lines) + "\n"


def header(ctx: dict[str, str]) -> str:
    return (
        f"Command: `{ctx['command']}`  \n"
        f"Machine: {ctx['cores']} cores, {ctx['cpu']}, load average at start {ctx['load']}"
        f" (shared machine: absolute numbers are noisy, compare side by side)  \n"
        f"Date: {ctx['date']}; commit {ctx['commit']}; Python {ctx['python']};"
        f" {ctx['redis']}"
    )


def write_summary(outdir: Path) -> None:
    parts = ["# gpulane benchmark summary", ""]
    parts.append("Each scenario's own file has its tables, charts and the exact command.\n")
    rows: list[str] = []
    for path in sorted(outdir.glob("*.json")):
        data = json.loads(path.read_text())
        ctx = data["context"]
        parts.append(
            f"- [{data['scenario']}]({data['scenario']}.md): `{ctx['command']}`, "
            f"{ctx['date']}, {ctx['cores']} cores"
        )
        targets = [Target(**t) for t in data["targets"]]
        if targets:
            rows.append(targets_table(targets, data["scenario"]).split("\n", 2)[2])
    if rows:
        head = targets_table([], "x").split("\n", 2)
        parts += ["", head[0], head[1], *(r.rstrip("\n") for r in rows)]
    (outdir / "summary.md").write_text("\n".join(parts).rstrip() + "\n")


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "?"


def machine() -> dict[str, str]:
    """What a reader needs to judge the numbers: command, cores, CPU, date, commit."""
    cpu = platform.processor() or "?"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    repo = Path(__file__).resolve().parents[1]
    commit = _run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"]) or "?"
    paths = ["bench", "dispatcher", "worker", "tests", ":!bench/results"]
    if _run(["git", "-C", str(repo), "status", "--porcelain", "--", *paths]):
        commit += "+dirty"
    redis_bin = shutil.which("redis-server")
    redis = _run([redis_bin, "--version"]).split(" sha=")[0] if redis_bin else "?"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return {
        "command": "python -m bench " + " ".join(sys.argv[1:]),
        "cores": str(os.cpu_count()),
        "cpu": cpu,
        "load": load,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "python": platform.python_version(),
        "redis": redis,
    }


def figure(width: float = 7.0, height: float = 3.6, ncols: int = 1) -> Any:
    """A matplotlib figure on the non-interactive backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width, height), dpi=90)


def save(fig: Any, outdir: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(outdir / name)
    plt.close(fig)
    return name


def axes(
    ax: Any,
    title: str | None = None,
    x: str | None = None,
    y: str | None = None,
    legend: float | None = None,
    xscale: str | None = None,
) -> None:
    """Title, axis labels, a legend (at this font size) and the x scale, where given."""
    if title is not None:
        ax.set_title(title)
    if x is not None:
        ax.set_xlabel(x)
    if y is not None:
        ax.set_ylabel(y)
    if xscale == "symlog":  # waits of 0 ms: linear near zero, log beyond 10
        ax.set_xscale("symlog", linthresh=10)
    elif xscale is not None:
        ax.set_xscale(xscale)
    if legend is not None:
        ax.legend(fontsize=legend)


def cdf(ax: Any, values: Sequence[float], *style: str, **line: Any) -> None:
    """One empirical CDF line: each value against the fraction at or below it."""
    ordered = sorted(values)
    ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], *style, **line)


def latency_cdf(ax: Any, latencies: Mapping[str, Sequence[float]]) -> None:
    """One CDF line per label on a log latency axis: where policies part shows in the
    tail, which a linear axis squeezes into its last pixels."""
    for label, latency in latencies.items():
        cdf(ax, latency, label=label)
    axes(ax, x="end-to-end latency (s), log scale", y="fraction of tasks", xscale="log")


def grouped_bars(ax: Any, series: Mapping[str, Sequence[float]], ticks: Sequence[str]) -> None:
    """One bar per series side by side at each tick (``series``: label -> value per tick)."""
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(ticks))]
        ax.bar(xs, values, width=width, label=label)
    ax.set_xticks(range(len(ticks)), ticks)


def p50_p99(values: Sequence[float]) -> tuple[float, float]:
    return pct(list(values), 50), pct(list(values), 99)
