"""OpenAI/vLLM conformance over real HTTP against the real Ray app: what a new user and an evaluation
client (lm-eval) send. The optional ``model``, completions output limits, stop token text, seed range,
``/tokenizer_info``, batched prompts and ``echo`` with ``logprobs`` (prompt logprobs).

The ``client`` fixture checks after each test that every KV page came back.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.deployments.conftest import MODEL

pytestmark = pytest.mark.ray

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
OF = 282
"""SmolLM2's token " of" (the stop token of the report: its text stayed in the output)."""


def _post(server: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server}{path}", json=body, timeout=120, **kw)


def _tokenize(server: str, text: str) -> list[int]:
    return _post(server, "/tokenize", {"prompt": text}).json()["tokens"]


# ---- model -------------------------------------------------------------------------------------

def test_a_request_without_model_is_served_by_the_one_model(client, server):
    for path, body in (("/v1/chat/completions", {"messages": FRANCE, "temperature": 0, "max_tokens": 4}),
                       ("/v1/completions", {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 4})):
        r = _post(server, path, body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == MODEL
    r = _post(server, "/v1/completions", {"model": None, "prompt": "Hi", "max_tokens": 1})  # null: the default too
    assert r.status_code == 200 and r.json()["model"] == MODEL
    r = _post(server, "/v1/completions", {"model": "other", "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# ---- output limits -----------------------------------------------------------------------------

def test_completions_honour_max_completion_tokens_and_default_to_16(client, server):
    essay = {"prompt": "Write a long essay about the sea.", "temperature": 0, "ignore_eos": True}
    r = _post(server, "/v1/completions", {**essay, "max_completion_tokens": 10})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 10 and r.json()["choices"][0]["finish_reason"] == "length"
    r = _post(server, "/v1/completions", essay)
    assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's and vLLM's default, not the context
    r = _post(server, "/v1/completions", {**essay, "max_tokens": 30, "max_completion_tokens": 5})
    assert r.json()["usage"]["completion_tokens"] == 5
    r = _post(server, "/v1/completions", {**essay, "max_completion_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


# ---- stop tokens, include_stop_str_in_output ---------------------------------------------------

@pytest.mark.parametrize("lane", ["persistent", "standard"])
def test_a_stop_token_ends_the_text_without_its_own_text(client, server, lane):
    body = {"prompt": "The capital of France is Paris. The capital", "temperature": 0, "max_tokens": 8}
    plain = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    assert plain.startswith(" of"), plain  # the greedy continuation starts with the stop token
    r = _post(server, "/v1/completions", {**body, "stop_token_ids": [OF]}, headers={"x-lane": lane})
    assert r.headers["x-lane"] == lane
    out = r.json()
    assert out["choices"][0]["text"] == "" and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 1  # the stop token is generated and counted, not shown
    r = _post(server, "/v1/completions", {**body, "stop_token_ids": [OF], "include_stop_str_in_output": True},
              headers={"x-lane": lane})
    assert r.json()["choices"][0]["text"] == " of"
    r = _post(server, "/v1/completions", {**body, "stop": [" France"], "include_stop_str_in_output": True},
              headers={"x-lane": lane})
    assert r.json()["choices"][0]["text"].endswith(" France")


# ---- seeds ---------------------------------------------------------------------------------------

def test_seeds_outside_int64_are_refused_and_aliases_differ(client, server):
    for seed in (2**63, 2**64 - 1, -(2**63) - 1):
        r = _post(server, "/v1/completions", {"prompt": "Once", "seed": seed, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    texts = {}
    for seed in (-1, 2**63 - 1):
        body = {"prompt": "Once upon a time", "seed": seed, "temperature": 1.0, "max_tokens": 8, "n": 2}
        texts[seed] = [c["text"] for c in _post(server, "/v1/completions", body).json()["choices"]]
        assert texts[seed] == [c["text"] for c in _post(server, "/v1/completions", body).json()["choices"]]
    assert texts[-1] != texts[2**63 - 1]  # one stream before (the CPU generator kept 32 bits of the seed)


# ---- /tokenizer_info ---------------------------------------------------------------------------

def test_tokenizer_info_has_what_lm_eval_reads(server):
    info = httpx.get(f"{server}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert "pad_token" in info and info["tokenizer_class"]
    assert "{% for message in messages %}" in info["chat_template"] or "messages" in info["chat_template"]
    assert not any("/" in str(v) for k, v in info.items() if k not in ("chat_template", "added_tokens_decoder"))
    # lm-eval's remote tokenizer finds eos_token_id as /tokenize(eos_token)[0]: that needs the server's
    # allow-special-tokens (tests/lmeval runs so); by default the string is client text, its ids the text's
    assert _post(server, "/detokenize", {"tokens": [2]}).json()["prompt"] == info["eos_token"]
    as_text = _post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert 2 not in as_text and len(as_text) > 1


# ---- batched prompts -----------------------------------------------------------------------------

def test_batched_prompts_one_choice_per_prompt_and_n(client, server):
    prompts = ["The capital of France is", "Once upon a time"]
    singles = [_post(server, "/v1/completions", {"prompt": p, "temperature": 0, "max_tokens": 6}).json()
               for p in prompts]
    r = _post(server, "/v1/completions", {"prompt": prompts, "temperature": 0, "max_tokens": 6, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [s["choices"][0]["text"] for s in singles for _ in range(2)]
    assert body["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert body["usage"]["completion_tokens"] == 2 * sum(s["usage"]["completion_tokens"] for s in singles)
    ids = [_tokenize(server, p) for p in prompts]
    by_ids = _post(server, "/v1/completions", {"prompt": ids, "temperature": 0, "max_tokens": 6}).json()
    assert [c["text"] for c in by_ids["choices"]] == [s["choices"][0]["text"] for s in singles]
    one = _post(server, "/v1/completions", {"prompt": [ids[0]], "temperature": 0, "max_tokens": 6}).json()
    assert one["choices"][0]["text"] == singles[0]["choices"][0]["text"]  # lm-eval's [[ids]]


def test_batched_prompts_stream_with_openai_client(client):
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    texts = {i: "" for i in range(3)}
    finished = set()
    for chunk in client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=5, stream=True,
                                           stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2} and all(texts.values())
    batch = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=5)
    assert [c.text for c in batch.choices] == [texts[i] for i in range(3)]


@pytest.mark.parametrize("prompt,needle", [
    ([[1, "a"]], "token ids must be integers"),
    (["a", 1], "do not mix"),
    ([], "must not be empty"),
])
def test_bad_prompts_name_what_is_wrong(server, prompt, needle):
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and needle in err["message"] and "prompt.str" not in err["message"]


def test_a_bad_prompt_in_a_batch_fails_the_request_before_any_work(client, server):
    r = _post(server, "/v1/completions", {"prompt": [[11, 12], [10**7]], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = _post(server, "/v1/completions", {"prompt": ["Hi", "word " * 2000], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


# ---- echo with logprobs (prompt logprobs) ------------------------------------------------------

def test_echo_with_logprobs_returns_the_prompt_logprobs_as_lm_eval_reads_them(client, server):
    """lm-eval's loglikelihood request: token ids, ``echo``, ``logprobs=1``, ``max_tokens=1``, greedy."""
    context, continuation = _tokenize(server, "The capital of France is"), _tokenize(server, " Paris")
    ids = context + continuation
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1,
                                          "logprobs": 1, "seed": 1234, "echo": True})
    assert r.status_code == 200, r.text
    assert r.headers["x-lane"] == "standard"  # logprobs need the logits on the host
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert choice["text"].startswith("The capital of France is Paris")
    paris = lp["token_logprobs"][len(context):-1]
    assert len(paris) == len(continuation) and all(v < 0 for v in paris)
    greedy = all(v == max(top.values()) for v, top in
                 zip(lp["token_logprobs"][len(context):-1], lp["top_logprobs"][len(context):-1], strict=True))
    assert greedy  # " Paris" is the model's greedy continuation here
    # a worse continuation is less likely
    worse = context + _tokenize(server, " Berlin")
    r = _post(server, "/v1/completions", {"prompt": [ids, worse], "temperature": 0, "max_tokens": 1,
                                          "logprobs": 1, "echo": True})
    sums = [sum(c["logprobs"]["token_logprobs"][len(context):-1]) for c in r.json()["choices"]]
    assert sums[0] == pytest.approx(sum(paris), abs=1e-3) and sums[1] < sums[0]


def test_echo_with_logprobs_streams_the_prompt_first(client, server):
    with httpx.stream("POST", f"{server}/v1/completions", timeout=60,
                      json={"prompt": "Hello there", "max_tokens": 2, "temperature": 0, "logprobs": 0,
                            "echo": True, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["text"] == "Hello there" and first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == len(_tokenize(server, "Hello there"))
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]).startswith("Hello there")


def test_openai_client_echo_logprobs(client):
    body = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=1, temperature=0, logprobs=2,
                                     echo=True)
    lp = body.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == body.usage.prompt_tokens + 1
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"prompt_logprobs": 1})
