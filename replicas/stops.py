"""Per-token stop rules shared by both lanes (EOS ids, stop token ids, lengths)."""

from __future__ import annotations

from replicas.request import FinishReason, Request


def check_stop(req: Request, eos_token_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
    """Finish reason after ``req``'s newest output token, or None to continue.

    Order as in vLLM: nothing but the context limit before ``min_tokens``;
    then EOS (unless ``ignore_eos``), ``stop_token_ids``, then ``max_tokens``
    and the context limit (both ``length``).
    """
    last = req.output_token_ids[-1]
    if req.num_output_tokens < req.params.min_tokens:  # EOS/stop ids are masked until then
        return FinishReason.LENGTH if req.num_tokens >= max_model_len else None
    if not req.params.ignore_eos and last in eos_token_ids:
        return FinishReason.STOP
    if last in req.params.stop_token_ids:
        return FinishReason.STOP
    if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
