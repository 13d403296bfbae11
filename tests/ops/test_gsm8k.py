"""GSM8K prompt building and answer extraction (lm-evaluation-harness rules), on the committed sample."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ops.tools import gsm8k
from ops.tools.eval_gsm8k import first_divergence

SAMPLE_TEST = gsm8k.SAMPLE_DIR / "test_head4.jsonl"
SAMPLE_SHOTS = gsm8k.SAMPLE_DIR / "train_head3.jsonl"


def test_sample_loads_with_targets():
    problems = gsm8k.load(SAMPLE_TEST)
    assert [p.target for p in problems] == ["18", "3", "70000", "540"]
    assert len(gsm8k.load(SAMPLE_SHOTS)) == 3


def test_select_first_or_seeded_sample():
    problems = gsm8k.load(SAMPLE_TEST)
    assert [p.index for p in gsm8k.select(problems, 2, None)] == [0, 1]
    seeded = gsm8k.select(problems, 3, seed=7)
    assert seeded == gsm8k.select(problems, 3, seed=7) and len({p.index for p in seeded}) == 3


def test_fewshot_prompt_format():
    shots = gsm8k.load(SAMPLE_SHOTS)
    prompt = gsm8k.fewshot_prompt(shots, "What is 2+2?")
    assert prompt.count("Question: ") == 4 and prompt.endswith("Question: What is 2+2?\nAnswer:")
    assert f"Answer: {shots[0].answer}\n\nQuestion: {shots[1].question}" in prompt


def test_strict_and_flexible_extraction():
    text = " She has 3 + 4 = 7 apples.\n#### 1,234\n\nQuestion: next"
    assert gsm8k.strict_answer(text) == "1234"
    assert gsm8k.flexible_answer(gsm8k.cut(text)) == "1234"
    assert gsm8k.strict_answer("The answer is 12.") is None
    assert gsm8k.flexible_answer("It costs $5.00 in total.") == "5"
    assert gsm8k.flexible_answer("no numbers here") is None
    assert gsm8k.cut("a Question: b") == "a "


@given(st.integers(min_value=-10**9, max_value=10**9))
def test_last_integer_is_extracted(n):
    assert gsm8k.flexible_answer(f"so we get 12 and then {n}") == str(n)
    assert gsm8k.strict_answer(f"work\n#### {n}") == str(n)


def test_first_divergence():
    assert first_divergence("abc", "abc") is None
    assert first_divergence("abcd", "abxd") == 2
    assert first_divergence("ab", "abc") == 2
