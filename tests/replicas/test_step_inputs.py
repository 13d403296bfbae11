"""The tensor metadata path (:class:`replicas.step_inputs.StepInputs`) equals the list path
(:func:`replicas.model_runner.build_metadata`), step after step: whole prompts, chunks after cached context,
decode tokens, growing block tables, a preempted request coming back with a new table, rows recycled when
they run out; and an engine on the tensor path produces the same tokens as on the list path."""

from __future__ import annotations

import torch

from replicas.kv_cache import PageAllocator
from replicas.model_runner import build_metadata
from replicas.request import Request, SamplingParams
from replicas.step_inputs import StepInputs, request_tokens


def assert_same(batch, inputs: StepInputs):
    ids_l, meta_l = build_metadata(batch, "cpu")
    ids_t, meta_t = inputs.build(batch)
    assert ids_t.long().tolist() == ids_l.tolist()
    assert meta_t.positions.tolist() == meta_l.positions.tolist()
    assert meta_t.slot_mapping.tolist() == meta_l.slot_mapping.tolist()
    assert meta_t.query_start == meta_l.query_start and meta_t.context_lens == meta_l.context_lens
    assert len(meta_t.block_tables) == len(meta_l.block_tables)
    for got, want in zip(meta_t.block_tables, meta_l.block_tables, strict=True):
        assert got.tolist() == want.tolist()
    assert meta_t.last_token_indices.tolist() == meta_l.last_token_indices.tolist()
    dev = meta_t.device
    assert dev.query_start.tolist() == meta_l.query_start and dev.context_lens.tolist() == meta_l.context_lens
    for i, want in enumerate(meta_l.block_tables):
        assert dev.block_table[i, : want.numel()].tolist() == want.tolist()


def _request(rid: str, prompt_len: int, seed: int) -> Request:
    g = torch.Generator().manual_seed(seed)
    return Request(rid, torch.randint(0, 1000, (prompt_len,), generator=g).tolist(), SamplingParams(max_tokens=64))


def test_tensor_path_equals_list_path_over_steps():
    alloc = PageAllocator(200)
    inputs = StepInputs("cpu", max_blocks=16, max_rows=3)  # 3 rows for 4 requests: rows get recycled
    a, b, c, d = (_request(r, n, i) for i, (r, n) in enumerate([("a", 40), ("b", 70), ("c", 5), ("d", 33)]))
    for req in (a, b, c, d):
        alloc.grow(req.block_table, req.num_prompt_tokens)
    # step 1: a whole, b's first chunk of 30
    assert_same([(a, 40), (b, 30)], inputs)
    a.num_computed_tokens, b.num_computed_tokens = 40, 30
    a.output_token_ids.append(7)
    alloc.grow(a.block_table, 41)
    # step 2: a decodes at 40, b's next chunk after 30 cached tokens, c whole
    assert_same([(a, 1), (b, 40), (c, 5)], inputs)
    a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens = 41, 70, 5
    for req in (a, b, c):
        req.output_token_ids.append(11)
        alloc.grow(req.block_table, req.num_tokens)
    # step 3: d joins (no free row: b's row is recycled, b not in this batch), a crosses a page boundary
    a.output_token_ids += list(range(6))
    a.num_computed_tokens = a.num_tokens - 1
    alloc.grow(a.block_table, a.num_tokens)
    assert_same([(a, 1), (c, 1), (d, 33)], inputs)
    # step 4: b preempted and back with a new (shorter) table, prompt + output recomputed
    alloc.release(b.block_table)
    b.block_table = alloc.allocate(5)
    b.num_computed_tokens = 0
    assert_same([(b, b.num_tokens), (c, 1)], inputs)


def test_request_tokens_slices_prompt_and_output():
    req = _request("r", 10, 1)
    req.output_token_ids += [1, 2, 3]
    for start, end in [(0, 10), (3, 12), (10, 13), (12, 13), (0, 13)]:
        assert request_tokens(req, start, end) == req.all_token_ids[start:end]


def test_engine_tokens_equal_on_both_paths(tmp_path):
    """A tiny GPT-OSS (sinks, window) on the standard lane: identical greedy tokens with the runner's tensor
    path and with the list path, prompts chunked across steps and mixed with decodes."""
    from ops.tools.make_tiny_gpt_oss import make_tiny_gpt_oss
    from replicas.config import EngineConfig
    from replicas.engine import EngineCore, LLMEngine
    from replicas.scheduler import SchedulerConfig

    core = EngineCore.load(EngineConfig(model=str(make_tiny_gpt_oss(tmp_path, seed=1)), dtype="float32",
                                        progress=False, max_model_len=256, enable_prefix_caching=False))
    assert core.runner.inputs is not None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, core.model.config.vocab_size, (n,), generator=g).tolist() for n in (90, 17, 40)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    for inputs in (core.runner.inputs, None):
        core.runner.inputs = inputs
        engine = LLMEngine(core, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=48))
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for chunk in engine.step():
                got.setdefault(chunk.request_id, []).extend(chunk.token_ids)
        outs.append(got)
        assert core.allocator.num_free == core.allocator.num_blocks
    assert outs[0] == outs[1] and all(len(v) == 12 for v in outs[0].values())
