"""Test stages by cost (the Makefile's ``test-unit``, ``test-kernels``, ``test-engine``, ``test-serve``).

Tests that use the real SmolLM2 engine or the transformers reference (the session fixtures of
``tests/replicas/conftest.py``: loading and running them takes minutes on a CPU) are marked ``engine``
here, once, by the fixtures they use, so that ``make test-unit`` (``-m "not ray and not engine"``) stays
fast without a marker in every module.
"""

from __future__ import annotations

import pytest

ENGINE_FIXTURES = frozenset({"core", "tokenizer", "hf_model", "hf_greedy"})
"""Session fixtures that load SmolLM2 (our engine or transformers')."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if ENGINE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)
