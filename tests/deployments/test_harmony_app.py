"""GPT-OSS's harmony format end to end: the tiny GPT-OSS trained to answer in harmony form
(``ops.tools.make_tiny_harmony_model``), served by the real app at ``/harmony`` through Ray and
HTTP, driven with the ``openai`` client as a user would. Also ``response_format`` on SmolLM2.

Every request here is one the model was trained on (``EXAMPLES``), so greedy decoding gives the
trained answer on both lanes; what is checked is what the server makes of the model's tokens.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from ops.tools.make_tiny_harmony_model import (
    CALL_ARGUMENTS,
    CALL_REASONING,
    CAPITAL_SCHEMA,
    EXAMPLES,
    QUESTION,
    WEATHER_QUESTION,
    WEATHER_RESULT,
    WEATHER_TOOL,
)
from tests.deployments.conftest import HARMONY_MODEL, MODEL, assert_pages_returned

pytestmark = pytest.mark.ray
EX = {e.name: e for e in EXAMPLES}


def _reasoning(ex) -> str:
    return ex.completion.split("<|message|>", 1)[1].split("<|end|>", 1)[0]


def _answer(ex) -> str:
    return ex.completion.rsplit("<|message|>", 1)[1].removesuffix("<|return|>")


@pytest.fixture
def harmony(harmony_app):
    c = openai.OpenAI(base_url=f"{harmony_app}/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    assert_pages_returned(harmony_app)


def _chat(client, ex, lane: str | None = None, stream: bool = False, **extra):
    body = {**ex.request(), **extra}
    messages = body.pop("messages")
    headers = {"x-lane": lane} if lane else {}
    raw = client.chat.completions.with_raw_response.create(
        model=HARMONY_MODEL, messages=messages, max_tokens=80, stream=stream, extra_headers=headers,
        **{k: v for k, v in body.items() if k in ("tools", "response_format", "temperature", "tool_choice")},
        extra_body={k: v for k, v in body.items() if k in ("reasoning_effort", "include_reasoning")})
    return raw.headers["x-lane"], raw.parse()


def _collect(stream) -> dict:
    """Concatenate a chat stream's deltas into one message."""
    out = {"content": "", "reasoning_content": "", "reasoning": "", "tool_calls": [], "finish_reason": None}
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        out["content"] += d.content or ""
        extra = d.model_extra or {}
        out["reasoning_content"] += extra.get("reasoning_content") or ""
        out["reasoning"] += extra.get("reasoning") or ""
        for call in d.tool_calls or ():
            out["tool_calls"].append({"name": call.function.name, "arguments": call.function.arguments,
                                      "id": call.id, "index": call.index})
        out["finish_reason"] = ch.finish_reason or out["finish_reason"]
    return out


@pytest.mark.parametrize("lane", ["persistent", "standard"])
def test_reasoning_and_content_split_on_both_lanes(harmony, lane):
    ex = EX["capital"]
    served, body = _chat(harmony, ex, lane)
    assert served == lane
    msg = body.choices[0].message
    assert msg.content == _answer(ex) == "The capital of France is Paris."
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == _reasoning(ex)
    assert body.choices[0].finish_reason == "stop" and not msg.tool_calls
    assert "harmony_errors" not in msg.model_extra
    served, stream = _chat(harmony, ex, lane, stream=True)
    assert served == lane
    got = _collect(stream)
    assert (got["content"], got["reasoning_content"], got["reasoning"], got["finish_reason"]) == (
        msg.content, _reasoning(ex), _reasoning(ex), "stop")


def test_include_reasoning_false_omits_it(harmony):
    _, body = _chat(harmony, EX["capital"], include_reasoning=False)
    msg = body.choices[0].message
    assert msg.content == _answer(EX["capital"]) and "reasoning_content" not in (msg.model_extra or {})


def test_reasoning_effort_changes_the_rendered_prompt(harmony_app, harmony):
    answers = {}
    for name in ("capital_low", "capital", "capital_high"):
        _, body = _chat(harmony, EX[name])
        answers[name] = body.choices[0].message.model_extra["reasoning_content"]
        assert answers[name] == _reasoning(EX[name])
    assert len(set(answers.values())) == 3
    # the prompt itself: the system message's `Reasoning:` line
    ids = httpx.post(f"{harmony_app}/tokenize", json={"messages": EX["capital"].messages}).json()["tokens"]
    text = httpx.post(f"{harmony_app}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "Reasoning: medium" in text and text.endswith("<|start|>assistant")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(harmony, stream):
    ex = EX["weather_call"]
    lane, resp = _chat(harmony, ex, stream=stream)
    assert lane == "persistent"
    if stream:
        got = _collect(resp)
        assert got["finish_reason"] == "tool_calls" and got["reasoning_content"] == CALL_REASONING
        [call] = got["tool_calls"]
        assert call["index"] == 0 and call["id"].startswith("call_")
        assistant = {"role": "assistant", "content": None, "reasoning_content": got["reasoning_content"],
                     "tool_calls": [{"id": call["id"], "type": "function",
                                     "function": {"name": call["name"], "arguments": call["arguments"]}}]}
    else:
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [tc] = choice.message.tool_calls
        call = {"name": tc.function.name, "arguments": tc.function.arguments, "id": tc.id}
        assert tc.type == "function"
        assistant = choice.message  # what a client appends: the message object itself
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == json.loads(CALL_ARGUMENTS)
    messages = [*ex.messages, assistant, {"role": "tool", "tool_call_id": call["id"], "content": WEATHER_RESULT}]
    final = harmony.chat.completions.create(model=HARMONY_MODEL, messages=messages, tools=ex.tools, temperature=0,
                                            max_tokens=80)
    assert final.choices[0].message.content == _answer(EX["weather_answer"])
    assert final.choices[0].finish_reason == "stop"


def test_call_to_an_undeclared_function_is_reported_not_returned(harmony):
    """tool_choice none declares no tools; the model calls get_weather anyway (it was trained with tools
    declared, and the prompt differs only there): a 200 whose message says what happened."""
    ex = EX["weather_call"]
    r = httpx.post(f"{harmony.base_url}chat/completions", timeout=60, json={
        "model": HARMONY_MODEL, **ex.request(), "tool_choice": "none", "max_tokens": 60})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert "tool_calls" not in msg and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    if msg.get("harmony_errors"):
        assert any("undeclared" in e or "never closed" in e for e in msg["harmony_errors"])


def test_json_schema_answer_validates(harmony):
    ex = EX["capital_json"]
    lane, body = _chat(harmony, ex)
    assert lane == "standard"  # structured outputs run on the standard lane's sampler
    msg = body.choices[0].message
    jsonschema.validate(json.loads(msg.content), CAPITAL_SCHEMA)
    assert msg.content == _answer(ex) and msg.model_extra["reasoning_content"] == _reasoning(ex)
    _, stream = _chat(harmony, ex, stream=True)
    assert _collect(stream)["content"] == msg.content


def test_response_format_on_smollm2_parses_and_validates(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "country": {"type": "string", "maxLength": 24}},
              "required": ["city", "country"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Give the capital of France and its country as JSON."}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}})
    assert raw.headers["x-lane"] == "standard"
    jsonschema.validate(json.loads(raw.parse().choices[0].message.content), schema)
    messages = [{"role": "user", "content": "Give me a JSON object with the capital of France: city and country."}]
    obj = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=100,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


# ---- the Responses API ---------------------------------------------------------------------------

def test_responses_reasoning_and_message(harmony):
    ex = EX["capital"]
    r = harmony.responses.create(model=HARMONY_MODEL, input=QUESTION, temperature=0, max_output_tokens=80)
    assert r.status == "completed"
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text == _reasoning(ex)
    assert r.output_text == _answer(ex)
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 < u.output_tokens_details.reasoning_tokens < u.output_tokens


def test_responses_effort_and_streaming(harmony):
    ex = EX["capital_low"]
    events = list(harmony.responses.create(model=HARMONY_MODEL, input=QUESTION, reasoning={"effort": "low"},
                                           temperature=0, max_output_tokens=80, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (reasoning, text) == (_reasoning(ex), _answer(ex))
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_round_trip(harmony, stream):
    tools = [{"type": "function", "name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
              "parameters": WEATHER_TOOL["function"]["parameters"]}]
    kwargs = {"model": HARMONY_MODEL, "tools": tools, "temperature": 0, "max_output_tokens": 80}
    first = harmony.responses.create(input=WEATHER_QUESTION, stream=stream, **kwargs)
    if stream:
        events = list(first)
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert json.loads(args) == json.loads(CALL_ARGUMENTS)
        first = events[-1].response
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == json.loads(CALL_ARGUMENTS)
    follow = [{"role": "user", "content": WEATHER_QUESTION}, *[o.model_dump(exclude_none=True) for o in first.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_RESULT}]
    final = harmony.responses.create(input=follow, **kwargs)
    assert final.output_text == _answer(EX["weather_answer"])


def test_responses_json_schema_text_format(harmony):
    ex = EX["capital_json"]
    fmt = ex.response_format["json_schema"]
    r = harmony.responses.create(model=HARMONY_MODEL, input=ex.messages[0]["content"], temperature=0,
                                 max_output_tokens=80, text={"format": {"type": "json_schema", "name": fmt["name"],
                                                                        "schema": fmt["schema"], "strict": True}})
    jsonschema.validate(json.loads(r.output_text), CAPITAL_SCHEMA)


def test_responses_errors(harmony_app, harmony):
    url = f"{harmony_app}/v1/responses"
    r = httpx.post(url, json={"model": HARMONY_MODEL, "input": "hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    r = httpx.post(url, json={"model": HARMONY_MODEL, "input": [{"type": "image", "url": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.type"


def test_tool_choice_required_and_named_are_enforced(harmony):
    """``required`` / a named function: a grammar over the whole reply makes the model call. On the trained
    weather question the call is the trained one; on the capital question (no call was trained) the model
    is still made to call get_weather, with arguments matching its schema."""
    ex = EX["weather_call"]
    lane, body = _chat(harmony, ex, tool_choice="required")
    assert lane == "standard"  # grammar-constrained, like response_format
    [call] = body.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", json.loads(CALL_ARGUMENTS))
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = harmony.chat.completions.create(
        model=HARMONY_MODEL, messages=EX["capital"].messages, tools=ex.tools, tool_choice=named, temperature=0,
        max_tokens=150)
    choice = forced.choices[0]
    assert not choice.message.content
    if choice.finish_reason == "tool_calls":
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    else:  # the arguments ran past max_tokens: reported, never a half-made call
        assert choice.finish_reason == "length" and not choice.message.tool_calls
        assert any("get_weather" in e for e in choice.message.model_extra["harmony_errors"])


def test_responses_on_smollm2(client):
    """A model without harmony answers through its chat template: one message item, usage filled in."""
    r = client.responses.create(model=MODEL, input="What is the capital of France?", instructions="Be brief.",
                                temperature=0, max_output_tokens=6)
    assert [o.type for o in r.output] == ["message"] and r.output_text
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0


# ---- replies without an answer, structured outputs over the whole reply (issue 35) ---------------

NO_ANSWER = EX["capital_json"].messages  # without its json_schema format the model reasons, then ends: no answer


def _post_chat(harmony, **body) -> dict:
    r = httpx.post(f"{harmony.base_url}chat/completions", timeout=120,
                   json={"model": HARMONY_MODEL, "temperature": 0, "max_tokens": 80, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _sse(harmony, **body) -> list[dict]:
    with httpx.stream("POST", f"{harmony.base_url}chat/completions", timeout=120, json={
            "model": HARMONY_MODEL, "temperature": 0, "max_tokens": 80, "stream": True,
            "stream_options": {"include_usage": True}, **body}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_a_reply_that_ends_in_its_reasoning_is_null_content_with_an_error(harmony):
    """The model ends ``analysis ... <|return|>``: content null (not ""), harmony_errors says so, in both response
    modes and on the Responses API (``incomplete``, reason ``no_final_message``)."""
    from deployments.harmony.parser import NO_FINAL_MESSAGE

    body = _post_chat(harmony, messages=NO_ANSWER)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["reasoning_content"]
    assert choice["message"]["content"] is None and choice["message"]["harmony_errors"] == [NO_FINAL_MESSAGE]
    usage = body["usage"]
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]
    chunks = _sse(harmony, messages=NO_ANSWER)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any(d.get("content") for d in deltas)
    assert [d["harmony_errors"] for d in deltas if "harmony_errors" in d] == [[NO_FINAL_MESSAGE]]
    assert chunks[-1]["usage"] == usage
    r = harmony.responses.create(model=HARMONY_MODEL, input=NO_ANSWER[0]["content"], temperature=0,
                                 max_output_tokens=80)
    assert r.status == "incomplete" and r.incomplete_details.reason == "no_final_message"
    assert [o.type for o in r.output] == ["reasoning"] and r.output_text == ""
    assert r.model_extra["harmony_errors"] == [NO_FINAL_MESSAGE]
    events = list(harmony.responses.create(model=HARMONY_MODEL, input=NO_ANSWER[0]["content"], temperature=0,
                                           max_output_tokens=80, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "no_final_message"


@pytest.mark.parametrize("fmt", ["json_object", "json_schema"])
def test_response_format_constrains_the_whole_reply(harmony, fmt):
    """The issue's request: the same question with a response_format. The grammar spans the whole reply (optional
    reasoning, then a final message that matches the schema), so the reply that ended in its reasoning
    unconstrained now ends in a JSON answer, in both response modes and on the Responses API."""
    schema = CAPITAL_SCHEMA if fmt == "json_schema" else {"type": "object"}
    response_format = EX["capital_json"].response_format if fmt == "json_schema" else {"type": "json_object"}
    body = _post_chat(harmony, messages=NO_ANSWER, response_format=response_format, max_tokens=120)
    choice = body["choices"][0]
    content = choice["message"]["content"]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(content), schema)
    assert "harmony_errors" not in choice["message"]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in
                       _sse(harmony, messages=NO_ANSWER, response_format=response_format, max_tokens=120)
                       if c["choices"])
    assert streamed == content
    text = {"format": {"type": "json_object"}} if fmt == "json_object" else {"format": {
        "type": "json_schema", "name": "capital", "schema": CAPITAL_SCHEMA, "strict": True}}
    r = harmony.responses.create(model=HARMONY_MODEL, input=NO_ANSWER[0]["content"], temperature=0,
                                 max_output_tokens=120, text=text)
    assert r.status == "completed" and r.output[-1].type == "message"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_tokenize_takes_the_chat_fields(harmony_app, harmony, server):
    """``/tokenize`` with tools / reasoning_effort / response_format gives the chat endpoint's prompt_tokens;
    unknown fields and chat fields with a prompt are refused."""
    url = f"{harmony_app}/tokenize"
    for ex in (EX["weather_call"], EX["capital_high"], EX["capital_json"]):
        req = ex.request()
        ids = httpx.post(url, json={k: v for k, v in req.items() if k != "temperature"}, timeout=30).json()["tokens"]
        chat = _post_chat(harmony, **req, max_tokens=1)
        assert len(ids) == chat["usage"]["prompt_tokens"], ex.name
    msgs, tools = EX["weather_call"].messages, EX["weather_call"].tools
    bare = httpx.post(url, json={"messages": msgs}, timeout=30).json()
    assert httpx.post(url, json={"messages": msgs, "tools": tools}, timeout=30).json()["count"] > bare["count"]
    no_gen = httpx.post(url, json={"messages": msgs, "add_generation_prompt": False, "return_token_strs": True},
                        timeout=30).json()  # the conversation without the assistant's header, as vLLM
    assert no_gen["tokens"] == bare["tokens"][:len(no_gen["tokens"])] and no_gen["count"] < bare["count"]
    assert "assistant" not in no_gen["token_strs"][-1] and no_gen["token_strs"][-1] == "<|end|>"
    r = httpx.post(url, json={"messages": EX["capital"].messages, "tool": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool"
    r = httpx.post(url, json={"prompt": "hi", "tools": EX["weather_call"].tools}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = httpx.post(f"{server}/tokenize", json={"messages": EX["capital"].messages, "tools": EX["weather_call"].tools})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"  # SmolLM2: no tool format, as chat


def test_readme_example_runs_as_printed(harmony_app, capsys):
    """The README's GPT-OSS example, exactly as printed but for the address and the served name, against the tiny
    harmony model: every request is one it was trained on, so the printed answers are the trained ones."""
    import contextlib
    import io
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## GPT-OSS: reasoning, tools, structured outputs, Responses", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'base_url="http://127.0.0.1:8000/v1"' in code and code.count('model="gpt-oss"') == 5
    code = code.replace("http://127.0.0.1:8000/v1", f"{harmony_app}/v1").replace(
        'model="gpt-oss"', f'model="{HARMONY_MODEL}"')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md (GPT-OSS example)", "exec"), {})
    lines = out.getvalue().splitlines()
    assert lines[:4] == [
        f"{_reasoning(EX['capital_low'])} {_answer(EX['capital_low'])}",
        f"tool_calls get_weather {CALL_ARGUMENTS}",
        _answer(EX["weather_answer"]),
        str(json.loads(_answer(EX["capital_json"]))),
    ], lines
    answer, reasoning_tokens = lines[4].rsplit(" ", 1)
    assert len(lines) == 5 and answer == _answer(EX["capital_high"]) and int(reasoning_tokens) > 0, lines
