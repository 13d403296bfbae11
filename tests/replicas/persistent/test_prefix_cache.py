"""Prefix caching on the persistent lane: the real SmolLM2 engine on CPU with the ``eager`` backend.

A greedy request whose prompt prefix is cached prefills only the rest and produces the same tokens as
without a cache; the next turn of a conversation (prompt + reply + a new user turn) finds the previous
turn's reply cached too; the page pool is full after every request; a backend that cannot take cached
pages (MK1's envelope) keeps prefix caching off.
"""

from __future__ import annotations

from replicas.persistent.eager import EagerBackend
from replicas.persistent.factory import backend_takes_cached_pages
from replicas.persistent.lane import PersistentLane
from replicas.request import SamplingParams
from tests.replicas.conftest import (
    assert_pool_full,
    chat_ids,
    greedy_request,
    small_core,
    tokens_of,
)

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _lane(core, prefix_caching: bool, backend_cls=EagerBackend):
    small = small_core(core, num_kv_blocks=64, max_model_len=512, prefix_caching=prefix_caching)
    prefilled: list[int] = []
    execute = small.runner.execute

    def spy(batch):  # the real runner; records how many prompt tokens each prefill computes
        prefilled.extend(n for _, n in batch)
        return execute(batch)

    small.runner.execute = spy
    return PersistentLane(small, backend_cls(small.model, small.runner.device)), prefilled


def _generate(lane, rid, ids) -> list[int]:
    out = tokens_of(list(lane.generate(greedy_request(rid, ids, PARAMS))))
    assert_pool_full(lane.core)
    return out


def test_cached_prefix_prefills_only_the_rest_with_identical_tokens(core, tokenizer):
    prompt = chat_ids(tokenizer, "You are a careful assistant. Explain, step by step and with an example, how a "
                                 "hash table resolves collisions, and compare chaining with open addressing.")
    assert len(prompt) > 48
    plain, _ = _lane(core, prefix_caching=False)
    want = _generate(plain, "plain", prompt)

    lane, prefilled = _lane(core, prefix_caching=True)
    assert lane.prefix_caching
    assert _generate(lane, "first", prompt) == want and prefilled == [len(prompt)]
    assert _generate(lane, "again", prompt) == want
    cached = (len(prompt) - 1) // 16 * 16
    assert prefilled[1] == len(prompt) - cached and lane.prefix_hit_tokens == cached
    assert lane.stats()["kv_pages_cached"] > 0

    # the next turn: the reply's pages were registered when the first request ended
    turn2 = prompt + want + chat_ids(tokenizer, "Now in one sentence.")[1:]
    assert _generate(lane, "turn2", turn2) == _generate(plain, "turn2-plain", turn2)
    assert prefilled[2] <= len(turn2) - (len(prompt) + len(want) - 1) // 16 * 16


def test_backend_without_cached_pages_keeps_it_off(core, tokenizer):
    class NoCachedPages(EagerBackend):
        takes_cached_pages = False

    lane, prefilled = _lane(core, prefix_caching=True, backend_cls=NoCachedPages)
    assert not lane.prefix_caching and not backend_takes_cached_pages("mk1") and backend_takes_cached_pages("auto")
    prompt = chat_ids(tokenizer, "Name three rivers in Europe and say where each one reaches the sea, please.")
    first = _generate(lane, "a", prompt)
    assert _generate(lane, "b", prompt) == first
    assert prefilled == [len(prompt)] * 2 and lane.prefix_hit_tokens == 0
