"""Unit tests of the OpenAI formatters, request mapping and tokenize helpers (no Ray, no model).

Engine streams are hand-made :class:`GenerationChunk` sequences; token texts come
from the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from deployments.openai_format import ChatFormat, CompletionFormat, TokenText
from deployments.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from deployments.tokenize_api import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    encode_chat,
    tokenize,
)
from replicas.messages import GenerationChunk, GenerationError, TokenLogprobs

MODEL = "smollm2-135m-instruct"
PROMPT_TOKENS = 7


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from replicas.models.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(MODEL, progress=False))


@pytest.fixture(scope="module")
def tt(tokenizer):
    return TokenText(tokenizer)


# ---- helpers ---------------------------------------------------------------------------------

def _lp(token_id: int, k: int, alt: list[int]) -> TokenLogprobs:
    """The sampled token first among ``k`` alternatives (descending), like a greedy engine would report."""
    top = [(t, -0.1 - 0.7 * j) for j, t in enumerate(([token_id] + [a for a in alt if a != token_id])[:k])]
    return TokenLogprobs(token_id, -0.1, top)


def _stream(tokenizer, texts: dict[int, str], order: list[int], k: int | None = None,
            finish: dict[int, str] | None = None) -> list[GenerationChunk]:
    """One chunk per token, choices interleaved in ``order``; each choice's last chunk is final."""
    ids = {i: tokenizer.encode(t, add_special_tokens=False) for i, t in texts.items()}
    pos = dict.fromkeys(ids, 0)
    finish = finish or {}
    out = []
    for i in order:
        j = pos[i]
        tid = ids[i][j]
        pos[i] = j + 1
        last = pos[i] == len(ids[i])
        out.append(GenerationChunk(
            "req-1", [tid], tokenizer.decode(ids[i][: j + 1])[len(tokenizer.decode(ids[i][:j])):],
            finish_reason=finish.get(i, "stop") if last else None,
            num_prompt_tokens=PROMPT_TOKENS, num_output_tokens=j + 1, index=i,
            logprobs=None if k is None else [_lp(tid, k, _alternatives(tokenizer))],
        ))
    return out


def _alternatives(tokenizer) -> list[int]:
    return tokenizer.convert_tokens_to_ids([",", ".", "!"])


def _interleave(tokenizer, texts: dict[int, str]) -> list[int]:
    lens = {i: len(tokenizer.encode(t, add_special_tokens=False)) for i, t in texts.items()}
    order, left = [], dict(lens)
    while any(left.values()):
        for i in sorted(left):
            if left[i]:
                order.append(i)
                left[i] -= 1
    return order


async def _agen(items):
    for item in items:
        yield item


def _collect(fmt, items, n):
    async def go():
        rest = _agen(items[1:])
        return await fmt.collect(items[0], rest, n)
    return asyncio.run(go())


def _sse(fmt, items, n, include_usage=False) -> list[dict | str]:
    async def go():
        rest = _agen(items[1:])
        return [ev async for ev in fmt.sse(items[0], rest, n, include_usage)]
    events = asyncio.run(go())
    out = []
    for ev in events:
        assert ev.startswith("data: ") and ev.endswith("\n\n")
        payload = ev[len("data: "):-2]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


TEXTS = {0: "Paris is the capital.", 1: "The answer is Paris, France."}


# ---- chat ------------------------------------------------------------------------------------

def test_chat_collect_demultiplexes_n2_with_usage(tokenizer):
    items = _stream(tokenizer, TEXTS, _interleave(tokenizer, TEXTS), finish={0: "stop", 1: "length"})
    body = _collect(ChatFormat(MODEL), items, 2)
    assert body["object"] == "chat.completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == [TEXTS[0], TEXTS[1]]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert all(c["logprobs"] is None for c in body["choices"])
    n_out = [len(tokenizer.encode(t, add_special_tokens=False)) for t in TEXTS.values()]
    assert body["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": sum(n_out),
                             "total_tokens": PROMPT_TOKENS + sum(n_out)}


def test_chat_collect_logprobs_shape(tokenizer, tt):
    items = _stream(tokenizer, TEXTS, _interleave(tokenizer, TEXTS), k=3)
    body = _collect(ChatFormat(MODEL, tt, logprobs=True), items, 2)
    for i, choice in enumerate(body["choices"]):
        ids = tokenizer.encode(TEXTS[i], add_special_tokens=False)
        content = choice["logprobs"]["content"]
        assert [e["token"] for e in content] == [tokenizer.decode([t]) for t in ids]
        assert "".join(e["token"] for e in content) == TEXTS[i]
        for e in content:
            assert e["logprob"] == pytest.approx(-0.1)
            assert e["bytes"] == list(e["token"].encode())
            assert len(e["top_logprobs"]) == 3
            assert e["top_logprobs"][0]["token"] == e["token"]
            values = [t["logprob"] for t in e["top_logprobs"]]
            assert values == sorted(values, reverse=True)
            assert all(set(t) == {"token", "logprob", "bytes"} for t in e["top_logprobs"])


def test_chat_sse_n2_interleaved_with_usage_last(tokenizer, tt):
    items = _stream(tokenizer, TEXTS, _interleave(tokenizer, TEXTS), k=2)
    events = _sse(ChatFormat(MODEL, tt, logprobs=True), items, 2, include_usage=True)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["object"] == "chat.completion.chunk"
    total_out = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in TEXTS.values())
    assert usage_chunk["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": total_out,
                                    "total_tokens": PROMPT_TOKENS + total_out}
    chunks = events[:-2]
    assert all(c["usage"] is None for c in chunks)  # OpenAI: usage null on every other chunk
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    texts, finishes, lp_tokens = {0: "", 1: ""}, {}, {0: [], 1: []}
    for c in chunks[2:]:
        (choice,) = c["choices"]
        i = choice["index"]
        delta_text = choice["delta"].get("content", "")
        texts[i] += delta_text
        if choice["finish_reason"]:
            assert i not in finishes
            finishes[i] = choice["finish_reason"]
        # each delta carries the logprobs of its own tokens
        own = [e["token"] for e in choice["logprobs"]["content"]]
        assert "".join(own) == delta_text
        lp_tokens[i] += own
        assert all(len(e["top_logprobs"]) == 2 for e in choice["logprobs"]["content"])
    assert texts == TEXTS
    assert finishes == {0: "stop", 1: "stop"}
    assert {c["choices"][0]["index"] for c in chunks[2:]} == {0, 1}


def test_chat_sse_without_usage_has_no_usage_key(tokenizer):
    items = _stream(tokenizer, {0: "Hi there."}, [0, 0, 0])
    events = _sse(ChatFormat(MODEL), items, 1)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(e["choices"][0]["logprobs"] is None for e in events[:-1])


def test_abort_is_reported_as_stop(tokenizer):
    items = _stream(tokenizer, {0: "Hi there."}, [0, 0, 0], finish={0: "abort"})
    assert _collect(ChatFormat(MODEL), items, 1)["choices"][0]["finish_reason"] == "stop"


def test_error_first_raises_and_mid_stream_becomes_sse_error(tokenizer):
    err = GenerationError("req-1", "boom", "standard", stage="engine", reason="engine_error")
    with pytest.raises(OpenAIError) as info:
        _collect(ChatFormat(MODEL), [err], 1)
    assert info.value.status == 500
    items = _stream(tokenizer, {0: "Hi there."}, [0, 0, 0])[:1] + [err]
    events = _sse(ChatFormat(MODEL), items, 1)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "boom"


def test_bad_index_is_a_server_error(tokenizer):
    items = _stream(tokenizer, {0: "Hi"}, [0])
    items[0].index = 3
    with pytest.raises(OpenAIError) as info:
        _collect(ChatFormat(MODEL), items, 2)
    assert info.value.status == 500


def test_negative_infinity_logprob_is_floored(tt):
    chunk = GenerationChunk("r", [11], ",", finish_reason="stop", num_prompt_tokens=1, num_output_tokens=1,
                            logprobs=[TokenLogprobs(11, -math.inf, [(12, 0.0), (11, -math.inf)])])
    body = _collect(ChatFormat(MODEL, tt, logprobs=True), [chunk], 1)
    json.dumps(body, allow_nan=False)  # valid JSON
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert entry["logprob"] == -9999.0 and entry["top_logprobs"][1]["logprob"] == -9999.0


# ---- completions -----------------------------------------------------------------------------

def test_completion_collect_logprobs_legacy_shape(tokenizer, tt):
    items = _stream(tokenizer, TEXTS, _interleave(tokenizer, TEXTS), k=2)
    # make one sampled token fall outside its top-2: it must still appear in top_logprobs
    comma, period, _ = _alternatives(tokenizer)
    items[0].logprobs = [TokenLogprobs(items[0].token_ids[0], -3.0, [(comma, -0.2), (period, -1.5)])]
    body = _collect(CompletionFormat(MODEL, tt, logprobs=True), items, 2)
    assert body["object"] == "text_completion"
    for i, choice in enumerate(body["choices"]):
        assert choice["text"] == TEXTS[i]
        lp = choice["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert "".join(lp["tokens"]) == TEXTS[i]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(lp["tokens"]))]
        for tok, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
            assert tok in top and 2 <= len(top) <= 3
    first = body["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] == -3.0
    assert first["top_logprobs"][0] == {",": -0.2, ".": -1.5, first["tokens"][0]: -3.0}


def test_completion_echo_prepends_prompt_and_shifts_offsets(tokenizer, tt):
    items = _stream(tokenizer, {0: " Paris."}, [0, 0])
    body = _collect(CompletionFormat(MODEL, echo="The capital of France is"), items, 1)
    assert body["choices"][0]["text"] == "The capital of France is Paris."
    events = _sse(CompletionFormat(MODEL, echo="The capital of France is"), items, 1)
    assert events[0]["choices"][0]["text"] == "The capital of France is"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "The capital of France is Paris."
    # offsets count the echoed text (echo + logprobs is refused by the API, but the formatter is consistent)
    items = _stream(tokenizer, {0: " Paris."}, [0, 0], k=0)
    body = _collect(CompletionFormat(MODEL, tt, logprobs=True, echo="abc"), items, 1)
    assert body["choices"][0]["logprobs"]["text_offset"][0] == 3


def _prompt_entries(tokenizer, text: str) -> tuple[list[int], list]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids, [None] + [_lp(t, 1, _alternatives(tokenizer)) for t in ids[1:]]


def test_completion_echo_with_logprobs_puts_the_prompt_tokens_first(tokenizer, tt):
    """lm-eval's loglikelihood reads ``token_logprobs[ctxlen:-1]``: the prompt's tokens (the first null), then the
    generated one; ``text_offset`` runs over the echoed text; streamed, the echo comes with its logprobs."""
    prompt = "The capital of France is"
    ids, entries = _prompt_entries(tokenizer, prompt)
    items = _stream(tokenizer, {0: " Paris."}, [0, 0], k=1)
    items[0].prompt_logprobs = entries
    fmt = CompletionFormat(MODEL, tt, logprobs=True, echo=prompt, prompt_ids=[ids])
    lp = _collect(fmt, items, 1)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 2
    assert "".join(lp["tokens"]) == prompt + " Paris."
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(lp["tokens"]))]
    for tok, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert top[tok] == v  # the actual token is always among the top entries (lm-eval's is_greedy)
    fmt = CompletionFormat(MODEL, tt, logprobs=True, echo=prompt, prompt_ids=[ids])
    events = _sse(fmt, items, 1)
    first = events[0]["choices"][0]
    assert first["text"] == prompt and first["logprobs"]["tokens"][0] == tokenizer.decode(ids[:1])
    streamed = [e for ev in events[:-1] for e in ev["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]


def test_completion_several_prompts_number_choices_prompt_major(tokenizer, tt):
    """Two prompts x n=2: choice p*n + i; usage counts each prompt once; echo per prompt."""
    from deployments.openai_format import merge_prompt_streams

    a = _stream(tokenizer, {0: " one", 1: " two"}, [0, 1])
    b = _stream(tokenizer, {0: " three", 1: " four"}, [1, 0])
    for c in b:
        c.num_prompt_tokens = 3

    async def go(stream: bool):
        merged = merge_prompt_streams([_agen(a), _agen(b)], 2)
        first = await merged.__anext__()
        fmt = CompletionFormat(MODEL, tt, echo=["A:", "B:"], n=2)
        if stream:
            return [ev async for ev in fmt.sse(first, merged, 2, True, num_prompts=2)]
        return await fmt.collect(first, merged, 2, num_prompts=2)

    body = asyncio.run(go(False))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["A: one", "A: two", "B: three", "B: four"]
    assert body["usage"] == {"prompt_tokens": PROMPT_TOKENS + 3, "completion_tokens": 4, "total_tokens": PROMPT_TOKENS + 7}
    events = [json.loads(e[6:-2]) for e in asyncio.run(go(True))[:-1]]
    texts = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: "A: one", 1: "A: two", 2: "B: three", 3: "B: four"}
    assert events[-1]["usage"]["prompt_tokens"] == PROMPT_TOKENS + 3


def test_merged_prompt_streams_close_every_stream(tokenizer):
    from deployments.openai_format import merge_prompt_streams

    closed = []

    async def endless(tag):
        try:
            while True:
                yield GenerationChunk("r", [1], "x", index=0)
                await asyncio.sleep(0)
        finally:
            closed.append(tag)

    async def go():
        merged = merge_prompt_streams([endless("a"), endless("b")], 1)
        seen = {(await merged.__anext__()).index for _ in range(10)}
        await merged.aclose()
        return seen

    assert asyncio.run(go()) == {0, 1}
    assert sorted(closed) == ["a", "b"]


def test_completion_sse_n2_with_usage(tokenizer, tt):
    items = _stream(tokenizer, TEXTS, _interleave(tokenizer, TEXTS), k=1)
    events = _sse(CompletionFormat(MODEL, tt, logprobs=True), items, 2, include_usage=True)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"]["prompt_tokens"] == PROMPT_TOKENS
    texts, offsets = {0: "", 1: ""}, {0: [], 1: []}
    for e in events[:-2]:
        (c,) = e["choices"]
        assert e["object"] == "text_completion"
        texts[c["index"]] += c["text"]
        offsets[c["index"]] += c["logprobs"]["text_offset"]
    assert texts == TEXTS
    assert offsets[1][:3] == [0, len("The"), len("The answer")]


def test_byte_level_tokens_report_raw_bytes(tokenizer, tt):
    ids = tokenizer.encode("日本", add_special_tokens=False)
    texts = [tt.text(t) for t in ids]
    assert "\ufffd" in "".join(texts)  # a partial character renders as U+FFFD in the token text ...
    assert bytes(b for t in ids for b in tt.bytes(t)).decode() == "日本"  # ... its bytes are exact
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tt.text(eos) == "<|im_end|>" and bytes(tt.bytes(eos)) == b"<|im_end|>"


# ---- request mapping -------------------------------------------------------------------------

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_maps_every_sampling_field():
    body = ChatCompletionRequest(model=MODEL, messages=FRANCE, n=3, seed=5, temperature=0.7, top_p=0.9, top_k=20,
                                 min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                                 min_tokens=4, logprobs=True, top_logprobs=3, stop="x", ignore_eos=True)
    body.check()
    p = body.sampling_params(32)
    assert (p.n, p.seed, p.temperature, p.top_p, p.top_k, p.min_p) == (3, 5, 0.7, 0.9, 20, 0.05)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.min_tokens, p.logprobs, p.stop, p.ignore_eos, p.max_tokens) == (4, 3, ("x",), True, 32)


@pytest.mark.parametrize("kwargs,k", [({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0),
                                      ({"logprobs": True, "top_logprobs": 0}, 0),
                                      ({"logprobs": True, "top_logprobs": 20}, 20)])
def test_chat_logprobs_mapping(kwargs, k):
    body = ChatCompletionRequest(model=MODEL, messages=FRANCE, **kwargs)
    body.check()
    assert body.sampling_params(8).logprobs == k


@pytest.mark.parametrize("kwargs,k", [({}, None), ({"logprobs": 0}, 0), ({"logprobs": 5}, 5)])
def test_completion_logprobs_mapping(kwargs, k):
    body = CompletionRequest(model=MODEL, prompt="hi", **kwargs)
    body.check()
    assert body.sampling_params(8).logprobs == k


def _error_param(cls, **kwargs) -> str | None:
    """The ``param`` of the 400 that ``kwargs`` get, however it is raised (pydantic or check)."""
    from pydantic import ValidationError

    from deployments.protocol import validation_error

    try:
        body = cls(model=MODEL, **kwargs)
        body.check()
        body.sampling_params(16)
    except ValidationError as exc:
        return validation_error(exc.errors()).param
    except OpenAIError as exc:
        assert exc.status == 400
        return exc.param
    return None


@pytest.mark.parametrize("kwargs,param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # above max_tokens
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
      "function": {"name": "g"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"logit_bias": {"11": 5}}, "logit_bias"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"echo": True}, "echo"),
    ({"best_of": 2}, "best_of"),
])
def test_chat_rejections_name_the_parameter(kwargs, param):
    assert _error_param(ChatCompletionRequest, messages=FRANCE, **kwargs) == param


@pytest.mark.parametrize("kwargs,param", [
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"suffix": "!"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"logit_bias": {"11": 5}}, "logit_bias"),
    ({"prompt_logprobs": 0}, "prompt_logprobs"),
])
def test_completion_rejections_name_the_parameter(kwargs, param):
    assert _error_param(CompletionRequest, prompt="hi", **kwargs) == param


@pytest.mark.parametrize("kwargs", [{"echo": True}, {"response_format": {"type": "text"}}, {"best_of": 1},
                                    {"min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 16},
                                    {"echo": True, "logprobs": 1}])
def test_completion_accepts(kwargs):
    assert _error_param(CompletionRequest, prompt="hi", **kwargs) is None


# ---- conformance: model, output limits, seeds, prompt shapes ----------------------------------

def test_model_is_optional():
    assert ChatCompletionRequest(messages=FRANCE).model is None
    assert CompletionRequest(prompt="hi").model is None


def test_completions_output_limit_default_16_and_max_completion_tokens():
    body = CompletionRequest(prompt="hi")
    assert body.output_limit() is None and body.default_output_limit(500) == 16 and body.default_output_limit(9) == 9
    assert CompletionRequest(prompt="hi", max_completion_tokens=10).output_limit() == 10
    assert CompletionRequest(prompt="hi", max_tokens=30, max_completion_tokens=10).output_limit() == 10
    chat = ChatCompletionRequest(messages=FRANCE)
    assert chat.output_limit() is None and chat.default_output_limit(500) == 500  # chat: the rest of the context
    assert _error_param(CompletionRequest, prompt="hi", max_completion_tokens=0) == "max_completion_tokens"


@pytest.mark.parametrize("seed,ok", [(-(2**63), True), (2**63 - 1, True), (-1, True), (2**63, False),
                                     (2**64 - 1, False), (-(2**63) - 1, False)])
def test_seeds_are_int64(seed, ok):
    assert (_error_param(ChatCompletionRequest, messages=FRANCE, seed=seed) is None) is ok
    if not ok:
        assert _error_param(ChatCompletionRequest, messages=FRANCE, seed=seed) == "seed"


def test_seeds_that_alias_on_the_cpu_generator_get_unrelated_streams():
    """torch's CPU generator keeps 32 bits of its seed: -1, 2**63 - 1 (and 2**64 - 1) were one stream."""
    import torch

    from replicas.request import SamplingParams
    from replicas.sampler import generator_seed, make_generator

    draws = {}
    for seed in (-1, 2**63 - 1, 1, 2**32 + 1, 0):
        gen = make_generator(SamplingParams(temperature=1.0, seed=seed))
        draws[seed] = torch.rand(4, generator=gen).tolist()
    assert len({tuple(v) for v in draws.values()}) == len(draws)
    again = make_generator(SamplingParams(temperature=1.0, seed=-1))
    assert torch.rand(4, generator=again).tolist() == draws[-1]  # still reproducible
    assert len({generator_seed(s) & 0xFFFFFFFF for s in range(-1000, 1000)}) == 2000


@pytest.mark.parametrize("prompt,expected", [
    ("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [3]], [[1, 2], [3]]),
    (["only"], ["only"]),
])
def test_completion_prompt_shapes(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompt == expected


@pytest.mark.parametrize("prompt,needle", [
    ([[1, "a"]], "prompt 0, element 1: token ids must be integers, got a string"),
    ([1, "a"], "element 1 is a string, but element 0 makes this a list of token ids"),
    (["a", [1]], "element 1 is a list, but element 0 makes this a list of strings"),
    (5, "expected a string, a list of strings, a list of token ids or a list of token-id lists, got a number"),
    ([], "must not be empty"), ([[]], "prompt 0 is an empty list of token ids"),
    ([True], "got a boolean"), ([{"text": "x"}], "got an object"),
])
def test_completion_prompt_errors_say_what_is_wrong(prompt, needle):
    from pydantic import ValidationError

    from deployments.protocol import validation_error

    with pytest.raises(ValidationError) as info:
        CompletionRequest(prompt=prompt)
    err = validation_error(info.value.errors())
    assert err.param == "prompt" and needle in err.message, err.message
    assert "prompt.str" not in err.message and "Value error" not in err.message


@pytest.mark.parametrize("kwargs,param,needle", [
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "expected a string or a list of objects, got a number"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content.0.type", "'text'"),
    ({"messages": FRANCE, "stop": 5}, "stop", "expected a string or a list of strings, got a number"),
    ({"messages": FRANCE, "stop": ["a", 5]}, "stop.1", "valid string"),
])
def test_union_errors_are_one_clear_message(kwargs, param, needle):
    from pydantic import ValidationError

    from deployments.protocol import validation_error

    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(**kwargs)
    err = validation_error(info.value.errors())
    assert err.param == param and needle in err.message, err.message


def test_too_many_choices_are_refused():
    assert _error_param(CompletionRequest, prompt=["x"] * 65, n=2) == "prompt"
    assert _error_param(CompletionRequest, prompt=["x"] * 64, n=2) is None


def test_echo_with_logprobs_asks_for_prompt_logprobs():
    assert CompletionRequest(prompt="hi", echo=True, logprobs=2).sampling_params(4).prompt_logprobs == 2
    assert CompletionRequest(prompt="hi", logprobs=2).sampling_params(4).prompt_logprobs is None
    assert CompletionRequest(prompt="hi", echo=True).sampling_params(4).prompt_logprobs is None


# ---- tokenize helpers ------------------------------------------------------------------------

def test_tokenize_prompt_and_detokenize_round_trip(tokenizer):
    out = tokenize(tokenizer, TokenizeRequest(model=MODEL, prompt="Hello, world!", return_token_strs=True), 1024)
    assert out["tokens"] == tokenizer.encode("Hello, world!") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 1024 and len(out["token_strs"]) == out["count"]
    assert detokenize(tokenizer, DetokenizeRequest(tokens=out["tokens"])) == {"prompt": "Hello, world!"}


def test_tokenize_messages_matches_the_chat_prompt(tokenizer):
    from deployments.protocol import ChatMessage

    messages = [ChatMessage(**m) for m in FRANCE]
    out = tokenize(tokenizer, TokenizeRequest(messages=FRANCE), 1024)
    assert out["tokens"] == encode_chat(tokenizer, messages)
    assert tokenizer.decode(out["tokens"]).endswith("<|im_start|>assistant\n")
    no_gen = tokenize(tokenizer, TokenizeRequest(messages=FRANCE, add_generation_prompt=False), 1024)
    assert no_gen["count"] < out["count"]


@pytest.mark.parametrize("req,param", [
    (DetokenizeRequest(tokens=[1, -1]), "tokens"),
    (DetokenizeRequest(tokens=[10**9]), "tokens"),
])
def test_detokenize_rejects_bad_ids(tokenizer, req, param):
    with pytest.raises(OpenAIError) as info:
        detokenize(tokenizer, req)
    assert info.value.status == 400 and info.value.param == param


def test_tokenize_needs_exactly_one_input(tokenizer):
    for req in (TokenizeRequest(), TokenizeRequest(prompt="a", messages=FRANCE)):
        with pytest.raises(OpenAIError):
            tokenize(tokenizer, req, 1024)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "name": ""}]}, "tools.0.name"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "tools.0.name"),
    ({"text": {"format": {"type": "json_schema", "name": ""}}}, "text.format.name"),
])
def test_responses_request_rejects_what_the_chat_request_would(fields, param):
    """A Responses body the chat request cannot carry is a 400 naming the field (schemathesis found a
    tool named ``""`` raised a bare ValidationError: HTTP 500)."""
    from pydantic import ValidationError

    from deployments.protocol import validation_error
    from deployments.responses_api import ResponsesRequest, to_chat_request

    try:
        body = ResponsesRequest(input="hi", **fields)
    except ValidationError as exc:  # FastAPI answers this one with a 400 itself
        err = validation_error(exc.errors())
    else:  # anything past the body model must come out of to_chat_request as an OpenAIError
        with pytest.raises(OpenAIError) as info:
            to_chat_request(body, "m")
        err = info.value
    assert err.status == 400 and err.param == param, (err.param, str(err))
