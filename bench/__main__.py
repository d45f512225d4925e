"""``python -m bench [SCENARIO ...] [--smoke | --quick] [--out DIR]``: run benchmarks.

With no scenario, runs them all (what ``make bench`` does). Sizes: ``--smoke`` (a few
seconds each: only checks the scenario still works), ``--quick`` (under a minute each;
numbers worth reading), default full size (longer, steadier numbers).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from bench.report import RESULTS
from bench.scenarios import SCENARIOS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "scenarios",
        nargs="*",
        choices=[[], *SCENARIOS],
        metavar="SCENARIO",
        help=f"any of {', '.join(SCENARIOS)} (default: all)",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", dest="size", action="store_const", const="smoke")
    size.add_argument("--quick", dest="size", action="store_const", const="quick")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"results directory ({RESULTS})")
    parser.set_defaults(size="full")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    chosen = ns.scenarios or list(SCENARIOS)
    for name in chosen:
        module = importlib.import_module(f"bench.scenarios.{name}")
        started = time.monotonic()
        print(f"bench: {name} ({ns.size}) ...", file=sys.stderr, flush=True)
        report = module.run(ns.size, ns.out)
        print(report.markdown(), flush=True)
        print(
            f"bench: {name} took {time.monotonic() - started:.1f} s -> {ns.out / (name + '.md')}",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
