"""The output processor (``replicas.output_processor``): text and stop strings made by the stream's reader,
on SmolLM2's real tokenizer. (Per-quantum vs per-token equality at every stop position, and both lanes end
to end, are in ``tests/replicas/persistent/test_host_checks.py``; the served abort in
``tests/deployments/test_serving.py``.)"""

from __future__ import annotations

import asyncio

from replicas.messages import GenerationChunk, GenerationError, TokenLogprobs
from replicas.output_processor import OutputProcessor, texts_of, with_text
from replicas.request import SamplingParams

WORDS = " the quick brown fox jumps over the lazy dog and runs far away"


def _ids(tokenizer, text: str = WORDS) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _chunks(ids: list[int], index: int = 0, finish: str | None = "length", logprobs: bool = False):
    """One chunk per token, as the standard lane sends them (the last with ``finish``)."""
    return [GenerationChunk("r", [t], finish_reason=finish if j == len(ids) - 1 else None, num_output_tokens=j + 1,
                            index=index, logprobs=[TokenLogprobs(t, -0.5)] if logprobs else None)
            for j, t in enumerate(ids)]


def test_text_is_the_decoded_output_and_usage_is_the_engines(tokenizer):
    ids = _ids(tokenizer)
    out = texts_of(_chunks(ids), tokenizer, SamplingParams(max_tokens=len(ids)))
    assert "".join(c.text for c in out) == tokenizer.decode(ids, skip_special_tokens=True)
    assert [t for c in out for t in c.token_ids] == ids and out[-1].num_output_tokens == len(ids)


def test_a_stop_string_cuts_tokens_logprobs_and_usage_at_the_token_that_completes_it(tokenizer):
    ids = _ids(tokenizer)
    processor = OutputProcessor(tokenizer, SamplingParams(max_tokens=50, stop=("lazy",)))
    quantum = GenerationChunk("r", ids, num_output_tokens=len(ids), logprobs=[TokenLogprobs(t, -1.0) for t in ids])
    out = processor.process(quantum)
    k = next(j for j in range(len(ids)) if "lazy" in tokenizer.decode(ids[: j + 1]))
    assert out.token_ids == ids[: k + 1] and len(out.logprobs) == k + 1
    assert out.finish_reason == "stop" and out.num_output_tokens == k + 1
    assert out.text == tokenizer.decode(ids[: k + 1]).split("lazy")[0]
    assert processor.finished and processor.engine_busy  # the engine had not ended it: the reader must abort
    assert processor.process(GenerationChunk("r", [ids[0]], num_output_tokens=len(ids) + 1)) is None


def test_stop_strings_wait_for_min_tokens(tokenizer):
    """" the" first ends token ``first``; with ``min_tokens`` past it, the second " the" ends the request."""
    ids = _ids(tokenizer)
    first = next(j for j in range(len(ids)) if " the" in tokenizer.decode(ids[: j + 1]))
    later = next(j for j in range(first + 1, len(ids)) if tokenizer.decode(ids[: j + 1]).count(" the") == 2)
    out = texts_of(_chunks(ids), tokenizer, SamplingParams(max_tokens=50, stop=(" the",), min_tokens=later))
    assert [t for c in out for t in c.token_ids] == ids[: later + 1] and out[-1].finish_reason == "stop"


def test_a_stop_token_s_text_is_left_out_unless_asked_for(tokenizer):
    ids = _ids(tokenizer)
    for include in (False, True):
        params = SamplingParams(max_tokens=50, stop_token_ids=(ids[-1],), include_stop_str_in_output=include)
        out = texts_of(_chunks(ids, finish="stop"), tokenizer, params)
        shown = ids if include else ids[:-1]
        assert "".join(c.text for c in out) == tokenizer.decode(shown, skip_special_tokens=True)


def test_n_choices_end_one_by_one_and_a_cut_choice_drops_its_later_chunks(tokenizer):
    a, b = _ids(tokenizer), _ids(tokenizer, " a lazy cat sleeps all day long in the sun")
    processor = OutputProcessor(tokenizer, SamplingParams(n=2, max_tokens=50, stop=("lazy",)))
    interleaved = [c for pair in zip(_chunks(a, 0), _chunks(b, 1), strict=False) for c in pair]
    shown = [out for c in interleaved if (out := processor.process(c)) is not None]
    by_choice = {i: "".join(c.text for c in shown if c.index == i) for i in (0, 1)}
    assert by_choice == {0: tokenizer.decode(a).split("lazy")[0], 1: tokenizer.decode(b).split("lazy")[0]}
    assert [c.finish_reason for c in shown if c.finish_reason] == ["stop", "stop"]
    assert processor.finished


def test_with_text_stops_reading_and_closes_the_stream_once_a_stop_string_ends_the_request(tokenizer):
    ids = _ids(tokenizer)
    read, closed = [], []

    async def engine():
        try:
            for c in _chunks(ids):
                read.append(c)
                yield c
            yield GenerationError("r", "never reached", "standard")
        finally:
            closed.append(True)

    async def run():
        return [item async for item in with_text(engine(), tokenizer, SamplingParams(max_tokens=50, stop=("fox",)))]

    out = asyncio.run(run())
    k = next(j for j in range(len(ids)) if "fox" in tokenizer.decode(ids[: j + 1]))
    assert len(read) == k + 1 and closed == [True]  # nothing read past the cut: the stream was closed there
    assert out[-1].finish_reason == "stop" and "".join(c.text for c in out) == tokenizer.decode(ids).split("fox")[0]
