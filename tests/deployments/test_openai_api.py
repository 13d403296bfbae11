"""The OpenAI surface over real HTTP against the real Ray app: n, logprobs, penalties, min_tokens,
stop strings, usage, echo, /tokenize and /detokenize (official ``openai`` client where it applies).

The ``client`` fixture checks after each test that every KV page came back.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.deployments.conftest import MODEL

pytestmark = pytest.mark.ray

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]


def _tokenize(server: str, **body) -> dict:
    r = httpx.post(f"{server}/tokenize", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_choices(chunks, n: int) -> tuple[dict[int, str], dict[int, str]]:
    texts, finishes = {i: "" for i in range(n)}, {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                assert ch.index not in finishes, "a choice finished twice"
                finishes[ch.index] = ch.finish_reason
    return texts, finishes


# ---- usage -------------------------------------------------------------------------------------

def test_streaming_chat_usage_chunk_is_last_and_counts_right(client, server):
    stream = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    prompt = _tokenize(server, messages=FRANCE)["count"]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (prompt, 12, prompt + 12)


def test_streaming_n2_usage_sums_completion_tokens(client, server):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0.8, seed=3, n=2, max_tokens=10, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.prompt_tokens == _tokenize(server, messages=FRANCE)["count"]  # counted once, not per choice
    assert usage.completion_tokens == 20


# ---- n > 1 -------------------------------------------------------------------------------------

def test_n2_non_stream_sampled_choices_differ(client):
    differ = False
    for seed in (1, 2, 3):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=FRANCE, temperature=0.8, seed=seed, n=2, max_tokens=24)
        body = raw.parse()
        assert raw.headers["x-lane"] == "standard"
        assert [c.index for c in body.choices] == [0, 1]
        assert all(c.finish_reason in ("stop", "length") and c.message.content for c in body.choices)
        assert body.usage.completion_tokens <= 48
        differ |= body.choices[0].message.content != body.choices[1].message.content
        if differ:
            break
    assert differ, "n=2 at temperature 0.8 gave identical choices for every seed"


def test_n2_non_stream_greedy_choices_identical(client):
    body = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, n=2, max_tokens=16)
    assert [c.index for c in body.choices] == [0, 1]
    assert body.choices[0].message.content == body.choices[1].message.content
    assert "Paris" in body.choices[0].message.content
    assert [c.finish_reason for c in body.choices] == [body.choices[0].finish_reason] * 2


def test_n2_stream_sampled_and_greedy(client):
    differ = False
    for seed in (1, 2, 3):
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=FRANCE, temperature=0.8, seed=seed, n=2, max_tokens=24, stream=True))
        texts, finishes = _stream_choices(chunks, 2)
        assert set(finishes) == {0, 1} and all(f in ("stop", "length") for f in finishes.values())
        assert all(texts.values())
        differ |= texts[0] != texts[1]
        if differ:
            break
    assert differ, "n=2 streamed at temperature 0.8 gave identical choices for every seed"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, n=2, max_tokens=16, stream=True))
    texts, finishes = _stream_choices(chunks, 2)
    assert set(finishes) == {0, 1}
    assert texts[0] == texts[1] and "Paris" in texts[0]


def test_n3_completions_stream(client):
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", n=3, max_tokens=6,
                                            temperature=0, stream=True))
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1, 2}
    assert texts[0] == texts[1] == texts[2] and "Paris" in texts[0]


# ---- logprobs ----------------------------------------------------------------------------------

def test_chat_logprobs_top3_greedy(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=16, logprobs=True, top_logprobs=3)
    body = raw.parse()
    assert raw.headers["x-lane"] == "standard"
    choice = body.choices[0]
    content = choice.logprobs.content
    assert len(content) == body.usage.completion_tokens
    assert "".join(e.token for e in content).startswith(choice.message.content)
    for e in content:
        assert e.logprob <= 0
        assert e.bytes == list(e.token.encode()) or "\ufffd" in e.token
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        # greedy: the chosen token is the most likely one
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)


def test_chat_logprobs_without_top_and_streamed(client):
    body = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=8, logprobs=True)
    content = body.choices[0].logprobs.content
    assert len(content) == body.usage.completion_tokens and all(e.top_logprobs == [] for e in content)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=8, logprobs=True, top_logprobs=2, stream=True,
        stream_options={"include_usage": True}))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(len(e.top_logprobs) == 2 for e in streamed)
    assert len(streamed) == chunks[-1].usage.completion_tokens


def test_no_logprobs_unless_asked(client):
    body = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0.5, seed=1, max_tokens=4)
    assert body.choices[0].logprobs is None


def test_completions_logprobs_2(client):
    body = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                     temperature=0, logprobs=2)
    choice = body.choices[0]
    lp = choice.logprobs
    n = body.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens).startswith(choice.text)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0
        assert token in top and 2 <= len(top) <= 3  # top 2 plus the sampled token
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: sampled is the most likely


def test_completions_n2_logprobs_per_choice(client):
    body = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2,
                                     temperature=0.9, seed=11, logprobs=1)
    assert [c.index for c in body.choices] == [0, 1]
    for c in body.choices:
        assert "".join(c.logprobs.tokens).startswith(c.text)
    assert body.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in body.choices)


def test_completions_echo(client):
    body = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                     temperature=0, echo=True)
    assert body.choices[0].text.startswith("The capital of France is") and "Paris" in body.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                            temperature=0, echo=True, stream=True))
    assert chunks[0].choices[0].text == "The capital of France is"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == body.choices[0].text


# ---- stop strings, min_tokens, penalties -------------------------------------------------------

def test_stop_strings_never_in_text(client):
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=FRANCE, temperature=0, max_tokens=40, n=2, stop=["Paris", "capital"])
        if stream:
            texts, finishes = _stream_choices(list(client.chat.completions.create(stream=True, **kwargs)), 2)
        else:
            body = client.chat.completions.create(**kwargs)
            texts = {c.index: c.message.content for c in body.choices}
            finishes = {c.index: c.finish_reason for c in body.choices}
        assert finishes == {0: "stop", 1: "stop"}
        assert all("Paris" not in t and "capital" not in t for t in texts.values())
    body = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16,
                                     temperature=0, stop=[" Paris"])
    assert body.choices[0].finish_reason == "stop" and "Paris" not in body.choices[0].text


LANES = [pytest.param("server", id="auto"), pytest.param("off_app", id="off")]
"""Both apps (their fixtures): on ``auto`` greedy requests with penalties stay off the persistent lane (reason
logits_processing); ``min_tokens`` runs there (its bans are applied on the host)."""


def _client_for(request, app: str) -> openai.OpenAI:
    base = request.getfixturevalue(app)
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("app", LANES)
def test_min_tokens_masks_eos_greedy(client, request, app):
    c = _client_for(request, app)
    base = c.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=64)
    assert base.choices[0].finish_reason == "stop" and base.usage.completion_tokens < 20
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30,
                                                      extra_body={"min_tokens": 20})
    assert raw.headers["x-lane"] == ("standard" if app == "off_app" else "persistent")
    body = raw.parse()
    assert body.usage.completion_tokens >= 20
    # EOS is masked (the runner-up token is taken), not sampled and then skipped in the text: the same
    # request with logprobs (always on the standard lane) shows the tokens
    shown = c.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30,
                                      logprobs=True, extra_body={"min_tokens": 20})
    tokens = [e.token for e in shown.choices[0].logprobs.content]
    assert "<|im_end|>" not in tokens[:20]
    assert shown.choices[0].message.content.startswith(base.choices[0].message.content)
    assert body.choices[0].message.content == shown.choices[0].message.content


def test_min_tokens_sampled(client):
    body = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0.7, seed=5, max_tokens=40,
                                          logprobs=True, extra_body={"min_tokens": 20})
    assert body.usage.completion_tokens >= 20
    assert "<|im_end|>" not in [e.token for e in body.choices[0].logprobs.content][:20]


def test_min_tokens_above_max_tokens_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=4, extra_body={"min_tokens": 5})
    assert info.value.response.json()["error"]["param"] == "min_tokens"


@pytest.mark.parametrize("app", LANES)
@pytest.mark.parametrize("extra", [{"frequency_penalty": 1.5}, {"presence_penalty": 1.5},
                                   {"extra_body": {"repetition_penalty": 1.5}}],
                         ids=["frequency", "presence", "repetition"])
def test_penalties_change_greedy_output(client, request, app, extra):
    c = _client_for(request, app)
    kwargs = dict(model=MODEL, messages=POEM, temperature=0, max_tokens=48)
    plain = c.chat.completions.create(**kwargs).choices[0].message.content
    raw = c.chat.completions.with_raw_response.create(**kwargs, **extra)
    assert raw.headers["x-lane"] == "standard"
    assert raw.parse().choices[0].message.content != plain


def test_min_p_is_accepted_and_min_p_1_is_greedy(client):
    greedy = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=12)
    # min_p=1 keeps only tokens as likely as the top one: sampling at any temperature gives the greedy text
    body = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=1.0, seed=9, max_tokens=12,
                                          extra_body={"min_p": 1.0})
    assert body.choices[0].message.content == greedy.choices[0].message.content


# ---- /tokenize and /detokenize -----------------------------------------------------------------

def test_tokenize_detokenize_round_trip(server):
    text = "Hello, world! Ünïcödé and 日本語 too."
    out = _tokenize(server, prompt=text)
    assert out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] == 1024
    r = httpx.post(f"{server}/detokenize", json={"model": MODEL, "tokens": out["tokens"]}, timeout=30)
    assert r.status_code == 200 and r.json() == {"prompt": text}


def test_tokenize_messages_matches_chat_prompt_tokens(client, server):
    ids = _tokenize(server, messages=FRANCE, add_generation_prompt=True)["tokens"]
    body = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=2)
    assert body.usage.prompt_tokens == len(ids)
    # the same ids sent as a completions prompt give the chat's greedy continuation
    comp = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=2)
    assert comp.usage.prompt_tokens == len(ids)
    assert comp.choices[0].text == body.choices[0].message.content


@pytest.mark.parametrize("path,body,status,param", [
    ("/detokenize", {"model": MODEL, "tokens": [1, -5]}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [10**7]}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": ["a"]}, 400, "tokens.0"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "logit_bias": {"1": 2}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "response_format": {"type": "json_schema"}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format"),
    ("/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "!"}, 400, "suffix"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "prompt_logprobs": 0}, 400, "prompt_logprobs"),
])
def test_errors_are_openai_shaped_and_name_the_parameter(server, path, body, status, param):
    r = httpx.post(f"{server}{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"], err
