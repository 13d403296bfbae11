"""The incremental detokenizer decodes a window of the newest ids per call; its text must be the text of
decoding every id on every call (what it did before), on real tokenizers: SmolLM2's (byte-level BPE, 49,152
ids) and the o200k harmony tokenizer of the tiny GPT-OSS (201,088 ids, harmony's special tokens). Random
ids make broken UTF-8 (byte tokens that start a character and never end it), special tokens that decode to
nothing, and words in any order."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicas.detokenizer import IncrementalDetokenizer


class WholeDecode(IncrementalDetokenizer):
    """The reference: every call decodes all the ids."""

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def harmony_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from ops.tools.make_tiny_harmony_model import write_harmony_tokenizer

    out = tmp_path_factory.mktemp("harmony-tokenizer")
    write_harmony_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


def _run(cls, tokenizer, ids, chunks, stop, include, min_tokens):
    """Feed ``ids`` in runs of ``chunks`` sizes (the last run final); the deltas, the stop hit and the text."""
    d = cls(tokenizer, stop, include)
    deltas, at = [], 0
    for n in chunks:
        part = ids[at: at + n]
        at += n
        deltas.append(d.append(part, final=at >= len(ids), check_stops=at >= min_tokens))
        if at >= len(ids) or d.stopped_on is not None:
            break
    return deltas, d.stopped_on, d.text


def _case(vocab: int):
    words = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=60)
    return st.tuples(words, st.lists(st.integers(1, 8), min_size=60, max_size=60),
                     st.sampled_from([(), ("e",), (" the", "."), ("\n",), ("ing ",)]), st.booleans(),
                     st.integers(0, 10))


def _check(tokenizer, case, common: list[int]):
    ids, chunks, stop, include, min_tokens = case
    ids = [common[i % len(common)] if i % 3 == 0 else t for i, t in enumerate(ids)]  # real words between
    got = _run(IncrementalDetokenizer, tokenizer, ids, chunks, stop, include, min_tokens)
    assert got == _run(WholeDecode, tokenizer, ids, chunks, stop, include, min_tokens)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_case(49152))
def test_smollm2_text_equals_the_whole_decode(tokenizer, case):
    _check(tokenizer, case, list(tokenizer.encode(" the cat sat on the mat, and then: ünïcödé 漢字 🙂\n")))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_case(201088))
def test_harmony_text_equals_the_whole_decode(harmony_tokenizer, case):
    _check(harmony_tokenizer, case,
           list(harmony_tokenizer.encode(" the cat sat on the mat, and then: ünïcödé 漢字 🙂\n")))


def test_a_long_output_decodes_a_window_per_call_not_the_whole_output(tokenizer):
    """A call decodes a few ids however long the output is (the reason for the offsets)."""
    ids = list(tokenizer.encode(" word" * 400))
    lengths = []
    decode = tokenizer.decode

    class Counting:
        def decode(self, part, skip_special_tokens=True):
            lengths.append(len(part))
            return decode(part, skip_special_tokens=skip_special_tokens)

    d = IncrementalDetokenizer(Counting())
    text = "".join(d.append([t]) for t in ids)
    assert text == decode(ids, skip_special_tokens=True)
    assert max(lengths) <= 4
