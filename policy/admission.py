"""Persistent-lane admission: the seed's rules, checked in the seed's order.

Source: the seed's (aiter MK1 integration) admission rules, docs/design.md "Admission".
Where our lane does more than the seed's (stop strings checked on the host after
each quantum, proven token- and text-identical to the standard lane by
``tests/replicas/persistent/test_host_checks.py``), the rule is kept behind a flag
that says so (``host_checks_stop_strings``). Pure: no torch, no ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from policy.reasons import Reason

GREEDY_TEMPERATURE_EPSILON = 1e-5
"""Temperatures at or below this count as greedy (the seed's MK1 admission rule)."""


@dataclass(frozen=True, kw_only=True)
class AdmissionInput:
    """Everything admission needs to know about one request, in plain values.

    Defaults mean "eligible"; only ``max_model_len`` and ``remaining_output_tokens``
    must be given. Counts are in tokens unless stated otherwise.

    Attributes:
        enabled: the persistent lane is enabled for this request/replica.
        speculative_decode: speculative decoding is configured.
        queued_requests: other requests queued or running on the persistent lane.
        num_sequences: sequences per request (OpenAI ``n`` / ``best_of``), >= 1.
        tokens_per_step: new tokens each decode step produces, >= 1.
        temperature: sampling temperature, >= 0.
        top_k: top-k sampling; ``None`` or <= 0 means disabled, 1 means greedy.
        logprobs: the request asks for logprobs.
        has_logits_processing: the logits are changed before every argmax
            (presence/frequency/repetition penalties): a persistent decoder's
            plain on-device argmax would pick other tokens. (``min_tokens``
            bans are not counted: our lane applies them on the host, by
            recomputing the one position where a banned token came out.)
        has_structured_output: the output is constrained by a grammar (a JSON schema's token mask,
            applied by the standard lane's sampler every token).
        has_stop_strings: the request has stop strings.
        host_checks_stop_strings: stop strings are checked on the host, after
            each quantum, and the output cut there (ours are: the ingress's output
            processor, ``replicas.output_processor``, for both lanes), so stop
            strings do not keep a request off the persistent lane; False restores
            the seed's rule (reason ``stop_strings``).
        has_stop_token_sequences: the request has multi-token stop sequences.
        kv_transfer: the request imports/exports KV cache.
        committed_tokens: tokens whose KV is in the cache (the prompt length
            before prefill), >= 0.
        max_model_len: the model's context length in tokens, >= 2.
        remaining_output_tokens: output tokens still allowed (``max_tokens``
            minus tokens already generated), >= 0.

    Raises:
        ValueError: on a negative count or temperature, ``num_sequences`` or
            ``tokens_per_step`` below 1, or ``max_model_len`` below 2.
    """

    enabled: bool = True
    speculative_decode: bool = False
    queued_requests: int = 0
    num_sequences: int = 1
    tokens_per_step: int = 1
    temperature: float = 0.0
    top_k: int | None = None
    logprobs: bool = False
    has_logits_processing: bool = False
    has_structured_output: bool = False
    has_stop_strings: bool = False
    host_checks_stop_strings: bool = True
    has_stop_token_sequences: bool = False
    kv_transfer: bool = False
    committed_tokens: int = 0
    max_model_len: int
    remaining_output_tokens: int

    def __post_init__(self) -> None:
        for name in ("queued_requests", "committed_tokens", "remaining_output_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("num_sequences", "tokens_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def is_greedy(self) -> bool:
        """True when decoding is argmax: temperature <= 1e-5, or top_k == 1."""
        return self.top_k == 1 or self.temperature <= GREEDY_TEMPERATURE_EPSILON


def check_admission(inp: AdmissionInput) -> Reason | None:
    """Return the first reason ``inp`` cannot run on the persistent lane, or None.

    Rules are checked in ``ADMISSION_ORDER`` (the seed's admission rules,
    docs/design.md "Admission"), so a request failing several reports the earliest.

    Args:
        inp: the request's admission facts (validated on construction).

    Returns:
        The first failing ``Reason``, or ``None`` if the request is admitted.
    """
    checks: tuple[tuple[bool, Reason], ...] = (
        (not inp.enabled, Reason.DISABLED),
        (inp.speculative_decode, Reason.SPECULATIVE_DECODE),
        (inp.queued_requests > 0, Reason.QUEUED_WORK),
        (inp.num_sequences != 1, Reason.UNSUPPORTED_DECODE_BATCH),
        (inp.tokens_per_step != 1, Reason.TOKENS_PER_QUERY),
        (not inp.is_greedy, Reason.NON_GREEDY),
        (inp.logprobs, Reason.LOGPROBS),
        (inp.has_logits_processing, Reason.LOGITS_PROCESSING),
        (inp.has_structured_output, Reason.STRUCTURED_OUTPUT),
        (inp.has_stop_strings and not inp.host_checks_stop_strings, Reason.STOP_STRINGS),
        (inp.has_stop_token_sequences, Reason.STOP_TOKEN_SEQUENCES),
        (inp.kv_transfer, Reason.KV_TRANSFER),
        (inp.committed_tokens >= inp.max_model_len - 1, Reason.MAX_SEQUENCE_LENGTH),
        (inp.remaining_output_tokens <= 0, Reason.NO_OUTPUT_REMAINING),
    )
    for failed, reason in checks:
        if failed:
            return reason
    return None
