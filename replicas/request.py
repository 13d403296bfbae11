"""Request state inside a replica: sampling parameters and the per-request record.

Small dataclasses with derived lengths as properties (mini-sglang style).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from replicas.structured_output import StructuredOutput


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (OpenAI / vLLM semantics).

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 means greedy; softmax temperature otherwise.
        top_p: nucleus mass in (0, 1] (Holtzman et al. 2019).
        top_k: keep the k most likely tokens; ``None`` or 0 disables.
        seed: per-request RNG seed (same seed, same output), or None.
        stop: stop strings; the matched text is not returned.
        stop_token_ids: extra token ids that end generation (kept in the output ids).
        ignore_eos: keep going past EOS ids.
        n: independent completions of the same prompt (share the prompt's KV pages).
        min_p: drop tokens whose probability is below ``min_p`` x the top
            token's (Nguyen et al. 2024, "min-p sampling"); 0 disables.
        presence_penalty / frequency_penalty: OpenAI's additive penalties over
            the tokens generated so far: ``logit -= presence * [count > 0] + frequency * count``.
        repetition_penalty: CTRL's multiplicative penalty (Keskar et al. 2019)
            over prompt and output tokens: positive logits are divided by it,
            negative ones multiplied; 1 disables.
        min_tokens: EOS and ``stop_token_ids`` are masked, and stop strings not
            checked, until this many tokens were generated.
        logprobs: None for no logprobs; k >= 0 to return the sampled token's
            log-probability plus the k most likely tokens' (from the raw logits).
        structured_output: a grammar the output must match (``response_format``; the
            standard lane masks the logits with it every token), or None.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def has_logits_processing(self) -> bool:
        """Logits change before the argmax (penalties or min_tokens bans)."""
        return self.has_penalties or self.min_tokens > 0

    @property
    def is_greedy(self) -> bool:
        """Greedy decoding: temperature ~0 or top_k == 1 (seed's rule, docs/design.md "Admission")."""
        return self.temperature <= 1e-5 or self.top_k == 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """OpenAI ``finish_reason`` values plus ``abort`` for cancelled requests."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class Request:
    """One sequence being generated.

    Attributes:
        request_id: unique id.
        prompt_token_ids: the prompt.
        params: sampling parameters.
        output_token_ids: generated ids so far.
        block_table: physical KV pages owned by this request, in order.
        num_computed_tokens: tokens whose KV is in the cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    index: int = 0
    """Which of the parent request's ``n`` completions this is."""
    leader: Request | None = None
    """For ``n > 1``: the sibling whose prefill the others wait for, to share its prompt pages."""
    page_hashes: list[bytes] = field(default_factory=list)
    """Prefix-cache hashes of this request's full pages whose KV is computed."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at (last) admission."""
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_new_tokens(self) -> int:
        """Tokens to feed in the next forward (prompt remainder, or the last sampled token)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def prefill_done(self) -> bool:
        """The prompt's KV is computed (decode has started or can start)."""
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def remaining_output_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
