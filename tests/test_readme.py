"""The README's quick start: exactly the two commands, and no start-time figures nobody measured (issue 35:
the printed 2.5 min / 15 s were not what a fresh run took)."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _section(title: str) -> str:
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_quick_start_is_two_commands():
    quick = _section("Quick start")
    block = quick.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in block.strip().splitlines()] == ["make serve", "make test"]


def test_quick_start_states_no_start_time():
    quick = _section("Quick start")
    durations = re.findall(r"\b(?:about|takes?|in)\s+[\d.,]+\s*(?:s|seconds?|min|minutes?)\b", quick)
    assert not durations, f"start-time figures in the quick start (measure them, or leave them out): {durations}"
