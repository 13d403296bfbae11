"""Pure serving decisions: admission reasons, quantum sizing, lane choice.

No torch, no ray: stdlib and dataclasses only (docs/design.md "Layers").
"""

from policy.admission import GREEDY_TEMPERATURE_EPSILON, AdmissionInput, check_admission
from policy.lanes import (
    Lane,
    LaneDecision,
    Mode,
    PersistentLaneStatus,
    choose_lane,
    loads_persistent_decoder,
    requires_persistent_decoder,
)
from policy.quantum import MAX_QUANTUM_TOKENS, quantum_size
from policy.reasons import ADMISSION_ORDER, ROUTER_REASONS, Reason

__all__ = [
    "ADMISSION_ORDER",
    "GREEDY_TEMPERATURE_EPSILON",
    "MAX_QUANTUM_TOKENS",
    "ROUTER_REASONS",
    "AdmissionInput",
    "Lane",
    "LaneDecision",
    "Mode",
    "PersistentLaneStatus",
    "Reason",
    "check_admission",
    "choose_lane",
    "loads_persistent_decoder",
    "quantum_size",
    "requires_persistent_decoder",
]
