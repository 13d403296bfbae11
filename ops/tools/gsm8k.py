"""GSM8K data, few-shot prompts and answer extraction (shared by ``ops.tools.eval_gsm8k`` and ``benchmarks.serve``).

Prompt format and the two answer extractors follow lm-evaluation-harness's
``gsm8k`` task (``Question: ...\\nAnswer: ...`` few-shot blocks; "strict-match"
takes the number after ``#### ``, "flexible-extract" the last number in the
completion). The data files are GSM8K's JSON lines, one ``{"question",
"answer"}`` object per line, the answer ending in ``#### <number>``.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gsm8k"
"""``../shared/data/gsm8k`` next to the repository (docs/design.md "Data")."""
TEST_FILE = "test.jsonl"
FEWSHOT_FILE = "train_head50.jsonl"
SAMPLE_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "gsm8k"
"""The small committed sample (4 test problems, 3 few-shot examples) CI uses."""

# lm-evaluation-harness gsm8k: strict "#### N", flexible "last number"
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
END_OF_ANSWER = "Question:"
"""A completion is cut here before scoring (the model starts the next few-shot block)."""


@dataclass(frozen=True)
class Problem:
    """One GSM8K problem: ``question``, the reference ``answer`` text and its final number ``target``."""

    index: int
    question: str
    answer: str

    @property
    def target(self) -> str:
        found = strict_answer(self.answer)
        if found is None:
            raise ValueError(f"GSM8K answer {self.index} has no '#### N' line")
        return found


def load(path: str | Path) -> list[Problem]:
    """Read a GSM8K JSON-lines file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not a ``{"question", "answer"}`` object.
    """
    problems = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or "question" not in row or "answer" not in row:
            raise ValueError(f"{path}:{i + 1}: expected an object with 'question' and 'answer'")
        problems.append(Problem(i, row["question"], row["answer"]))
    return problems


def select(problems: list[Problem], limit: int | None, seed: int | None) -> list[Problem]:
    """The first ``limit`` problems, or (``seed`` given) ``limit`` drawn without replacement by ``random.Random(seed)``."""
    chosen = list(problems)
    if seed is not None:
        chosen = random.Random(seed).sample(chosen, len(chosen))
    return chosen[:limit] if limit is not None else chosen


def fewshot_prompt(shots: list[Problem], question: str) -> str:
    """``Question: q\\nAnswer: a\\n\\n`` per shot, then the question with an open ``Answer:``."""
    blocks = [f"Question: {s.question}\nAnswer: {s.answer}\n\n" for s in shots]
    return "".join(blocks) + f"Question: {question}\nAnswer:"


def _normalize(number: str) -> str:
    number = number.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = float(number)
    except ValueError:
        return number
    return str(int(value)) if value == int(value) else str(value)


def cut(completion: str) -> str:
    """The completion up to the start of the next few-shot block (``Question:``)."""
    return completion.split(END_OF_ANSWER, 1)[0]


def strict_answer(text: str) -> str | None:
    """The number after the first ``#### `` (normalised: no commas or ``$``), or None."""
    found = STRICT.search(text)
    return _normalize(found.group(1)) if found else None


def flexible_answer(text: str) -> str | None:
    """The last number in ``text`` (normalised), or None."""
    matches = [m.group(0) for m in FLEXIBLE.finditer(text)]
    numbers = [m for m in matches if any(c.isdigit() for c in m)]
    return _normalize(numbers[-1]) if numbers else None
