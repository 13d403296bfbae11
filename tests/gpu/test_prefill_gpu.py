"""On an NVIDIA GPU: the prefill kernels and the batched standard lane (issue 18), on fresh random inputs.

Run through the device: ``python -m pytest tests/gpu/test_prefill_gpu.py -q -o addopts=""``. The checks are
the ones ``python -m benchmarks.prefill`` prints (its ``checks`` and ``lanes`` parts): the Triton prefill
attention and the grouped MXFP4 MoE GEMMs in bf16 against the torch references in fp32, the tensor step
metadata against the list path, and greedy tokens of a small random GPT-OSS (fp32) identical between the
persistent lane and the standard lane (20 prompts x 128 tokens, all at once on the standard lane: decode
graphs past 16 sequences) and between the standard lane at concurrency 64 and the same requests alone.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _failed(rows):
    return [r for r in rows if not r[-1]]


def test_prefill_attention_bf16_matches_reference():
    from benchmarks.prefill import check_attention

    rows = check_attention()
    assert rows and not _failed(rows), _failed(rows)


def test_grouped_moe_bf16_matches_reference_in_both_layouts():
    from benchmarks.prefill import check_moe

    rows = check_moe()
    assert len(rows) == 8 and not _failed(rows), _failed(rows)


def test_step_metadata_tensor_path_equals_list_path_on_the_gpu():
    from benchmarks.prefill import check_step_inputs

    assert not _failed(check_step_inputs())


def test_lanes_agree_and_concurrency_64_matches_one_at_a_time():
    from benchmarks.prefill import lanes_agreement

    r = lanes_agreement(torch.float32)
    print(r)
    assert r["persistent_vs_standard"] == r["prompts"] == 20
    assert any(b > 16 for b in r["graph_buckets_used"]), r["graph_buckets_used"]  # grouped MoE inside a graph
    # fp32, logits spread 20x: batch-one and grouped kernels sum in different orders, ties are rare
    assert r["concurrent_vs_alone"] >= 60, r


def test_standard_lane_steps_do_not_synchronize_the_host_inside_the_forward():
    """Issue 18's step without host synchronization: a small random GPT-OSS (bf16, prefill kernels, decode
    graphs) serves 40 requests arriving in two waves with a 256-token step budget, so chunked prefills mix
    with decodes and decode batches pass 16 sequences. Every forward runs under torch's sync debug mode set to
    ``error``: a ``.item()``, a device-to-host copy or a stream synchronization inside it raises. The one
    read per step that must wait, the sampled tokens (:func:`replicas.sampler.sample_rows`), is outside."""
    from benchmarks.prefill import SMALL_GPT_OSS
    from ops.tools.make_tiny_gpt_oss import real_config
    from replicas.engine import LLMEngine
    from replicas.request import SamplingParams
    from replicas.scheduler import SchedulerConfig
    from tests.gpu.conftest import dummy_core

    core = dummy_core({**real_config("20b"), **SMALL_GPT_OSS}, torch.bfloat16, 512, num_kv_blocks=1400,
                      max_num_seqs=64)
    engine = LLMEngine(core, SchedulerConfig(64, 256, True))
    engine.warm_up()  # compile and capture outside the strict region
    execute, forwards = core.runner.execute, []

    def strict(batch):
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = execute(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        forwards.append((len(batch), sum(n for _, n in batch)))
        return logits

    core.runner.execute = strict
    g = torch.Generator().manual_seed(3)
    vocab = SMALL_GPT_OSS["vocab_size"]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    done: dict[str, int] = {}
    for wave in range(2):
        for i in range(20):
            n = int(torch.randint(20, 300, (1,), generator=g))
            engine.add_request(f"w{wave}-{i}", torch.randint(3, vocab, (n,), generator=g).tolist(), params)
        for _ in range(6 if wave == 0 else 10**6):
            if not engine.has_unfinished():
                break
            for ch in engine.step():
                done[ch.request_id] = done.get(ch.request_id, 0) + len(ch.token_ids)
    assert done == {f"w{w}-{i}": 48 for w in range(2) for i in range(20)}
    assert any(seqs > 1 and tokens > seqs for seqs, tokens in forwards), forwards  # a mixed prefill + decode step
    assert any(seqs > 16 and tokens == seqs for seqs, tokens in forwards), forwards  # a decode step past 16
    assert core.allocator.num_free == core.allocator.num_blocks
