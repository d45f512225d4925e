"""gpulane benchmarks (issue 7): ``python -m bench [SCENARIO ...] [--smoke|--quick]``.

The scenarios are :mod:`bench.scenarios`; what each compares, and the modules they
share, are listed in ``bench/README.md``. Benchmarks are never part of ``make test``;
``tests/test_bench_smoke.py`` runs each at ``--smoke`` size.
"""
