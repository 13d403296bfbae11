"""On an NVIDIA GPU: the prefill kernels and the batched standard lane (issue 18), on fresh random inputs.

Run through the device: ``python -m pytest tests/gpu/test_prefill_gpu.py -q -o addopts=""``. The Triton prefill
attention and the grouped MXFP4 MoE GEMMs in bf16 against the torch references in fp32, the tensor step
metadata against the list path, and greedy tokens of a small random GPT-OSS (fp32) identical between the
persistent lane and the standard lane (20 prompts x 128 tokens, all at once on the standard lane: decode
graphs past 16 sequences) and between the standard lane at concurrency 64 and the same requests alone.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


DEVICE, DTYPE = "cuda", torch.bfloat16
HEADS = (64, 8, 64)  # gpt-oss: query heads, KV heads, head_dim
ATTENTION_CASES = (
    ("whole prompt 777", [777], [777], None),
    ("whole prompt 777, window 128", [777], [777], 128),
    ("ragged: chunk 300 after 700, 2 decodes, prompt 513, chunk 64 after 1000", [300, 1, 1, 513, 64],
     [1000, 1500, 40, 513, 1064], None),
    ("same, window 128", [300, 1, 1, 513, 64], [1000, 1500, 40, 513, 1064], 128),
)
TOL = 2e-2  # bf16 operands against an fp32 reference


@pytest.mark.parametrize("name,q_lens,ctx_lens,window", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_prefill_attention_bf16_matches_reference(name, q_lens, ctx_lens, window):
    """The dispatching ``paged_attention`` (Triton on CUDA, bf16) against the torch reference in fp32 on the
    same values, sinks on."""
    from ops.tools.fixtures import attention_batch, rel_err
    from replicas.kernels.paged_attention import paged_attention, paged_attention_reference

    seed = [c[0] for c in ATTENTION_CASES].index(name)
    q, kp, vp, meta = attention_batch(q_lens, ctx_lens, HEADS, DTYPE, DEVICE, seed)
    sinks = torch.randn(HEADS[0], generator=torch.Generator(device=DEVICE).manual_seed(seed),
                        device=DEVICE).to(DTYPE)
    got = paged_attention(q, kp, vp, meta, 0.125, sinks=sinks, sliding_window=window)
    want = paged_attention_reference(q.float(), kp.float(), vp.float(), meta, 0.125, sinks=sinks.float(),
                                     sliding_window=window)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize("tokens", [1, 17, 300, 2000])
def test_grouped_moe_bf16_matches_reference_in_both_layouts(tokens):
    """The grouped MoE GEMMs (bf16, checkpoint and decode layouts) against the dequantize-then-GEMM reference
    in fp32: 32 experts of gpt-oss-120b's widths, top 4."""
    from ops.tools.fixtures import fp32_copy, random_experts, rel_err, repacked_copy
    from replicas.kernels.moe import moe_reference
    from replicas.kernels.moe.grouped_gemm import experts_moe

    e, hidden, inter, k = 32, 2880, 2880, 4
    experts = random_experts(e, hidden, inter, DTYPE, 1, DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g, device=DEVICE).to(DTYPE)
    top, ids = torch.topk(torch.randn(tokens, e, generator=g, device=DEVICE), k, dim=-1)
    weights = torch.softmax(top, -1).to(DTYPE)
    want = moe_reference(x.float(), weights.float(), ids, fp32_copy(experts))
    for layout in (experts, repacked_copy(experts)):
        assert rel_err(experts_moe(x, weights, ids, layout), want) < TOL


def test_step_metadata_tensor_path_equals_list_path_on_the_gpu():
    from replicas.kv_cache import PageAllocator
    from replicas.model_runner import build_metadata
    from replicas.request import Request, SamplingParams
    from replicas.step_inputs import StepInputs

    alloc = PageAllocator(400)
    g = torch.Generator().manual_seed(0)
    reqs = [Request(f"r{i}", torch.randint(0, 999, (n,), generator=g).tolist(), SamplingParams())
            for i, n in enumerate((300, 17, 1000))]
    for r in reqs:
        alloc.grow(r.block_table, r.num_prompt_tokens)
    reqs[2].num_computed_tokens = 640
    batch = [(reqs[0], 300), (reqs[1], 17), (reqs[2], 360)]
    ids_t, meta_t = StepInputs(DEVICE, max_blocks=128).build(batch)
    ids_l, meta_l = build_metadata(batch, DEVICE)
    assert torch.equal(ids_t.long(), ids_l) and torch.equal(meta_t.positions, meta_l.positions)
    assert torch.equal(meta_t.slot_mapping, meta_l.slot_mapping)
    assert torch.equal(meta_t.last_token_indices.cpu(), meta_l.last_token_indices)


def test_lanes_agree_and_concurrency_64_matches_one_at_a_time():
    """fp32 (without ``batch_invariant``): logits spread 20x, batch-one and grouped kernels sum in different
    orders, so ties are rare; ``test_exactness_gpu.py`` asserts exact agreement in bf16 with it on."""
    from tests.gpu.conftest import dummy_core, persistent_tokens, prompts_for, standard_tokens

    core = dummy_core("small-gpt-oss", torch.float32, 512, max_num_seqs=256, num_kv_blocks=64 * 32 + 64)
    core.model.lm_head.weight.data.mul_(20)
    prompts = prompts_for(core, 64)
    together = standard_tokens(core, prompts[:20])
    assert persistent_tokens(core, prompts[:20]) == together
    assert any(b > 16 for b in core.runner.graphs._graphs)  # grouped MoE inside a graph
    many = standard_tokens(core, prompts, tokens=64)
    alone = [standard_tokens(core, [p], tokens=64)[0] for p in prompts]
    assert sum(a == b for a, b in zip(many, alone, strict=True)) >= 60


def test_standard_lane_steps_do_not_synchronize_the_host_inside_the_forward():
    """Issue 18's step without host synchronization: a small random GPT-OSS (bf16, prefill kernels, decode
    graphs) serves 40 requests arriving in two waves with a 256-token step budget, so chunked prefills mix
    with decodes and decode batches pass 16 sequences. Every forward runs under torch's sync debug mode set to
    ``error``: a ``.item()``, a device-to-host copy or a stream synchronization inside it raises. The one
    read per step that must wait, the sampled tokens (:func:`replicas.sampler.sample_rows`), is outside."""
    from ops.tools.fixtures import SMALL_GPT_OSS
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


def test_blocking_sync_sleeps_through_the_forward_and_gives_the_same_tokens():
    """``EngineConfig.blocking_sync``: the standard engine waits on a blocking CUDA event after each forward
    (its thread sleeps instead of spinning in the token read); the tokens are those of the default wait."""
    from replicas.engine import LLMEngine
    from tests.gpu.conftest import dummy_core, prompts_for, standard_tokens

    spin = dummy_core("small-gpt-oss", torch.float32, 512, max_num_seqs=64, num_kv_blocks=8 * 32 + 64)
    block = dummy_core("small-gpt-oss", torch.float32, 512, max_num_seqs=64, num_kv_blocks=8 * 32 + 64,
                       blocking_sync=True)
    block.model.load_state_dict(spin.model.state_dict())  # the same random weights
    assert LLMEngine(block).blocking_sync and not LLMEngine(spin).blocking_sync
    prompts = prompts_for(spin, 8)
    assert standard_tokens(block, prompts, tokens=32) == standard_tokens(spin, prompts, tokens=32)
