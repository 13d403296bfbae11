"""Request state inside a replica: sampling parameters and the per-request record.

Small dataclasses with derived lengths as properties (mini-sglang style).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def is_greedy(self) -> bool:
        """Greedy decoding: temperature ~0 or top_k == 1 (seed's rule, DESIGN.md)."""
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
    def remaining_output_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
