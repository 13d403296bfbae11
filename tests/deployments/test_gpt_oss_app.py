"""`serve run` of a GPT-OSS checkpoint on CPU: the tiny random model written by ops/tools/make_tiny_gpt_oss.py.

Its weights are random, so the text is noise; what is checked is that the real
app serves the GPT-OSS architecture end to end on both lanes and that greedy
output is the same on each.
"""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.ray

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_tiny_gpt_oss_chat_on_both_lanes(gptoss_app):
    client = openai.OpenAI(base_url=f"{gptoss_app}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny-gpt-oss"]
    greedy = client.chat.completions.with_raw_response.create(
        model="tiny-gpt-oss", messages=MESSAGES, temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    assert greedy.headers["x-lane"] == "persistent"
    body = greedy.parse()
    assert body.usage.completion_tokens == 24 and body.choices[0].finish_reason == "length"
    standard = client.chat.completions.with_raw_response.create(
        model="tiny-gpt-oss", messages=MESSAGES, temperature=0, max_tokens=24, n=2,
        extra_body={"ignore_eos": True})
    assert standard.headers["x-lane"] == "standard"
    assert standard.parse().choices[0].message.content == body.choices[0].message.content
    stream = client.chat.completions.create(model="tiny-gpt-oss", messages=MESSAGES, temperature=0.9, seed=1,
                                            max_tokens=16, stream=True, extra_body={"ignore_eos": True})
    assert sum(1 for c in stream if c.choices and c.choices[0].delta.content is not None) > 0
