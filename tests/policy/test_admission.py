"""Table tests for policy.admission and policy.reasons (seed's rules, docs/design.md "Admission")."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest

from policy import (
    ADMISSION_ORDER,
    GREEDY_TEMPERATURE_EPSILON,
    ROUTER_REASONS,
    AdmissionInput,
    Reason,
    check_admission,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE = {"max_model_len": 4096, "remaining_output_tokens": 16}

# The smallest change to an eligible request that triggers each admission reason.
TRIGGERS: dict[Reason, dict] = {
    Reason.DISABLED: {"enabled": False},
    Reason.SPECULATIVE_DECODE: {"speculative_decode": True},
    Reason.QUEUED_WORK: {"queued_requests": 1},
    Reason.UNSUPPORTED_DECODE_BATCH: {"num_sequences": 2},
    Reason.TOKENS_PER_QUERY: {"tokens_per_step": 2},
    Reason.NON_GREEDY: {"temperature": 0.7},
    Reason.LOGPROBS: {"logprobs": True},
    Reason.LOGITS_PROCESSING: {"has_logits_processing": True},
    Reason.STRUCTURED_OUTPUT: {"has_structured_output": True},
    Reason.STOP_STRINGS: {"has_stop_strings": True},
    Reason.STOP_TOKEN_SEQUENCES: {"has_stop_token_sequences": True},
    Reason.KV_TRANSFER: {"kv_transfer": True},
    Reason.MAX_SEQUENCE_LENGTH: {"committed_tokens": 4095},
    Reason.NO_OUTPUT_REMAINING: {"remaining_output_tokens": 0},
}


def make(**overrides) -> AdmissionInput:
    return AdmissionInput(**{**BASE, **overrides})


def test_reason_values_are_stable():
    assert [r.value for r in ADMISSION_ORDER] == [
        "disabled",
        "speculative_decode",
        "queued_work",
        "unsupported_decode_batch",
        "tokens_per_query",
        "non_greedy",
        "logprobs",
        "logits_processing",  # ours: penalties / min_tokens change the argmax (not in the seed's list)
        "structured_output",  # ours: a grammar's token mask (response_format) needs the host every token
        "stop_strings",
        "stop_token_sequences",
        "kv_transfer",
        "max_sequence_length",
        "no_output_remaining",
    ]
    assert [r.value for r in ROUTER_REASONS] == [
        "lane_unavailable",
        "persistent_capacity",
        "decoder_unhealthy",
        "unsupported_envelope",
    ]
    assert set(ADMISSION_ORDER) | set(ROUTER_REASONS) == set(Reason)
    assert len(ADMISSION_ORDER) + len(ROUTER_REASONS) == len(Reason)


@pytest.mark.parametrize("reason", list(Reason))
def test_reason_is_a_plain_string_with_a_docstring(reason):
    assert str(reason) == reason.value == f"{reason}"
    assert reason == reason.value
    assert Reason(reason.value) is reason
    assert reason.__doc__ and "\n" not in reason.__doc__


def test_defaults_are_eligible():
    assert check_admission(make()) is None


def test_triggers_cover_every_admission_reason():
    assert list(TRIGGERS) == list(ADMISSION_ORDER)


@pytest.mark.parametrize("reason", ADMISSION_ORDER)
def test_each_reason_alone(reason):
    assert check_admission(make(**TRIGGERS[reason])) is reason


@pytest.mark.parametrize(
    ("earlier", "later"),
    list(itertools.pairwise(ADMISSION_ORDER)),
    ids=lambda r: r.value,
)
def test_adjacent_pairs_report_the_earlier(earlier, later):
    assert check_admission(make(**TRIGGERS[earlier], **TRIGGERS[later])) is earlier


@pytest.mark.parametrize(
    ("earlier", "later"),
    list(itertools.combinations(ADMISSION_ORDER, 2)),
    ids=lambda r: r.value,
)
def test_any_pair_reports_the_earlier(earlier, later):
    assert check_admission(make(**TRIGGERS[earlier], **TRIGGERS[later])) is earlier


@pytest.mark.parametrize("start", range(len(ADMISSION_ORDER)))
def test_all_failing_from_a_point_reports_that_point(start):
    overrides: dict = {}
    for reason in ADMISSION_ORDER[start:]:
        overrides.update(TRIGGERS[reason])
    assert check_admission(make(**overrides)) is ADMISSION_ORDER[start]


@pytest.mark.parametrize(
    ("temperature", "top_k", "expected"),
    [
        (0.0, None, None),
        (GREEDY_TEMPERATURE_EPSILON, None, None),
        (2e-5, None, Reason.NON_GREEDY),
        (0.8, 1, None),  # top_k == 1 is greedy whatever the temperature
        (0.8, 0, Reason.NON_GREEDY),  # top_k <= 0 means disabled
        (0.8, -1, Reason.NON_GREEDY),
        (0.8, None, Reason.NON_GREEDY),
        (0.8, 2, Reason.NON_GREEDY),
        (0.0, 50, None),
    ],
)
def test_greedy_rule(temperature, top_k, expected):
    assert check_admission(make(temperature=temperature, top_k=top_k)) is expected


def test_greedy_epsilon_value():
    assert GREEDY_TEMPERATURE_EPSILON == 1e-5


@pytest.mark.parametrize(
    ("max_model_len", "committed", "expected"),
    [
        (4096, 4094, None),  # max_model_len - 2: room for one more token
        (4096, 4095, Reason.MAX_SEQUENCE_LENGTH),  # max_model_len - 1
        (4096, 4096, Reason.MAX_SEQUENCE_LENGTH),
        (4096, 0, None),
        (2, 0, None),
        (2, 1, Reason.MAX_SEQUENCE_LENGTH),
    ],
)
def test_max_sequence_length_boundary(max_model_len, committed, expected):
    inp = make(max_model_len=max_model_len, committed_tokens=committed)
    assert check_admission(inp) is expected


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"queued_requests": -1}, "queued_requests"),
        ({"committed_tokens": -1}, "committed_tokens"),
        ({"remaining_output_tokens": -1}, "remaining_output_tokens"),
        ({"num_sequences": 0}, "num_sequences"),
        ({"tokens_per_step": 0}, "tokens_per_step"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"max_model_len": 0}, "max_model_len"),
    ],
)
def test_invalid_inputs_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        make(**overrides)


def test_required_fields_and_frozen():
    with pytest.raises(TypeError):
        AdmissionInput()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        AdmissionInput(4096, 16)  # type: ignore[misc]  # keyword-only
    inp = make()
    with pytest.raises(AttributeError):
        inp.enabled = False  # type: ignore[misc]


@pytest.mark.parametrize("flags", [(), ("-S",)], ids=["site", "no-site"])
def test_policy_imports_neither_torch_nor_ray(flags):
    code = (
        "import sys, policy, policy.admission, policy.quantum, policy.lanes, policy.reasons\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, *flags, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
