"""Table tests for policy.lanes (docs/design.md "Two lanes and the router", "Admission")."""

from __future__ import annotations

import pytest

from policy import (
    Lane,
    LaneDecision,
    Mode,
    PersistentLaneStatus,
    Reason,
    choose_lane,
    loads_persistent_decoder,
    requires_persistent_decoder,
)

READY = PersistentLaneStatus(available=True, healthy=True, has_capacity=True)
DOWN = PersistentLaneStatus(
    available=False, healthy=False, has_capacity=False, envelope_supported=False
)

# (case id, admission reason, status, decision under auto/required)
CASES = [
    ("admitted", None, READY, LaneDecision(Lane.PERSISTENT, None)),
    ("admission_reason", Reason.NON_GREEDY, READY, LaneDecision(Lane.STANDARD, Reason.NON_GREEDY)),
    ("admission_beats_status", Reason.LOGPROBS, DOWN, LaneDecision(Lane.STANDARD, Reason.LOGPROBS)),
    (
        "unavailable",
        None,
        PersistentLaneStatus(available=False, healthy=True, has_capacity=True),
        LaneDecision(Lane.STANDARD, Reason.LANE_UNAVAILABLE),
    ),
    ("unavailable_first", None, DOWN, LaneDecision(Lane.STANDARD, Reason.LANE_UNAVAILABLE)),
    (
        "envelope",
        None,
        PersistentLaneStatus(
            available=True, healthy=True, has_capacity=True, envelope_supported=False
        ),
        LaneDecision(Lane.STANDARD, Reason.UNSUPPORTED_ENVELOPE),
    ),
    (
        "envelope_before_health",
        None,
        PersistentLaneStatus(
            available=True, healthy=False, has_capacity=False, envelope_supported=False
        ),
        LaneDecision(Lane.STANDARD, Reason.UNSUPPORTED_ENVELOPE),
    ),
    (
        "unhealthy",
        None,
        PersistentLaneStatus(available=True, healthy=False, has_capacity=True),
        LaneDecision(Lane.STANDARD, Reason.DECODER_UNHEALTHY),
    ),
    (
        "unhealthy_before_capacity",
        None,
        PersistentLaneStatus(available=True, healthy=False, has_capacity=False),
        LaneDecision(Lane.STANDARD, Reason.DECODER_UNHEALTHY),
    ),
    (
        "no_capacity",
        None,
        PersistentLaneStatus(available=True, healthy=True, has_capacity=False),
        LaneDecision(Lane.STANDARD, Reason.PERSISTENT_CAPACITY),
    ),
]

TABLE = [
    pytest.param(
        mode,
        reason,
        status,
        LaneDecision(Lane.STANDARD, Reason.DISABLED) if mode is Mode.OFF else expected,
        id=f"{mode.value}-{case}",
    )
    for mode in Mode
    for case, reason, status, expected in CASES
]


@pytest.mark.parametrize(("mode", "admission_reason", "status", "expected"), TABLE)
def test_choose_lane(mode, admission_reason, status, expected):
    decision = choose_lane(mode, admission_reason, status)
    assert decision == expected
    assert (decision.lane is Lane.PERSISTENT) == (decision.reason is None)


@pytest.mark.parametrize(
    ("mode", "loads", "requires"),
    [(Mode.OFF, False, False), (Mode.AUTO, True, False), (Mode.REQUIRED, True, True)],
)
def test_mode_startup_flags(mode, loads, requires):
    assert loads_persistent_decoder(mode) is loads
    assert requires_persistent_decoder(mode) is requires


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("off", Mode.OFF),
        ("auto", Mode.AUTO),
        ("required", Mode.REQUIRED),
        (" Auto ", Mode.AUTO),
        ("REQUIRED", Mode.REQUIRED),
        (Mode.AUTO, Mode.AUTO),
    ],
)
def test_mode_parse(text, expected):
    assert Mode.parse(text) is expected


@pytest.mark.parametrize("text", ["", "on", "persistent", "auto-ish"])
def test_mode_parse_rejects_unknown_and_lists_valid_values(text):
    with pytest.raises(ValueError, match="off, auto, required"):
        Mode.parse(text)


def test_enum_values_are_stable_strings():
    assert [m.value for m in Mode] == ["off", "auto", "required"]
    assert [lane.value for lane in Lane] == ["persistent", "standard"]
    assert str(Mode.AUTO) == "auto" and str(Lane.STANDARD) == "standard"


def test_decision_and_status_are_frozen():
    with pytest.raises(AttributeError):
        READY.healthy = False  # type: ignore[misc]
    with pytest.raises(AttributeError):
        LaneDecision(Lane.PERSISTENT, None).lane = Lane.STANDARD  # type: ignore[misc]
