"""Structured outputs on the standard lane: llguidance's mask, its gating, and the engine end to end (SmolLM2)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from replicas.engine import LLMEngine
from replicas.request import SamplingParams
from replicas.sampler import SamplingRow, sample_rows
from replicas.structured_output import GrammarCompiler, GrammarError, structured_output
from tests.replicas.conftest import chat_ids, run_standard, tokens_of

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "country": {"type": "string", "maxLength": 20}},
          "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer)


def test_bad_schemas_are_refused():
    with pytest.raises(GrammarError):
        structured_output({"type": "nonsense"})
    assert json.loads(structured_output(None).schema) == {"type": "object"}


def test_mask_follows_a_valid_answer_then_allows_only_eos(compiler, tokenizer):
    c = compiler.constraint(structured_output(SCHEMA))
    vocab = len(tokenizer)
    for tok in tokenizer.encode('{"city": "Paris", "country": "France"}', add_special_tokens=False):
        mask = c.allowed(vocab)
        assert mask is not None and bool(mask[tok]) and not bool(mask.all())
        c.accept(tok)
    mask = c.allowed(vocab)
    assert mask.nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert c.error is None


def test_mask_waits_for_start_after(compiler, tokenizer):
    trigger = tuple(tokenizer.encode("ANSWER:", add_special_tokens=False))
    c = compiler.constraint(structured_output(SCHEMA, trigger))
    for tok in tokenizer.encode("free text first ", add_special_tokens=False):
        assert c.allowed(len(tokenizer)) is None
        c.accept(tok)
    for tok in trigger:
        c.accept(tok)
    mask = c.allowed(len(tokenizer))
    assert mask is not None and bool(mask[tokenizer.encode("{", add_special_tokens=False)[0]])
    assert not bool(mask[tokenizer.encode("free", add_special_tokens=False)[0]])


def test_sampler_applies_the_mask():
    logits = torch.tensor([[5.0, 1.0, 3.0, 0.0]])
    mask = torch.tensor([False, True, True, False])
    greedy = SamplingParams(temperature=0.0)
    assert sample_rows(logits, [SamplingRow(greedy, None, (), (), allowed_token_mask=mask)]).token_ids == [2]
    sampled = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    picks = {sample_rows(logits, [SamplingRow(sampled, gen, (), (), allowed_token_mask=mask)]).token_ids[0]
             for _ in range(50)}
    assert picks <= {1, 2}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_output_validates(core, tokenizer, temperature):
    engine = LLMEngine(core)
    ids = chat_ids(tokenizer, "Give me a JSON object with the capital of France: city and country.")
    params = SamplingParams(max_tokens=60, temperature=temperature, seed=1, n=2,
                            structured_output=structured_output(SCHEMA))
    chunks = run_standard(engine, {"so": (ids, params)})["so"]
    for index in (0, 1):
        mine = [c for c in chunks if c.index == index]
        assert mine[-1].finish_reason == "stop"
        text = tokenizer.decode(tokens_of(mine), skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_grammar_wins_over_min_tokens_bans():
    """min_tokens bans EOS, but a complete grammar allows only EOS: the grammar's token is picked."""
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.tensor([False, False, True])
    row = SamplingRow(SamplingParams(temperature=0.0), None, (), (), banned_token_ids=frozenset({2}),
                      allowed_token_mask=mask)
    assert sample_rows(logits, [row]).token_ids == [2]
