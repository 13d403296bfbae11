"""Table and property tests for policy.quantum (seed's quantum rule, docs/design.md "Quantum size")."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policy import MAX_QUANTUM_TOKENS, quantum_size


def test_cap_is_eight():
    assert MAX_QUANTUM_TOKENS == 8


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # the 8-token cap
        ({"remaining_output_tokens": 100, "max_model_len": 4096, "committed_tokens": 10}, 8),
        # remaining output tokens bind
        ({"remaining_output_tokens": 3, "max_model_len": 4096, "committed_tokens": 10}, 3),
        ({"remaining_output_tokens": 1, "max_model_len": 4096, "committed_tokens": 10}, 1),
        # context room (max_model_len - committed - 1) binds
        ({"remaining_output_tokens": 100, "max_model_len": 4096, "committed_tokens": 4090}, 5),
        ({"remaining_output_tokens": 100, "max_model_len": 4096, "committed_tokens": 4094}, 1),
        # nothing can be produced: zero, never negative
        ({"remaining_output_tokens": 100, "max_model_len": 4096, "committed_tokens": 4095}, 0),
        ({"remaining_output_tokens": 100, "max_model_len": 4096, "committed_tokens": 5000}, 0),
        ({"remaining_output_tokens": 0, "max_model_len": 4096, "committed_tokens": 10}, 0),
        # several EOS ids, host-side stop checks: at most 1
        (
            {
                "remaining_output_tokens": 100,
                "max_model_len": 4096,
                "committed_tokens": 10,
                "num_eos_ids": 2,
                "device_checks_stop_set": False,
            },
            1,
        ),
        (
            {
                "remaining_output_tokens": 0,
                "max_model_len": 4096,
                "committed_tokens": 10,
                "num_eos_ids": 2,
                "device_checks_stop_set": False,
            },
            0,
        ),
        # several EOS ids, but the backend checks the stop set on device: full quantum
        (
            {
                "remaining_output_tokens": 100,
                "max_model_len": 4096,
                "committed_tokens": 10,
                "num_eos_ids": 2,
                "device_checks_stop_set": True,
            },
            8,
        ),
        # one (or no) EOS id: host-side checks do not shrink the quantum
        (
            {
                "remaining_output_tokens": 100,
                "max_model_len": 4096,
                "committed_tokens": 10,
                "num_eos_ids": 1,
                "device_checks_stop_set": False,
            },
            8,
        ),
        (
            {
                "remaining_output_tokens": 100,
                "max_model_len": 4096,
                "committed_tokens": 10,
                "num_eos_ids": 0,
                "device_checks_stop_set": False,
            },
            8,
        ),
        # a custom cap
        (
            {
                "remaining_output_tokens": 100,
                "max_model_len": 4096,
                "committed_tokens": 10,
                "max_quantum": 4,
            },
            4,
        ),
    ],
)
def test_quantum_table(kwargs, expected):
    assert quantum_size(**kwargs) == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_quantum": 0}, "max_quantum"),
        ({"max_quantum": -1}, "max_quantum"),
        ({"remaining_output_tokens": -1}, "remaining_output_tokens"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"committed_tokens": -1}, "committed_tokens"),
        ({"num_eos_ids": -1}, "num_eos_ids"),
    ],
)
def test_invalid_inputs_raise(kwargs, message):
    args = {"remaining_output_tokens": 10, "max_model_len": 4096, "committed_tokens": 10}
    with pytest.raises(ValueError, match=message):
        quantum_size(**{**args, **kwargs})


@given(
    remaining=st.integers(min_value=0, max_value=10_000),
    max_model_len=st.integers(min_value=0, max_value=10_000),
    committed=st.integers(min_value=0, max_value=10_000),
    num_eos_ids=st.integers(min_value=0, max_value=4),
    device_checks_stop_set=st.booleans(),
)
def test_quantum_bounds_property(
    remaining, max_model_len, committed, num_eos_ids, device_checks_stop_set
):
    size = quantum_size(remaining, max_model_len, committed, num_eos_ids, device_checks_stop_set)
    assert 0 <= size <= MAX_QUANTUM_TOKENS
    assert size <= remaining
    assert size <= max(max_model_len - committed - 1, 0)
    if num_eos_ids > 1 and not device_checks_stop_set:
        assert size <= 1
    # Positive whenever every bound leaves room for a token.
    if remaining > 0 and max_model_len - committed - 1 > 0:
        assert size >= 1
