"""Text and stop strings, outside the engine: token-id chunks in, chunks with text out.

The engines emit token ids only (:class:`~replicas.messages.GenerationChunk` with ``text`` empty): EOS,
stop token ids and lengths end a request in the engine (:mod:`replicas.stops`), nothing there decodes
text. The process that reads a request's stream (the ingress, which holds the same tokenizer) runs one
:class:`OutputProcessor` per request: it detokenizes each choice incrementally
(:class:`~replicas.detokenizer.IncrementalDetokenizer`), looks for the stop strings, and cuts a choice
at the token whose text completes one. The caller then stops reading the request's stream once every
choice has ended; closing the stream aborts the request in the engine at its next step, which frees its
pages (vLLM's ``OutputProcessor`` in its API server process likewise detokenizes and aborts requests
that a stop string ended).

The rules are those the engines applied before this moved out, so tokens and text do not change:

* tokens are taken in order, as if they came one at a time; with stop strings each token is detokenized
  on its own, so a stop string is found at the same token whatever the chunking (a persistent quantum
  or one standard token); without stop strings a chunk is detokenized in one call;
* stop strings are looked for once ``min_tokens`` tokens were generated (vLLM's rule);
* a stop string and what follows it are cut (kept up to its end with ``include_stop_str_in_output``), and
  the tokens after the one that completed it are dropped;
* the text of a token that ended the request in the engine as a stop token (finish ``stop``: EOS or
  ``stop_token_ids``) is left out unless ``include_stop_str_in_output``.

A choice of an ``n > 1`` request that a stop string ended keeps decoding in the engine until its request
ends (its output is dropped here): one stream carries every choice, and only closing it aborts.

This module needs neither torch nor Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from replicas.detokenizer import IncrementalDetokenizer
from replicas.messages import GenerationChunk
from replicas.request import SamplingParams


class _Choice:
    """One choice's detokenizer and counters."""

    __slots__ = ("detok", "tokens", "ended", "cut")

    def __init__(self, detok: IncrementalDetokenizer):
        self.detok = detok
        self.tokens = 0  # output tokens taken so far
        self.ended = False  # its last chunk was passed on
        self.cut = False  # a stop string ended it here (the engine may still be decoding it)


class OutputProcessor:
    """Turns one request's token-id chunks into chunks with text, cut at stop strings.

    Args:
        tokenizer: the model's tokenizer (``decode(ids, skip_special_tokens=True)``), the engine's own.
        params: the request's sampling parameters (``n``, ``stop``, ``include_stop_str_in_output``,
            ``min_tokens``).
    """

    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self._choices: dict[int, _Choice] = {}

    def _choice(self, index: int) -> _Choice:
        choice = self._choices.get(index)
        if choice is None:
            p = self.params
            choice = self._choices[index] = _Choice(
                IncrementalDetokenizer(self.tokenizer, p.stop, p.include_stop_str_in_output))
        return choice

    @property
    def finished(self) -> bool:
        """Every one of the request's ``n`` choices has passed on its last chunk."""
        return len(self._choices) >= self.params.n and all(c.ended for c in self._choices.values())

    @property
    def engine_busy(self) -> bool:
        """Some choice ended here by a stop string while the engine may still be decoding it."""
        return any(c.cut for c in self._choices.values())

    def process(self, chunk: GenerationChunk) -> GenerationChunk | None:
        """``chunk`` with its text (and, where a stop string ends its choice, its tokens, logprobs, finish
        reason and output count cut there); None for a chunk of a choice that already ended."""
        choice = self._choice(chunk.index)
        if choice.ended:
            return None
        detok, p = choice.detok, self.params
        tokens, finish = chunk.token_ids, chunk.finish_reason
        hide_last = finish == "stop" and not p.include_stop_str_in_output  # a stop token's text is left out
        if not detok.stop:
            choice.tokens += len(tokens)
            text = detok.append(tokens[:-1] if hide_last and tokens else tokens, final=finish is not None)
            choice.ended = finish is not None
            return dataclasses.replace(chunk, text=text)
        text = ""
        for j, tok in enumerate(tokens):
            choice.tokens += 1
            last = j == len(tokens) - 1
            text += detok.append([] if last and hide_last else [tok], final=last and finish is not None,
                                 check_stops=choice.tokens >= p.min_tokens)
            if detok.stopped_on is not None:
                choice.ended, choice.cut = True, not (last and finish is not None)
                logprobs = chunk.logprobs[: j + 1] if chunk.logprobs is not None else None
                return dataclasses.replace(chunk, token_ids=tokens[: j + 1], text=text, finish_reason="stop",
                                           logprobs=logprobs,
                                           num_output_tokens=chunk.num_output_tokens - (len(tokens) - j - 1))
        choice.ended = finish is not None
        return dataclasses.replace(chunk, text=text)


async def with_text(items: AsyncIterator, tokenizer, params: SamplingParams) -> AsyncIterator:
    """``items`` (a request's stream: chunks, rejections, errors) with each chunk through an
    :class:`OutputProcessor`; stops reading ``items`` (and closes it, which aborts the request in the
    engine) once a stop string ended the last open choice.

    Args:
        items: an async iterator of :mod:`replicas.messages` objects with an ``aclose``.
        tokenizer: the model's tokenizer.
        params: the request's sampling parameters.
    """
    processor = OutputProcessor(tokenizer, params)
    try:
        async for item in items:
            if isinstance(item, GenerationChunk):
                item = processor.process(item)
                if item is None:
                    continue
            yield item
            if processor.finished and processor.engine_busy:
                return
    finally:
        await items.aclose()


def texts_of(chunks: list, tokenizer, params: SamplingParams) -> list:
    """The chunks of one request (a finished list, e.g. an engine's output in a test or benchmark) through
    an :class:`OutputProcessor`: chunks with text, cut at stop strings; other items unchanged."""
    processor = OutputProcessor(tokenizer, params)
    out = []
    for item in chunks:
        if isinstance(item, GenerationChunk):
            item = processor.process(item)
            if item is None:
                continue
        out.append(item)
    return out
