"""Benchmarks (``python -m benchmarks.engine``, ``.serve``, ``.standard``, ``.kernels``, ``.ablation``,
``.hops``). Offline only: the serving path never imports them, and the wheel does not ship them.
Their numbers go to ``docs/benchmarks.md``."""
