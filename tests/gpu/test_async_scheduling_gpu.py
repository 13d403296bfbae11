"""Async scheduling on the GPU (``EngineConfig.async_scheduling``, docs/decisions/0031-async-scheduling.md): with
``batch_invariant`` on, every chunk equals the synchronous engine's, logprob values included, exact equality.

On the GPU the step ahead takes its input tokens from the held picks on the device (through the step-input
buffers into a decode graph), and a row that ends on a stop id while in a step ahead rides along in it (its
result dropped). Row-exact kernels make the other rows' results independent of it, so nothing may differ.
A small random GPT-OSS (sinks, a sliding window, 16 experts) in bf16."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.gpu.conftest import dummy_core, prompts_for  # noqa: E402


@pytest.fixture(scope="module")
def core():
    c = dummy_core("small-gpt-oss", torch.bfloat16, 512, batch_invariant=True, max_num_seqs=64,
                   num_kv_blocks=32 * 32 + 64, enable_prefix_caching=True)
    c.model.lm_head.weight.data.mul_(20)  # random logits spread out (as the exactness tests do)
    yield c
    del c
    torch.cuda.empty_cache()


def _run(core, async_scheduling: bool, script: dict[int, list[tuple]]):
    from replicas.engine import LLMEngine
    from replicas.scheduler import SchedulerConfig

    config = core.config
    core.config = config.model_copy(update={"async_scheduling": async_scheduling})
    try:
        eng = LLMEngine(core, SchedulerConfig(32, 1024, True))
    finally:
        core.config = config
    out: dict[tuple[str, int], list[tuple]] = {}
    ahead = 0
    launch = eng._launch_ahead

    def counted(prev, plan):
        nonlocal ahead
        ahead += 1
        return launch(prev, plan)

    eng._launch_ahead = counted
    step, last = 0, max(script)
    while step <= last or eng.has_unfinished():
        for rid, prompt, params in script.get(step, ()):
            eng.add_request(rid, prompt, params)
        for c in eng.step():
            out.setdefault((c.request_id, c.index), []).append(
                (c.token_ids, c.finish_reason, c.logprobs, c.num_output_tokens))
        step += 1
    assert core.allocator.num_free == core.allocator.num_blocks
    return out, ahead


def test_async_scheduling_equals_sync_with_row_exact_kernels(core):
    """24 requests, greedy and seeded sampled (top-p, top-k), arriving over 12 steps, logprobs on some, stop
    ids that end some mid-batch: the same chunks, and the async engine did launch steps ahead."""
    from replicas.request import SamplingParams

    prompts = prompts_for(core, 24, seed=3)
    probe, _ = _run(core, False, {0: [(f"p{i}", prompts[i], SamplingParams(max_tokens=24, temperature=0.0,
                                                                          ignore_eos=True)) for i in range(4)]})
    counts: dict[int, int] = {}
    for chunks in probe.values():
        for c in chunks:
            counts[c[0][0]] = counts.get(c[0][0], 0) + 1
    stops = tuple(sorted(counts, key=counts.get, reverse=True)[:2])  # tokens the model emits often
    script: dict[int, list[tuple]] = {}
    for i, prompt in enumerate(prompts):
        sampled = i % 2 == 1
        params = SamplingParams(max_tokens=16 + 3 * (i % 5), temperature=0.9 if sampled else 0.0,
                                top_p=0.9 if sampled else 1.0, top_k=50 if i % 4 == 1 else None,
                                seed=100 + i if sampled else None, logprobs=2 if i % 3 == 0 else None,
                                stop_token_ids=stops if i % 3 != 2 else (), ignore_eos=True)
        script.setdefault(i // 2, []).append((f"r{i}", prompt, params))
    want, _ = _run(core, False, script)
    got, ahead = _run(core, True, script)
    assert ahead > 10
    assert any(chunks[-1][1] == "stop" for chunks in want.values())
    assert got == want
