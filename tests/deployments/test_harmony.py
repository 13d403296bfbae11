"""Harmony without a server: the offline vocabulary, prompt rendering and the token-id output parser.

The parser is fed the real o200k harmony token ids of model outputs (every channel, calls, partial
and malformed output) split every possible way, as the two lanes split them: one token at a time
(standard), quanta of up to 8 (persistent), and any other split (hypothesis); the deltas must
concatenate to the non-streamed message and the result must not depend on the split.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.harmony import FunctionTool, HarmonyOutputParser, harmony_encoding, render_chat
from deployments.harmony.parser import (
    CALL,
    CHANNEL,
    END,
    MESSAGE,
    NO_FINAL_MESSAGE,
    RETURN,
    START,
    parse_header,
)
from deployments.harmony.vocab import O200K_SHA256, VOCAB_FILE, render_vocab_file, vocab_dir


@pytest.fixture(scope="module")
def enc():
    return harmony_encoding()


def ids(enc, text: str) -> list[int]:
    return list(enc.encode(text, allowed_special="all"))


WEATHER = FunctionTool("get_weather", "Get the weather", {"type": "object", "properties": {"city": {"type": "string"}}})
OUTPUTS = {
    "reasoning_then_final": ("<|channel|>analysis<|message|>Think about é and 日本.<|end|><|start|>assistant"
                             "<|channel|>final<|message|>The answer is 42.<|return|>"),
    "call": ("<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions.get_weather"
             "<|channel|>commentary <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>"),
    "recipient_after_channel": ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                                "{\"city\": \"Oslo\"}<|call|>"),
    "preamble_then_call": ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather"
                           "<|channel|>commentary json<|message|>{}<|call|>"),
    "final_only": "<|channel|>final<|message|>Just this.<|return|>",
    "cut_in_analysis": "<|channel|>analysis<|message|>I was thinking about",
    "cut_in_call": "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary<|message|>{\"ci",
    "undeclared": "<|start|>assistant to=functions.rm_rf<|channel|>commentary json<|message|>{}<|call|>",
    "bad_json": "<|channel|>commentary to=functions.get_weather<|message|>{city: Paris<|call|>",
    "no_header": "Plain text with no header.<|return|>",
    "stray_start": "<|channel|>final<|message|>partial <|start|>assistant<|channel|>final<|message|>again<|return|>",
    "special_in_content": "<|channel|>final<|message|>a<|channel|>b<|return|>",
    "builtin_tool": "<|channel|>analysis to=browser.search<|message|>{\"q\": 1}<|call|>",
    "reasoning_only": "<|channel|>analysis<|message|>Paris, as JSON.<|return|>",
}


def parse(enc, tokens, splits=None, declared=frozenset({"get_weather"}), finish="stop"):
    """Feed ``tokens`` in pieces of the given sizes; returns (parser, concatenated deltas)."""
    p = HarmonyOutputParser(enc, declared)
    out = {"reasoning": "", "content": "", "calls": []}
    pos, sizes = 0, list(splits or [len(tokens)])
    while pos < len(tokens):
        n = sizes.pop(0) if sizes else len(tokens) - pos
        for d in (p.feed(tokens[pos:pos + n]),):
            out["reasoning"] += d.reasoning
            out["content"] += d.content
            out["calls"] += [(c.name, c.arguments) for c in d.tool_calls]
        pos += n
    d = p.finish(finish)
    out["reasoning"] += d.reasoning
    out["content"] += d.content
    out["calls"] += [(c.name, c.arguments) for c in d.tool_calls]
    return p, out


def summary(p) -> tuple:
    return p.reasoning, p.content, [(c.name, c.arguments) for c in p.tool_calls], p.errors


def test_vocab_file_is_byte_exact(enc):
    data = (vocab_dir() / VOCAB_FILE).read_bytes()
    assert hashlib.sha256(data).hexdigest() == O200K_SHA256
    assert render_vocab_file([b"a", b"\xff"]) == b"YQ== 0\n/w== 1\n"


def test_token_ids_are_harmonys(enc):
    for name, tid in {"<|start|>": START, "<|end|>": END, "<|message|>": MESSAGE, "<|channel|>": CHANNEL,
                      "<|return|>": RETURN, "<|call|>": CALL}.items():
        assert ids(enc, name) == [tid]
    assert sorted(enc.stop_tokens_for_assistant_actions()) == [RETURN, CALL]


def test_channels_and_calls(enc):
    p, _ = parse(enc, ids(enc, OUTPUTS["reasoning_then_final"]))
    assert summary(p) == ("Think about é and 日本.", "The answer is 42.", [], [])
    assert p.ended_with == RETURN and p.finish_reason_override is None
    p, _ = parse(enc, ids(enc, OUTPUTS["call"]))
    assert summary(p) == ("Call it.", "", [("get_weather", '{"city": "Paris"}')], [])
    assert p.ended_with == CALL and p.finish_reason_override == "tool_calls"
    assert p.tool_calls[0].to_openai()["type"] == "function" and p.tool_calls[0].id.startswith("call_")
    p, _ = parse(enc, ids(enc, OUTPUTS["recipient_after_channel"]))
    assert summary(p)[2] == [("get_weather", '{"city": "Oslo"}')]
    p, _ = parse(enc, ids(enc, OUTPUTS["preamble_then_call"]))
    assert summary(p) == ("", "Checking.", [("get_weather", "{}")], [])


@pytest.mark.parametrize("name,needle", [
    ("cut_in_analysis", "max_tokens was reached inside the analysis channel"),
    ("cut_in_call", "inside the call to functions.get_weather"),
    ("undeclared", "undeclared function 'rm_rf'"),
    ("bad_json", "not JSON"),
    ("no_header", "text outside a harmony message"),
    ("stray_start", "unexpected token 200006"),
    ("special_in_content", "unexpected token 200005"),
    ("builtin_tool", "not a function tool"),
])
def test_malformed_output_is_reported_never_raised(enc, name, needle):
    p, _ = parse(enc, ids(enc, OUTPUTS[name]), finish="length")
    assert any(needle in e for e in p.errors), p.errors
    assert not p.tool_calls  # nothing half-made is returned as a call
    if name == "cut_in_analysis":
        assert p.reasoning == "I was thinking about"
    if name in ("no_header", "special_in_content"):
        assert p.content in ("Plain text with no header.", "ab")
    if name == "stray_start":
        assert p.content == "partial again"


def test_header_parsing():
    h = parse_header("assistant to=functions.f<|channel|>commentary <|constrain|>json")
    assert (h.channel, h.recipient, h.content_type) == ("commentary", "functions.f", "json")
    h = parse_header("<|channel|>analysis")
    assert (h.channel, h.recipient, h.content_type) == ("analysis", None, None)


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_every_quantum_boundary(enc, name):
    """A quantum of 8 starting at every offset, and one token at a time: the same message."""
    tokens = ids(enc, OUTPUTS[name])
    ref, ref_out = parse(enc, tokens, [1] * len(tokens))
    assert (ref_out["reasoning"], ref_out["content"]) == (ref.reasoning, ref.content)
    for first in range(1, 9):
        p, out = parse(enc, tokens, [first] + [8] * len(tokens))
        assert summary(p)[:2] == summary(ref)[:2] and summary(p)[3] == summary(ref)[3]
        assert [(c.name, c.arguments) for c in p.tool_calls] == [(c.name, c.arguments) for c in ref.tool_calls]
        assert (out["reasoning"], out["content"], out["calls"]) == (p.reasoning, p.content,
                                                                   [(c.name, c.arguments) for c in p.tool_calls])


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(OUTPUTS)), splits=st.lists(st.integers(1, 12), min_size=1, max_size=40),
       cut=st.integers(0, 60))
def test_any_split_and_any_prefix(name, splits, cut):
    """Any split of any prefix (output cut off anywhere) gives the split-independent result, and the
    streamed deltas concatenate to it."""
    enc = harmony_encoding()
    tokens = ids(enc, OUTPUTS[name])
    tokens = tokens[:max(1, len(tokens) - cut)]
    ref, _ = parse(enc, tokens, [1] * len(tokens), finish="length")
    p, out = parse(enc, tokens, splits, finish="length")
    assert (p.reasoning, p.content, p.errors) == (ref.reasoning, ref.content, ref.errors)
    assert (out["reasoning"], out["content"]) == (p.reasoning, p.content)
    assert out["calls"] == [(c.name, c.arguments) for c in p.tool_calls]


def test_render_roles_tools_effort(enc):
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need it.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    p = render_chat(messages, tools=[WEATHER], reasoning_effort="high", conversation_start_date="2025-01-02")
    text = enc.decode(p.token_ids)
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: high" in text
    assert "Current date: 2025-01-02" in text and "Valid channels: analysis, commentary, final" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe terse.\n\n# Tools" in text
    assert "type get_weather = " in text
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant to=functions.get_weather"
            "<|channel|>commentary json<|message|>{}<|call|>") in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>" in text
    assert text.endswith("<|start|>assistant") and p.declared_tools == {"get_weather"}
    plain = enc.decode(render_chat([{"role": "user", "content": "hi"}]).token_ids)
    assert "Reasoning: medium" in plain and "commentary" not in plain and "developer" not in plain


def test_render_drops_old_reasoning_and_names_bad_tool_messages(enc):
    from deployments.harmony import RenderError

    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": "b", "reasoning_content": "secret"},
                {"role": "user", "content": "c"}]
    assert "secret" not in enc.decode(render_chat(messages).token_ids)
    with pytest.raises(RenderError) as err:
        render_chat([{"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": "nope", "content": "x"}])
    assert err.value.param == "messages.1.tool_call_id"
    fmt = render_chat([{"role": "user", "content": "a"}], response_format=("answer", {"type": "object"}, None))
    assert '# Response Formats\n\n## answer\n\n{"type":"object"}' in enc.decode(fmt.token_ids)
    assert json.loads('{"type":"object"}') == {"type": "object"}


def test_checkpoint_chat_template_agrees_with_the_renderer(tiny_harmony_model):
    """The tiny harmony checkpoint ships its own chat template; the ingress's load-time check finds it gives
    openai-harmony's ids, and reports a template that does not."""
    from transformers import AutoTokenizer

    from deployments.chat_plan import ChatPlanner

    planner = ChatPlanner(AutoTokenizer.from_pretrained(tiny_harmony_model), tiny_harmony_model, "2025-06-28")
    assert planner.harmony and planner.template_check == "agrees"
    assert planner.describe()["checkpoint_chat_template"] == "agrees"
    broken = planner.tokenizer.chat_template.replace("Reasoning: ", "Reasoning effort: ")
    assert planner.check_checkpoint_template(broken).startswith("differs")


def test_a_reply_that_ends_in_its_reasoning_has_no_answer_and_says_so(enc):
    """``analysis ... <|return|>``: no content, and an error naming it (a client must not read "" as the
    answer); cut by max_tokens, the cut is the error; a reply with an answer or a call has none."""
    p, _ = parse(enc, ids(enc, OUTPUTS["reasoning_only"]))
    assert summary(p) == ("Paris, as JSON.", "", [], [NO_FINAL_MESSAGE])
    p, _ = parse(enc, ids(enc, OUTPUTS["cut_in_analysis"]), finish="length")
    assert NO_FINAL_MESSAGE not in p.errors and "max_tokens" in p.errors[0]
    for name in ("reasoning_then_final", "call", "final_only"):
        assert parse(enc, ids(enc, OUTPUTS[name]))[0].errors == []
