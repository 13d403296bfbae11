"""One engine core through the sequence ``benchmarks/prefill.py`` runs, every step's inputs checked.

The first issue-18 H200 run faulted in the standard-lane sweep at 16 sequences after the TTFT and
prefix-cache parts had used the same core, while the same requests ran clean on a fresh engine; the cause
was a decode-graph workspace (``tests/replicas/kernels/test_triton_decode_attention.py``). This module pins
the rest of what such a core shares between parts on the CPU: the model runner's step inputs
(:class:`~replicas.step_inputs.StepInputs` rows reused by engines and lanes on one core, prefix-cached pages,
request ids reused across engines). Each step the runner builds is checked against the list path
(:func:`~replicas.model_runner.build_metadata`) and for bounds: every block-table entry a kernel may read is
the request's own page, every slot lies in the request's pages and inside the cache, the prefill attention's
tile map covers each sequence's new tokens exactly once; and the sweep's tokens equal a fresh core's.
"""

from __future__ import annotations

import torch

from benchmarks.engine import build_core
from replicas.engine import LLMEngine
from replicas.kernels import prefill_attention as pa
from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.messages import GenerateRequest
from replicas.model_runner import build_metadata
from replicas.persistent.eager import EagerBackend
from replicas.persistent.lane import PersistentLane
from replicas.request import SamplingParams
from replicas.scheduler import SchedulerConfig

PROMPT = 40
"""The sweep's prompt length; its token budget holds four prompts, so steps mix decodes with whole prompts
and chunks after cached context, as the bench's 16 sequences do with 8,192 tokens. The KV pool (20 pages)
cannot hold eight sequences past a page boundary: some are preempted and come back with new block tables,
their full pages revived from the prefix cache."""


def _core():
    return build_core("tiny-gpt-oss", torch.device("cpu"), torch.float32, 256,
                      {"num_kv_blocks": 20, "max_num_seqs": 8, "max_num_batched_tokens": 4 * PROMPT,
                       "enable_prefix_caching": True})


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check_step(core, batch, input_ids, meta, steps: list, input_tokens=None) -> None:
    """The bounds and list-path checks of one step's tensor inputs (see the module docstring)."""
    cache_slots = core.kv_cache.num_blocks * PAGE_SIZE
    ids_l, meta_l = build_metadata(batch, "cpu", input_tokens)
    assert input_ids.long().tolist() == ids_l.tolist()
    assert meta.positions.tolist() == meta_l.positions.tolist()
    assert meta.slot_mapping.tolist() == meta_l.slot_mapping.tolist()
    assert meta.query_start == meta_l.query_start and meta.context_lens == meta_l.context_lens
    table = meta.device.block_table
    assert table.shape[1] == core.runner.inputs.max_blocks
    slots = meta.slot_mapping.tolist()
    for i, (req, n) in enumerate(batch):
        pages = req.block_table
        ctx = req.num_computed_tokens + n
        read = -(-ctx // PAGE_SIZE)  # the pages a kernel reads for this sequence
        assert read <= len(pages) and table[i, :read].tolist() == pages[:read], req.request_id
        own = set(pages)
        for s in slots[meta.query_start[i]:meta.query_start[i + 1]]:
            assert 0 <= s < cache_slots and s // PAGE_SIZE in own, (req.request_id, s)
    cfg = core.model.config
    block_t = pa.tokens_per_tile(cfg.num_heads, cfg.num_kv_heads)
    num_tiles = pa.num_tiles_for(meta.query_lens, block_t)
    tile_seq, tile_first = pa.tile_map(meta.device.query_start, block_t, num_tiles)
    covered = [[0] * n for n in meta.query_lens]
    for s, f in zip(tile_seq.tolist(), tile_first.tolist(), strict=True):
        assert 0 <= s < len(batch) and 0 <= f < meta.query_lens[s]
        for t in range(f, min(f + block_t, meta.query_lens[s])):
            covered[s][t] += 1
    assert all(c == 1 for row in covered for c in row)
    steps.append((len(batch), sum(n for _, n in batch)))


def _checked(core) -> list:
    """Wrap ``core``'s step-input builder with :func:`_check_step`; returns the list of (sequences, tokens)
    of every step built."""
    inputs, steps = core.runner.inputs, []
    build = inputs.build

    def checked(batch, kernels=True, input_tokens=None):
        input_ids, meta = build(batch, kernels, input_tokens)
        _check_step(core, batch, input_ids, meta, steps, input_tokens)
        return input_ids, meta

    inputs.build = checked
    return steps


def _sweep(core, c: int, preempted: list | None = None) -> list[list[int]]:
    engine = LLMEngine(core, SchedulerConfig(8, 4 * PROMPT, True))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # past a page boundary
    for i in range(c):
        engine.add_request(f"c{c}-{i}", _prompt(PROMPT, 1000 * c + i), params)
    out: dict[str, list[int]] = {f"c{c}-{i}": [] for i in range(c)}
    while engine.has_unfinished():
        for chunk in engine.step():
            out[chunk.request_id] += chunk.token_ids
    assert core.allocator.num_free == core.allocator.num_blocks
    if preempted is not None:
        preempted.append(engine.scheduler.num_preemptions)
    return [out[f"c{c}-{i}"] for i in range(c)]


def test_bench_sequence_on_one_core():
    core = _core()
    steps = _checked(core)
    greedy_one = SamplingParams(max_tokens=1, temperature=0.0)
    # warm-up and TTFT parts: the persistent lane's prefills, then single requests on the standard lane, one
    # request id reused throughout (as the bench's "ttft")
    lane = PersistentLane(core, EagerBackend(core.model, "cpu"))
    for n in (16, 30, 70, 150):
        assert list(lane.generate(GenerateRequest("ttft", _prompt(n, n), greedy_one)))
        engine = LLMEngine(core, SchedulerConfig(8, 4 * PROMPT, True))
        engine.add_request("ttft", _prompt(n, 100 + n), SamplingParams(max_tokens=1, temperature=0.0,
                                                                       ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    # the repeated prompt: the second prefill starts after the prompt's cached full pages
    repeat = _prompt(70, 400)
    first = [t for ch in lane.generate(GenerateRequest("ttft", repeat, greedy_one)) for t in ch.token_ids]
    hits = lane.prefix_hit_tokens
    again = [t for ch in lane.generate(GenerateRequest("ttft", repeat, greedy_one)) for t in ch.token_ids]
    assert lane.prefix_hit_tokens - hits == 64 and again == first
    assert core.allocator.num_free == core.allocator.num_blocks
    # the sweep, then the same requests on a fresh core: token for token
    preempted: list[int] = []
    shared = {c: _sweep(core, c, preempted) for c in (1, 4, 8)}
    assert preempted[-1] > 0, preempted  # 20 pages for 8 sequences of 4: recompute, new tables, cached prefixes
    assert any(1 < b < t and t % PROMPT for b, t in steps), steps  # decodes and prompt chunks in one step
    fresh = _core()
    _checked(fresh)
    assert {c: _sweep(fresh, c) for c in (1, 4, 8)} == shared
