"""Stop rules shared by both lanes: EOS ids, stop token ids and lengths (stop strings: :mod:`replicas.output_processor`).

:func:`stop_token_set` is the one statement of which token ids end a request: the standard lane's
sampler bans them under ``min_tokens``, :func:`check_stop` ends on them, and the persistent lane hands
them to its backend (``QuantumRequest.stop_token_ids``).

:func:`accept_tokens` is the one place where new tokens join a request's output
in the engine: the standard lane calls it with each sampled token, the
persistent lane with a whole quantum. It checks every token in order, as if
they had come one at a time, and cuts the output at the first token that ends
the request, so both lanes produce the same tokens for the same greedy tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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
    and the context limit (both ``length``). ``stop`` means a stop token ended
    the request (its text is then left out, see :func:`accept_tokens`).
    """
    last = req.output_token_ids[-1]
    if req.num_output_tokens < req.params.min_tokens:  # EOS/stop ids are masked until then
        return FinishReason.LENGTH if req.num_tokens >= max_model_len else None
    if last in stop_token_set(req.params, eos_token_ids):
        return FinishReason.STOP
    if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


@dataclass
class Accepted:
    """What :func:`accept_tokens` took from a run of new tokens.

    Attributes:
        token_ids: the tokens appended to the output (a prefix of the tokens given).
        finish: why the request ended, or None if it continues.
    """

    token_ids: list[int]
    finish: FinishReason | None


def accept_tokens(req: Request, tokens: list[int], eos_token_ids: frozenset[int], max_model_len: int) -> Accepted:
    """Append ``tokens`` to ``req``'s output one by one until one ends the request.

    For each token, in order: append it, then :func:`check_stop` (EOS, stop token ids, ``max_tokens``, the
    context limit). The first token that ends the request is the last one taken; the rest are dropped (on
    the persistent lane they are the part of a quantum beyond the end: their KV lies in pages the request
    still holds and frees when it ends). Stop *strings* are not checked here: text is made outside the
    engine, where the output processor (:mod:`replicas.output_processor`) detokenizes, cuts at a stop
    string and ends the request's stream, which aborts it in the engine.

    Args:
        req: the request; its ``output_token_ids`` grow in place.
        tokens: new token ids, in generation order (1 on the standard lane, a
            quantum's emitted tokens on the persistent lane).
        eos_token_ids: the model's EOS ids.
        max_model_len: the context limit in tokens.

    Returns:
        :class:`Accepted`: the tokens taken and the finish reason.
    """
    taken: list[int] = []
    finish: FinishReason | None = None
    for tok in tokens:
        req.output_token_ids.append(tok)
        taken.append(tok)
        finish = check_stop(req, eos_token_ids, max_model_len)
        if finish is not None:
            break
    return Accepted(taken, finish)
