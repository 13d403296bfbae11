"""Benchmarks, outside the installed package: the serving path never imports them (``benchmarks/README.md``).

``python -m benchmarks list | run STUDY | docs``: the studies as data (:mod:`.studies`), one result file per
study and run (:mod:`.results`), ``docs/benchmarks.md`` generated from ``benchmarks/results/`` (:mod:`.docs`).
"""
