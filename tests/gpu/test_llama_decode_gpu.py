"""On an NVIDIA GPU: the Llama decode step (``LlamaForCausalLM.decode_static``) in bf16 at batch one, where
it runs the Triton GEMVs (the gate_up one with the SwiGLU in its epilogue) and the fused add + RMSNorm,
against the same weights in fp32 (where the GEMVs are torch's), and the persistent lane against the standard
lane in bf16 (both decode through ``decode_static`` at batch one: identical tokens)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.gpu.conftest import dummy_core

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_gemv_swiglu_epilogue_bf16():
    from replicas.kernels.decode_ops import DecodeOps
    from replicas.kernels.triton_gemv import triton_gemv

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, 576, generator=g, device="cuda").bfloat16()
    w = (torch.randn(2 * 1536, 576, generator=g, device="cuda") / 24).bfloat16()
    gate, up = torch.nn.functional.linear(x.float(), w.float()).chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    ours = triton_gemv(x, w, swiglu=True)
    assert ours.dtype == torch.bfloat16 and ours.shape == (1, 1536) and ref.abs().max() > 0.5
    torch.testing.assert_close(ours.float(), ref, rtol=2 ** -7, atol=1e-3)
    ops = DecodeOps.build("cuda", torch.bfloat16)
    assert ops.triton and torch.equal(ops.swiglu_linear(x, w), ours)  # the dispatcher takes this kernel at batch one


def test_llama_bf16_decode_steps_follow_the_fp32_model():
    from replicas.kernels.paged_attention import PAGE_SIZE

    model = dummy_core("smollm2-135m", torch.bfloat16, max_model_len=256).model
    model.lm_head.weight.data.mul_(20)  # wide argmax margins
    ref = copy.deepcopy(model).float()
    cfg = model.config
    blocks = 8

    def planes(dtype):
        return [tuple(torch.zeros(blocks, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim, device="cuda", dtype=dtype)
                      for _ in range(2)) for _ in range(cfg.num_layers)]

    kv16, kv32 = planes(torch.bfloat16), planes(torch.float32)
    table = torch.randperm(blocks, device="cuda").view(1, -1)
    tokens = torch.randint(3, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).cuda()
    agree = 0
    with torch.inference_mode():
        for pos in range(tokens.numel()):
            args = (tokens[pos:pos + 1], torch.tensor([pos], device="cuda"), table)
            ours = model.decode_static(*args, kv16)
            want = ref.decode_static(*args, kv32)
            assert ((ours - want).abs().max() / want.abs().max()).item() < 5e-2, pos
            agree += int(ours.argmax() == want.argmax())
    assert agree >= 38, f"{agree}/40 greedy picks agree"


def test_smollm2_shape_bf16_lanes_agree_at_batch_one():
    from tests.gpu.test_cuda_graph_lane import _lanes_agree

    core = dummy_core("smollm2-135m", torch.bfloat16, max_model_len=512)
    core.model.lm_head.weight.data.mul_(20)
    _lanes_agree(core, 49152, prompts_n=6, tokens=64, max_num_seqs=1)
