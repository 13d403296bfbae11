"""Stable reason strings for why a request does not run on the persistent lane.

The values are span attributes and metric labels, so they never change once
released. Admission reasons come from the seed's admission rules (docs/design.md
"Admission"); the router adds its own reasons about the persistent lane itself
(docs/design.md "The router's own reasons").
"""

from __future__ import annotations

from enum import Enum


class Reason(str, Enum):
    """Why a request was not (or could not be) decoded on the persistent lane.

    Each member's ``__doc__`` says what triggers it. ``str(reason)`` and
    ``reason.value`` are the stable snake_case string.
    """

    def __new__(cls, value: str, doc: str) -> Reason:
        member = str.__new__(cls, value)
        member._value_ = value
        member.__doc__ = doc
        return member

    def __str__(self) -> str:
        return self.value

    # Admission reasons (seed's rules, docs/design.md "Admission"), in check order.
    DISABLED = ("disabled", "Persistent lane turned off (mode off or replica).")
    SPECULATIVE_DECODE = ("speculative_decode", "Speculative decoding is configured.")
    QUEUED_WORK = ("queued_work", "Other requests are queued or running on the persistent lane.")
    UNSUPPORTED_DECODE_BATCH = ("unsupported_decode_batch", "n > 1 or best_of > 1.")
    TOKENS_PER_QUERY = ("tokens_per_query", "A step would not add exactly one token.")
    NON_GREEDY = ("non_greedy", "Sampling is not greedy: temperature > 1e-5 and top_k != 1.")
    LOGPROBS = ("logprobs", "The request asks for logprobs.")
    LOGITS_PROCESSING = (
        "logits_processing",
        "Greedy but the logits are changed first (penalties, min_tokens): ours, beyond the seed's list.",
    )
    STRUCTURED_OUTPUT = (
        "structured_output",
        "The output is constrained by a grammar (response_format json_object/json_schema): the token mask "
        "needs the host every token, so it runs on the standard lane's sampler.",
    )
    STOP_STRINGS = ("stop_strings", "The request has stop strings.")
    STOP_TOKEN_SEQUENCES = ("stop_token_sequences", "The request has multi-token stop sequences.")
    KV_TRANSFER = ("kv_transfer", "The request imports or exports KV cache.")
    MAX_SEQUENCE_LENGTH = ("max_sequence_length", "Committed tokens >= max_model_len - 1.")
    NO_OUTPUT_REMAINING = ("no_output_remaining", "No output tokens left (max_tokens spent).")

    # Router-only reasons (docs/design.md "The router's own reasons").
    LANE_UNAVAILABLE = ("lane_unavailable", "No persistent lane is deployed or reachable.")
    PERSISTENT_CAPACITY = ("persistent_capacity", "All persistent replicas are busy.")
    DECODER_UNHEALTHY = ("decoder_unhealthy", "Decoder marked unhealthy by a failure.")
    UNSUPPORTED_ENVELOPE = ("unsupported_envelope", "Model/device/config outside decoder support.")


ADMISSION_ORDER: tuple[Reason, ...] = (
    Reason.DISABLED,
    Reason.SPECULATIVE_DECODE,
    Reason.QUEUED_WORK,
    Reason.UNSUPPORTED_DECODE_BATCH,
    Reason.TOKENS_PER_QUERY,
    Reason.NON_GREEDY,
    Reason.LOGPROBS,
    Reason.LOGITS_PROCESSING,
    Reason.STRUCTURED_OUTPUT,
    Reason.STOP_STRINGS,
    Reason.STOP_TOKEN_SEQUENCES,
    Reason.KV_TRANSFER,
    Reason.MAX_SEQUENCE_LENGTH,
    Reason.NO_OUTPUT_REMAINING,
)
"""Admission reasons in the order ``check_admission`` tests them (seed's order)."""

ROUTER_REASONS: tuple[Reason, ...] = (
    Reason.LANE_UNAVAILABLE,
    Reason.PERSISTENT_CAPACITY,
    Reason.DECODER_UNHEALTHY,
    Reason.UNSUPPORTED_ENVELOPE,
)
"""Reasons only the router produces, about the persistent lane rather than the request."""
