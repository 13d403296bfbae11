"""Messages to and from a replica's engine actor.

Plain dataclasses so they pickle across Ray hops unchanged. The caller sends a
:class:`GenerateRequest`; the actor streams back zero or
more :class:`GenerationChunk` ending with one whose ``finish_reason`` is set, or
a single :class:`Rejection` (nothing ran: the caller may fall back), or a
:class:`GenerationError` (terminal for that request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from policy import AdmissionInput
from replicas.request import SamplingParams
from replicas.stream_channel import ReplyTo


@dataclass
class GenerateRequest:
    """One generation request as the ingress hands it to a replica.

    Attributes:
        request_id: unique id (also the trace's request id).
        prompt_token_ids: the tokenized prompt (chat template applied).
        params: sampling parameters (``params.n`` completions; the standard
            lane streams chunks of all of them, told apart by ``index``).
        has_stop_token_sequences: multi-token stop sequences were given.
        kv_transfer: disaggregated-serving KV transfer was requested.
        trace_context: W3C trace context carrier (``{"traceparent": ...}``) of
            the caller's span; each Ray hop replaces it with its own span's so
            the next hop's span is its child (``ops.telemetry.tracing.inject_context``).
        lane_override: ``"standard"`` or ``"persistent"`` when the client forced
            a lane (request header ``x-lane``), else None.
        caller: ``(actor id, actor handle)`` of the process that will read the
            stream (the ingress replica), so a replica can stop the work of a
            caller that died; None outside an actor. Not passed to engines.
        reply_to: where the engine sends the request's output directly (a
            :class:`replicas.stream_channel.ReplyTo` of the router's listener), or None: back
            through Ray, the way the request came.
        spilled: an eligible request the router sent to the standard lane because every
            persistent replica was busy (reason ``persistent_capacity``); engines count these as
            persistent demand (stats ``spilled_running``) for the persistent pool's autoscaling.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    has_stop_token_sequences: bool = False
    kv_transfer: bool = False
    trace_context: dict[str, str] = field(default_factory=dict)
    lane_override: str | None = None
    caller: tuple[str, Any] | None = None
    spilled: bool = False
    reply_to: ReplyTo | None = None

    @property
    def num_sequences(self) -> int:
        return self.params.n

    @property
    def logprobs(self) -> bool:
        """The request needs the logits on the host: token or prompt logprobs."""
        return self.params.logprobs is not None or self.params.prompt_logprobs is not None

    def admission_input(self, max_model_len: int, enabled: bool = True, queued_requests: int = 0) -> AdmissionInput:
        """The facts ``policy.check_admission`` needs about this request (router and lane ask the same way).

        ``min_tokens`` is not logits processing here: the persistent lane applies its bans on the host
        (``PersistentLane._min_tokens_ban_index``); penalties are."""
        p = self.params
        return AdmissionInput(
            enabled=enabled, queued_requests=queued_requests, num_sequences=p.n,
            temperature=p.temperature, top_k=p.top_k, logprobs=self.logprobs,
            has_logits_processing=p.has_penalties, has_structured_output=p.structured_output is not None,
            has_stop_strings=bool(p.stop),
            has_stop_token_sequences=self.has_stop_token_sequences, kv_transfer=self.kv_transfer,
            committed_tokens=len(self.prompt_token_ids), max_model_len=max_model_len,
            remaining_output_tokens=p.max_tokens,
        )


@dataclass
class TokenLogprobs:
    """Log-probabilities for one generated token (natural log, from the raw logits).

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability.
        top: the ``k`` most likely ``(token_id, logprob)`` pairs, most likely first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationChunk:
    """New tokens of one request.

    Attributes:
        token_ids: ids generated since the previous chunk (a whole quantum on
            the persistent lane).
        text: their detokenized text (stop strings removed).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or None while running.
        num_prompt_tokens / num_output_tokens: usage counters so far.
        lane: ``"persistent"`` or ``"standard"``.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    lane: str = "standard"
    index: int = 0
    """Which of the request's ``n`` completions this chunk belongs to."""
    logprobs: list[TokenLogprobs] | None = None
    """Per token in ``token_ids`` when the request asked for logprobs."""
    fallback_reason: str | None = None
    """Set on the chunk where a persistent request continued without its decoder (prelaunch error mid-request)."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """On a sequence's first chunk when ``params.prompt_logprobs`` is set: one entry per prompt token
    (None for the first, which nothing predicts)."""


@dataclass
class Rejection:
    """Prelaunch rejection: nothing in the KV cache changed; route elsewhere."""

    request_id: str
    reason: str
    lane: str = "persistent"
    stage: str = "prelaunch"
    detail: str = ""


@dataclass
class GenerationError:
    """A failure that ends the request (after a launch, or an engine fault)."""

    request_id: str
    message: str
    lane: str
    stage: str = "postlaunch"
    reason: str = "backend_launch_error"


@dataclass
class Started:
    """First item of a persistent replica's stream: a replica took the request (it left Serve's queue).

    The router waits for it at most ``spillover_wait_s`` before spilling the
    request to the standard lane (reason ``persistent_capacity``). Never
    forwarded to the client.
    """

    request_id: str
