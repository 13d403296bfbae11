"""Per-token stop rules shared by both lanes (EOS ids, stop token ids, lengths).

:func:`stop_token_set` is the one statement of which token ids end a request: the standard lane's
sampler bans them under ``min_tokens``, :func:`check_stop` ends on them, and the persistent lane hands
them to its backend (``QuantumRequest.stop_token_ids``).
"""

from __future__ import annotations

from collections.abc import Iterable

from replicas.request import FinishReason, Request, SamplingParams


def stop_token_set(params: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """The token ids that end generation for ``params``: its ``stop_token_ids`` and, unless ``ignore_eos``,
    the model's EOS ids (vLLM's rule). Empty: nothing but the length ends the request."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return frozenset(ids)


def check_stop(req: Request, eos_token_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
    """Finish reason after ``req``'s newest output token, or None to continue.

    Order as in vLLM: nothing but the context limit before ``min_tokens``;
    then EOS (unless ``ignore_eos``), ``stop_token_ids``, then ``max_tokens``
    and the context limit (both ``length``).
    """
    last = req.output_token_ids[-1]
    if req.num_output_tokens < req.params.min_tokens:  # EOS/stop ids are masked until then
        return FinishReason.LENGTH if req.num_tokens >= max_model_len else None
    if last in stop_token_set(req.params, eos_token_ids):
        return FinishReason.STOP
    if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
