"""Stop rules shared by both lanes: EOS ids, stop token ids, lengths, and stop strings.

:func:`stop_token_set` is the one statement of which token ids end a request: the standard lane's
sampler bans them under ``min_tokens``, :func:`check_stop` ends on them, and the persistent lane hands
them to its backend (``QuantumRequest.stop_token_ids``).

:func:`accept_tokens` is the one place where new tokens join a request's output:
the standard lane calls it with each sampled token, the persistent lane with a
whole quantum. It checks every token in order, as if they had come one at a
time, and cuts the output at the first token that ends the request, so both
lanes produce the same tokens and the same text for the same greedy tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from replicas.detokenizer import IncrementalDetokenizer
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
        text: their text delta (stop strings and a stop token's text removed).
        finish: why the request ended, or None if it continues.
        stop_string: the stop string that ended it, or None.
    """

    token_ids: list[int]
    text: str
    finish: FinishReason | None
    stop_string: str | None = None


def accept_tokens(req: Request, detok: IncrementalDetokenizer, tokens: list[int],
                  eos_token_ids: frozenset[int], max_model_len: int) -> Accepted:
    """Append ``tokens`` to ``req``'s output one by one until one ends the request.

    For each token, in order: append it, :func:`check_stop` (EOS, stop token ids,
    lengths), then the stop strings on the text so far (once ``min_tokens``
    tokens were generated). The first token that ends the request is the last
    one taken; the rest are dropped (on the persistent lane they are the part of
    a quantum beyond the end: their KV lies in pages the request still holds and
    frees when it ends). Text as vLLM: a stop string and what follows it are
    cut (kept up to the end of the stop string with ``include_stop_str_in_output``),
    and the text of a token that ends the request as a stop token (EOS or
    ``stop_token_ids``) is left out unless ``include_stop_str_in_output``.

    Without stop strings the tokens are checked one by one but detokenized in
    one call (the text is the same; a quantum then costs one decode); with stop
    strings every token is detokenized on its own, exactly as the standard lane
    does, so a stop string is found at the same token on both lanes.

    Args:
        req: the request; its ``output_token_ids`` grow in place.
        detok: the request's detokenizer (built with ``req.params.stop``).
        tokens: new token ids, in generation order (1 on the standard lane, a
            quantum's emitted tokens on the persistent lane).
        eos_token_ids: the model's EOS ids.
        max_model_len: the context limit in tokens.

    Returns:
        :class:`Accepted`: the tokens taken, their text and the finish reason.
    """
    p = req.params
    taken: list[int] = []
    finish: FinishReason | None = None
    if not detok.stop:
        for tok in tokens:
            req.output_token_ids.append(tok)
            taken.append(tok)
            finish = check_stop(req, eos_token_ids, max_model_len)
            if finish is not None:
                break
        shown = taken[:-1] if finish is FinishReason.STOP and not p.include_stop_str_in_output else taken
        return Accepted(taken, detok.append(shown, final=finish is not None), finish)
    text = ""
    for tok in tokens:
        req.output_token_ids.append(tok)
        taken.append(tok)
        finish = check_stop(req, eos_token_ids, max_model_len)
        hide = finish is FinishReason.STOP and not p.include_stop_str_in_output
        text += detok.append([] if hide else [tok], final=finish is not None,
                             check_stops=req.num_output_tokens >= p.min_tokens)
        if detok.stopped_on is not None:
            return Accepted(taken, text, FinishReason.STOP, detok.stopped_on)
        if finish is not None:
            break
    return Accepted(taken, text, finish)
