"""On an NVIDIA GPU: the MoE-path Triton kernels at gpt-oss-120b's dimensions against fp32 references.

Fresh random inputs (never zeros): packed MXFP4 experts with random bytes and
scales, random activations, routing and biases. fp32 runs must match the fp32
reference to ~1e-5; bf16 runs to bf16's expectations (~1%).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

HIDDEN, INTER, EXPERTS = 2880, 2880, 8  # 120b's hidden and expert width; fewer experts to save memory


class Experts:
    def __init__(self, dtype, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        dev = "cuda"

        def packed(rows, cols):
            b = torch.randint(0, 256, (EXPERTS, rows, cols // 32, 16), generator=g, dtype=torch.uint8, device=dev)
            s = torch.randint(118, 124, (EXPERTS, rows, cols // 32), generator=g, dtype=torch.uint8, device=dev)
            return b, s

        self.gate_up_proj_blocks, self.gate_up_proj_scales = packed(2 * INTER, HIDDEN)
        self.down_proj_blocks, self.down_proj_scales = packed(HIDDEN, INTER)
        self.gate_up_proj_bias = (0.1 * torch.randn(EXPERTS, 2 * INTER, generator=g, device=dev)).to(dtype)
        self.down_proj_bias = (0.1 * torch.randn(EXPERTS, HIDDEN, generator=g, device=dev)).to(dtype)
        self.alpha, self.limit = 1.702, 7.0

    def as_fp32(self):
        out = Experts.__new__(Experts)
        out.__dict__.update({k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                             for k, v in self.__dict__.items()})
        return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens", [1, 5])
def test_mxfp4_moe_at_120b_dims(dtype, tol, tokens):
    from replicas.kernels.moe.reference import moe_reference
    from replicas.kernels.moe.triton_portable import triton_moe

    experts = Experts(dtype, seed=tokens)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g, device="cuda")[:4] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, 4, generator=g, device="cuda"), -1).to(dtype)
    res = torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(dtype)
    ours = triton_moe(x, w, ids, experts.gate_up_proj_blocks, experts.gate_up_proj_scales, experts.gate_up_proj_bias,
                      experts.down_proj_blocks, experts.down_proj_scales, experts.down_proj_bias, 1.702, 7.0,
                      residual=res)
    ref = moe_reference(x.float(), w.float(), ids, experts.as_fp32()) + res.float()
    rel = ((ours.float() - ref).abs().max() / ref.abs().max()).item()
    assert ref.abs().max() > 1
    assert rel < tol, rel


def test_router_and_rmsnorm_bf16():
    from replicas.kernels.decode_ops import add_rmsnorm_reference
    from replicas.kernels.reference import router_topk_reference
    from replicas.kernels.triton_rmsnorm import triton_add_rmsnorm
    from replicas.kernels.triton_router import triton_router_topk

    g = torch.Generator(device="cuda").manual_seed(2)
    logits = torch.randn(3, 128, generator=g, device="cuda")
    w, ids = triton_router_topk(logits, 4, torch.bfloat16)
    w_ref, ids_ref = router_topk_reference(logits, 4, torch.bfloat16)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref)
    x = torch.randn(2, HIDDEN, generator=g, device="cuda").bfloat16()
    d = torch.randn(2, HIDDEN, generator=g, device="cuda").bfloat16()
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).bfloat16()
    for fp32_weight in (True, False):
        xn, y = triton_add_rmsnorm(x, d, weight, 1e-5, fp32_weight)
        xr, yr = add_rmsnorm_reference(x, d, weight, 1e-5, fp32_weight)
        torch.testing.assert_close(xn, xr)
        torch.testing.assert_close(y, yr, rtol=2e-2, atol=2e-2)


def test_add_rmsnorm_route_bf16_one_launch_against_three_inside_a_graph():
    """gpt-oss-120b's shape (hidden 2,880, 128 experts), bf16: the fused launch gives the same x, h and MMA
    activations (bit for bit, or a rounding apart) and the same experts as add+RMSNorm, the router GEMV and the top-k launches;
    captured in a CUDA graph and replayed on fresh inputs (the arrival counter resets itself)."""
    from types import SimpleNamespace

    from replicas.kernels.decode_ops import DecodeOps
    from replicas.kernels.triton_rmsnorm import triton_add_rmsnorm
    from replicas.kernels.triton_router import triton_router_topk

    g = torch.Generator(device="cuda").manual_seed(12)
    norm = SimpleNamespace(weight=(1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).bfloat16(), eps=1e-5)
    e = 128  # gpt-oss-120b's expert count
    router = SimpleNamespace(weight=(0.05 * torch.randn(e, HIDDEN, generator=g, device="cuda")).bfloat16(),
                             bias=(0.1 * torch.randn(e, generator=g, device="cuda")).bfloat16(), top_k=4)
    res = torch.zeros(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    delta = torch.zeros_like(res)
    ws: dict = {}
    ops = DecodeOps.build("cuda", torch.bfloat16, moe_backend="auto")
    ops.add_rmsnorm_route(res, delta, norm, router, mxfp4_out=True, workspace=ws)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = ops.add_rmsnorm_route(res, delta, norm, router, mxfp4_out=True, workspace=ws)
    for _ in range(4):
        res.copy_(torch.randn(1, HIDDEN, generator=g, device="cuda"))
        delta.copy_(torch.randn(1, HIDDEN, generator=g, device="cuda"))
        graph.replay()
        x, h, h_mx, w, ids = (t.clone() for t in outs)
        x_ref, h_ref, h_mx_ref = triton_add_rmsnorm(res, delta, norm.weight, norm.eps, True, mxfp4_out=True)
        w_ref, ids_ref = triton_router_topk(ops.linear(h_ref, router.weight, router.bias), 4, torch.bfloat16)
        assert torch.equal(x, x_ref)
        # the norm's fp32 sum of squares is reduced over another warp count: at most a rounding apart
        for ours, ref in ((h, h_ref), (h_mx, h_mx_ref)):
            assert (ours != ref).sum() <= 16
            torch.testing.assert_close(ours, ref, rtol=8e-3, atol=0)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=1e-2, atol=1e-2)
        assert ws["route_counter"].item() == 0


@pytest.mark.parametrize("block_j,block_r,blocks_per_step,warps", [(2, 4, 32, 1), (4, 8, 16, 2), (1, 2, 32, 4),
                                                                    (4, 8, 16, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5])
def test_simt_fp32_mxfp4_moe_at_120b_dims(dtype, tokens, block_j, block_r, blocks_per_step, warps):
    """The SIMT kernels sum exact fp32 products: within fp32 summation order of the fp32 reference for
    either activation dtype, and bit-identical between the inline-PTX and the plain-Triton E2M1 decoding."""
    from replicas.kernels.moe.reference import moe_reference
    from replicas.kernels.moe.triton_fp32 import triton_moe_gemv

    experts = Experts(dtype, seed=tokens + 30)
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g, device="cuda")[:4] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, 4, generator=g, device="cuda"), -1).to(dtype)
    args = (x, w, ids, experts.gate_up_proj_blocks, experts.gate_up_proj_scales, experts.gate_up_proj_bias,
            experts.down_proj_blocks, experts.down_proj_scales, experts.down_proj_bias, 1.702, 7.0)
    tiles = dict(block_j=block_j, block_r=block_r, blocks_per_step=blocks_per_step, num_warps=warps)
    parts = triton_moe_gemv(*args, **tiles)
    assert parts.shape == (tokens, 4, HIDDEN)
    assert torch.equal(parts, triton_moe_gemv(*args, **tiles, ptx=False))
    ref = moe_reference(x.float(), w.float(), ids, experts.as_fp32())
    assert ref.abs().max() > 1
    rel = ((parts.sum(1) - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-5, rel


def _bf16_activations_reference(x, w, ids, experts):
    """fp32 reference of the tensor-core MMA kernels' arithmetic: exact dequantized weights, activations and
    the SwiGLU output rounded to bf16 (as those kernels feed them to the MMA), fp32 everywhere else."""
    from replicas.kernels.moe.mxfp4 import dequantize_mxfp4
    from replicas.kernels.reference import clamped_swiglu

    t, k = ids.shape
    out = torch.empty(t, k, HIDDEN, device="cuda")
    for i in range(t):
        for j in range(k):
            e = int(ids[i, j])
            w_gu = dequantize_mxfp4(experts.gate_up_proj_blocks[e], experts.gate_up_proj_scales[e], torch.float32)
            w_dn = dequantize_mxfp4(experts.down_proj_blocks[e], experts.down_proj_scales[e], torch.float32)
            y = w_gu @ x[i].bfloat16().float() + experts.gate_up_proj_bias[e].float()
            h = clamped_swiglu(y[None], 1.702, 7.0)[0].bfloat16().float()
            out[i, j] = w[i, j].float() * (w_dn @ h + experts.down_proj_bias[e].float())
    return out


def _bf16_case(tokens: int, expert_seed: int, seed: int):
    """Random bf16 activations, routing and experts; the kernels' positional arguments; the fp32 reference of
    their arithmetic (:func:`_bf16_activations_reference`) and its largest magnitude (checked above 1)."""
    experts = Experts(torch.bfloat16, seed=expert_seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, generator=g, device="cuda")[:4] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, 4, generator=g, device="cuda"), -1).bfloat16()
    args = (x, w, ids, experts.gate_up_proj_blocks, experts.gate_up_proj_scales, experts.gate_up_proj_bias,
            experts.down_proj_blocks, experts.down_proj_scales, experts.down_proj_bias, 1.702, 7.0)
    same_math = _bf16_activations_reference(x, w, ids, experts)
    scale = same_math.abs().max()
    assert scale > 1
    return x, w, ids, experts, args, same_math, scale


@pytest.mark.parametrize("tokens", [1, 5])
def test_mma_ptx_mxfp4_moe_at_120b_dims(tokens):
    """The inline-PTX ``mma.sync`` kernels: every E2M1 code (bf16 subnormals included) and every lane's role in
    the MMA fragments, against the same arithmetic in fp32 (1e-4: only the summation order differs), against
    their plain-Triton path, and within bf16 tolerance of the all-fp32 reference."""
    from replicas.kernels.moe.mma_format import mxfp4_activations
    from replicas.kernels.moe.reference import moe_reference
    from replicas.kernels.moe.triton_tc import triton_moe_tc

    x, w, ids, experts, args, same_math, scale = _bf16_case(tokens, tokens + 40, 6)
    plain = triton_moe_tc(*args, ptx=False, x_mxfp4=mxfp4_activations(x))
    assert ((plain - same_math).abs().max() / scale).item() < 1e-4
    ref = moe_reference(x.float(), w.float(), ids, experts.as_fp32())
    for warps, depth, pairs, down_pairs in ((1, 1, 1, 1), (2, 2, 1, 1), (4, 2, 1, 1), (8, 1, 1, 1), (8, 2, 1, 1),
                                            (4, 1, 2, 2), (4, 2, 2, 1), (2, 1, 1, 2)):
        parts = triton_moe_tc(*args, num_warps=warps, depth=depth, pairs=pairs, down_pairs=down_pairs)
        assert parts.shape == (tokens, 4, HIDDEN)
        assert ((parts - same_math).abs().max() / scale).item() < 1e-4, (warps, depth, pairs, down_pairs)
        assert ((parts.sum(1) - ref).abs().max() / ref.abs().max()).item() < 2e-2


def _ops(backend: str, repack: bool = False):
    """GPU decode ops with the MoE backend ``backend`` (``triton_fp32`` on bf16 activations too: the exact
    kernels, as the cross-check reference)."""
    from replicas.kernels.decode_ops import DecodeOps
    from replicas.kernels.moe import MoE, MoEChoice

    return DecodeOps(triton=True, nvidia=True, pdl=False,
                     moe=MoE(MoEChoice(backend, "prefill_dequantize", repack)))


@pytest.mark.parametrize("backend", ["triton_tc", "hopper_bulk"])
def test_decode_moe_glue_matches_exact_gemv(backend):
    """The decode step's MoE glue on bf16: the post-attention add+RMSNorm writes the tensor-core kernels'
    activation format in the same launch (equal to the torch conversion), and the MoE layer through them
    (Triton or CUDA-source) agrees with the exact fp32 SIMT kernels within bf16 tolerance."""
    from types import SimpleNamespace

    from replicas.kernels.moe.mma_format import mxfp4_activations

    experts = Experts(torch.bfloat16, seed=50)
    g = torch.Generator(device="cuda").manual_seed(7)
    tokens = 3
    res = torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16()
    delta = torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16()
    norm = SimpleNamespace(weight=(1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).bfloat16(), eps=1e-5)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g, device="cuda")[:4] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, 4, generator=g, device="cuda"), -1).bfloat16()
    ops, exact = _ops(backend), _ops("triton_fp32")
    assert ops.takes_mxfp4_activations and not exact.takes_mxfp4_activations
    x, h, h_mx = ops.add_rmsnorm(res, delta, norm, True, mxfp4_out=True)
    assert torch.equal(h_mx, mxfp4_activations(h))
    x_tc, _ = ops.moe_add_rmsnorm(h, w, ids, experts, x, norm, True, x_mxfp4=h_mx)
    x_exact, _ = exact.moe_add_rmsnorm(h, w, ids, experts, x, norm, True)
    moe_tc, moe_exact = x_tc.float() - x.float(), x_exact.float() - x.float()
    assert moe_exact.abs().max() > 1
    assert ((moe_tc - moe_exact).abs().max() / moe_exact.abs().max()).item() < 3e-2


def test_auto_resolves_to_hopper_bulk_on_an_h200_in_bf16_and_to_triton_fp32_in_fp32():
    from replicas.kernels.moe import resolve_moe

    major = torch.cuda.get_device_capability()[0]
    assert resolve_moe("auto", torch.device("cuda"), torch.bfloat16).backend == (
        "hopper_bulk" if major >= 9 else "triton_tc")
    assert resolve_moe("auto", torch.device("cuda"), torch.float16).backend == "triton_tc"
    assert resolve_moe("auto", torch.device("cuda"), torch.float32).backend == "triton_fp32"
    choice = resolve_moe("auto", torch.device("cuda"), torch.bfloat16, repack=True)
    assert choice.repack == (choice.backend == "hopper_bulk") and choice.prefill == "grouped_gemm"
    off = resolve_moe("auto", torch.device("cuda"), torch.bfloat16, prefill_kernels=False)
    assert off.prefill == "prefill_dequantize"


@pytest.mark.parametrize("tokens", [1, 5])
def test_bulk_copy_mxfp4_moe_at_120b_dims(tokens):
    """The CUDA C++ kernels with bulk-copied weights: the tensor-core kernels' arithmetic (same fp32 math
    within summation order) for every tile they take, and bf16 tolerance of the all-fp32 reference."""
    from replicas.kernels.moe.decode_layout import repack_
    from replicas.kernels.moe.hopper_bulk import cuda_moe_bulk
    from replicas.kernels.moe.mma_format import mxfp4_activations
    from replicas.kernels.moe.reference import moe_reference

    x, w, ids, experts, args, same_math, scale = _bf16_case(tokens, tokens + 60, 8)
    ref = moe_reference(x.float(), w.float(), ids, experts.as_fp32())
    for tiles in ((8, 1, 8, 1, 4, 2), (1, 1, 1, 1, 1, 1), (2, 2, 4, 1, 2, 3), (4, 2, 2, 2, 3, 1), (8, 1, 4, 1, 6, 1)):
        warps, pairs, down_warps, down_pairs, stages, per_sm = tiles
        parts = cuda_moe_bulk(*args, x_mxfp4=mxfp4_activations(x), num_warps=warps, pairs=pairs,
                              down_num_warps=down_warps, down_pairs=down_pairs, stages=stages, blocks_per_sm=per_sm)
        assert parts.shape == (tokens, 4, HIDDEN)
        err = ((parts - same_math).abs().max() / scale).item()
        assert err < 1e-4, (tiles, err)
        assert ((parts.sum(1) - ref).abs().max() / ref.abs().max()).item() < 2e-2
    # fp32 routing weights and int32 ids take the same path
    parts = cuda_moe_bulk(x, w.float(), ids.int(), *args[3:])
    assert ((parts - same_math).abs().max() / scale).item() < 1e-4
    # the decode layout: the same blocks repacked give the same sums
    gu, dn = repack_(experts.gate_up_proj_blocks.clone()), repack_(experts.down_proj_blocks.clone())
    packed = (gu, *args[4:6], dn, *args[7:])
    parts = cuda_moe_bulk(*args[:3], *packed, x_mxfp4=mxfp4_activations(x), repacked=True)
    assert ((parts - same_math).abs().max() / scale).item() < 1e-4
    parts = cuda_moe_bulk(*args[:3], *packed, repacked=True, num_warps=8, down_num_warps=8, stages=2, blocks_per_sm=2)
    assert ((parts - same_math).abs().max() / scale).item() < 1e-4


def test_bulk_copy_moe_in_a_cuda_graph_with_small_widths():
    """Captured in a CUDA graph and replayed on new inputs (the persistent lane's use), at small widths
    (hidden 96, expert width 64: 3 and 2 blocks per row, so lanes step past a row's end)."""
    from replicas.kernels.moe.hopper_bulk import cuda_moe_bulk
    from replicas.kernels.moe.reference import moe_reference

    e, hidden, inter = 6, 96, 64
    ex = _small_experts(e, hidden, inter, seed=8)
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(2, hidden, generator=g, device="cuda").bfloat16()
    ids = torch.tensor([[0, 3], [5, 1]], device="cuda")
    w = torch.softmax(torch.randn(2, 2, generator=g, device="cuda"), -1).bfloat16()
    packed = (ex.gate_up_proj_blocks, ex.gate_up_proj_scales, ex.gate_up_proj_bias, ex.down_proj_blocks,
              ex.down_proj_scales, ex.down_proj_bias, 1.702, 7.0)
    cuda_moe_bulk(x, w, ids, *packed, down_pairs=2, blocks_per_sm=1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_moe_bulk(x, w, ids, *packed, down_pairs=2, blocks_per_sm=1)
    for trial in range(3):
        x.copy_(torch.randn(2, hidden, generator=g, device="cuda"))
        ids.copy_(torch.stack([torch.randperm(e, generator=g, device="cuda")[:2] for _ in range(2)]))
        graph.replay()
        ref = moe_reference(x.float(), w.float(), ids, ex.as_fp32())
        assert ref.abs().max() > 0.5
        rel = ((out.sum(1) - ref).abs().max() / ref.abs().max()).item()
        assert rel < 2e-2, (trial, rel)


def test_repacked_experts_through_every_moe_path():
    """Experts repacked at load (:meth:`MoE.prepare` of a ``hopper_bulk`` choice with ``moe_repack``): the
    decode glue runs the bulk kernels on the decode layout and agrees with the exact SIMT kernels on the
    checkpoint layout; the prefill path (which dequantizes) gives exactly what it gave before repacking."""
    from types import SimpleNamespace

    experts = Experts(torch.bfloat16, seed=70)
    original = experts.gate_up_proj_blocks.clone(), experts.down_proj_blocks.clone()
    g = torch.Generator(device="cuda").manual_seed(9)
    res = torch.randn(3, HIDDEN, generator=g, device="cuda").bfloat16()
    delta = torch.randn(3, HIDDEN, generator=g, device="cuda").bfloat16()
    norm = SimpleNamespace(weight=(1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).bfloat16(), eps=1e-5)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g, device="cuda")[:4] for _ in range(3)])
    w = torch.softmax(torch.randn(3, 4, generator=g, device="cuda"), -1).bfloat16()
    x20 = torch.randn(20, HIDDEN, generator=g, device="cuda").bfloat16()
    ids20 = torch.stack([torch.randperm(EXPERTS, generator=g, device="cuda")[:4] for _ in range(20)])
    w20 = torch.softmax(torch.randn(20, 4, generator=g, device="cuda"), -1).bfloat16()
    exact = _ops("triton_fp32")
    x, h, _ = exact.add_rmsnorm(res, delta, norm, True, mxfp4_out=True)
    x_exact, _ = exact.moe_add_rmsnorm(h, w, ids, experts, x, norm, True)
    prefill = exact.moe(x20, w20, ids20, experts)

    assert not _ops("hopper_bulk", repack=False).moe.prepare(experts)  # moe_repack=false
    bulk = _ops("hopper_bulk", repack=True)
    assert bulk.moe.prepare(experts) and experts.decode_layout
    assert not torch.equal(experts.gate_up_proj_blocks, original[0])
    assert not bulk.moe.prepare(experts)  # once
    x, h, h_mx = bulk.add_rmsnorm(res, delta, norm, True, mxfp4_out=True)
    x_bulk, _ = bulk.moe_add_rmsnorm(h, w, ids, experts, x, norm, True, x_mxfp4=h_mx)
    moe_bulk, moe_exact = x_bulk.float() - x.float(), x_exact.float() - x.float()
    assert moe_exact.abs().max() > 1
    assert ((moe_bulk - moe_exact).abs().max() / moe_exact.abs().max()).item() < 3e-2
    assert torch.equal(bulk.moe(x20, w20, ids20, experts), prefill)


def test_gpt_oss_load_resolves_and_records_its_kernels():
    """A dummy GPT-OSS engine on the GPU resolves its kernels once at load and says which ran."""
    from tests.gpu.conftest import dummy_core

    core = dummy_core("tiny-gpt-oss", torch.bfloat16, max_model_len=256)
    kernels = core.describe_kernels()
    assert kernels["decode_kernels"] == "triton" and kernels["moe_prefill"] == "grouped_gemm"
    assert kernels["moe_backend"] in ("hopper_bulk", "triton_tc") and kernels["decode_graphs"]
    core = dummy_core("tiny-gpt-oss", torch.bfloat16, max_model_len=256, moe_backend="triton_tc", pdl=False)
    assert core.describe_kernels()["moe_backend"] == "triton_tc" and core.describe_kernels()["pdl"] is False


GROUPED_TILES = ({}, {"tokens_per_chunk": 16}, {"pairs": 2}, {"down_pairs": 2, "tokens_per_chunk": 16},
                 {"pairs": 2, "down_pairs": 1, "blocks_per_sm": 2}, {"blocks_per_sm": 16})
"""Tiles of the grouped kernel that each test runs: none of them may change a row's bits."""

ROW_EXACT = {"fold_scales": True}
"""The one-pair kernel's row-exact (folded) family, whose rows the grouped kernel reproduces."""


def _random_routing(tokens: int, experts: int, hidden: int, seed: int, top_k: int = 4):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=g, device="cuda")[:top_k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, top_k, generator=g, device="cuda"), -1).bfloat16()
    return x, w, ids


@pytest.mark.parametrize("repacked", [False, True])
def test_grouped_bulk_rows_are_the_one_pair_kernels_bits(repacked):
    """Row-exactness of the grouped decode kernel: at M = 1 ... 256 tokens, with random company (a random
    subset of a pool, so a token's neighbours, their number and the tokens per expert all change), every
    (token, expert) row is bitwise the folded one-pair kernel's for that token alone, for every tile setting;
    the folded sums are the fp32 reference's to bf16 accuracy, as the block-scaled ones are."""
    from replicas.kernels.moe.decode_layout import repack_
    from replicas.kernels.moe.hopper_bulk import cuda_moe_bulk
    from replicas.kernels.moe.hopper_grouped import cuda_moe_grouped
    from replicas.kernels.moe.reference import moe_reference

    experts = Experts(torch.bfloat16, seed=71)
    packed = [experts.gate_up_proj_blocks, experts.gate_up_proj_scales, experts.gate_up_proj_bias,
              experts.down_proj_blocks, experts.down_proj_scales, experts.down_proj_bias, 1.702, 7.0]
    if repacked:
        packed[0], packed[3] = repack_(packed[0].clone()), repack_(packed[3].clone())
    x, w, ids = _random_routing(256, EXPERTS, HIDDEN, seed=12)
    alone = torch.cat([cuda_moe_bulk(x[i:i + 1], w[i:i + 1], ids[i:i + 1], *packed, repacked=repacked,
                                     **ROW_EXACT) for i in range(256)])
    assert alone.abs().max() > 1
    ref = moe_reference(x[:32].float(), w[:32].float(), ids[:32], experts.as_fp32())
    block_scaled = cuda_moe_bulk(x[:32], w[:32], ids[:32], *packed, repacked=repacked)
    for out in (alone[:32], block_scaled):
        assert ((out.sum(1) - ref).abs().max() / ref.abs().max()).item() < 2e-2
    g = torch.Generator(device="cuda").manual_seed(13)
    for m in (1, 2, 3, 7, 16, 17, 64, 100, 256):
        rows = torch.randperm(256, generator=g, device="cuda")[:m]
        for tiles in GROUPED_TILES:
            out = cuda_moe_grouped(x[rows], w[rows], ids[rows], *packed, repacked=repacked, **tiles)
            assert torch.equal(out, alone[rows]), (m, tiles, (out - alone[rows]).abs().max().item())
    # other warps per block: both kernels take them, and the rows stay equal
    for warps, down_warps in ((8, 2), (2, 8)):
        one = torch.cat([cuda_moe_bulk(x[i:i + 1], w[i:i + 1], ids[i:i + 1], *packed, repacked=repacked,
                                       num_warps=warps, down_num_warps=down_warps, **ROW_EXACT) for i in range(40)])
        out = cuda_moe_grouped(x[:40], w[:40], ids[:40], *packed, repacked=repacked, num_warps=warps,
                               down_num_warps=down_warps)
        assert torch.equal(out, one), (warps, down_warps)


def _small_experts(e: int, hidden: int, inter: int, seed: int):
    """``e`` random packed bf16 experts of widths ``hidden`` / ``inter`` (:class:`Experts`' fields)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ex = Experts.__new__(Experts)
    ex.gate_up_proj_blocks = torch.randint(0, 256, (e, 2 * inter, hidden // 32, 16), generator=g, device="cuda",
                                           dtype=torch.uint8)
    ex.gate_up_proj_scales = torch.randint(118, 124, (e, 2 * inter, hidden // 32), generator=g, device="cuda",
                                           dtype=torch.uint8)
    ex.down_proj_blocks = torch.randint(0, 256, (e, hidden, inter // 32, 16), generator=g, device="cuda",
                                        dtype=torch.uint8)
    ex.down_proj_scales = torch.randint(118, 124, (e, hidden, inter // 32), generator=g, device="cuda",
                                        dtype=torch.uint8)
    ex.gate_up_proj_bias = (0.1 * torch.randn(e, 2 * inter, generator=g, device="cuda")).bfloat16()
    ex.down_proj_bias = (0.1 * torch.randn(e, hidden, generator=g, device="cuda")).bfloat16()
    ex.alpha, ex.limit = 1.702, 7.0
    return ex


def test_grouped_bulk_with_many_experts_small_widths_and_in_a_cuda_graph():
    """200 experts (the per-block scan over the experts takes several passes), widths 96 and 64 (lanes
    step past a row's end), fp32 routing weights; captured in a CUDA graph at 40 tokens and replayed on new
    tokens and routing: every row bitwise the one-pair kernel's alone, against the fp32 reference too."""
    from replicas.kernels.moe.hopper_bulk import cuda_moe_bulk
    from replicas.kernels.moe.hopper_grouped import cuda_moe_grouped
    from replicas.kernels.moe.reference import moe_reference

    e, hidden, inter = 200, 96, 64
    ex = _small_experts(e, hidden, inter, seed=14)
    packed = (ex.gate_up_proj_blocks, ex.gate_up_proj_scales, ex.gate_up_proj_bias, ex.down_proj_blocks,
              ex.down_proj_scales, ex.down_proj_bias, 1.702, 7.0)
    x, w, ids = _random_routing(256, e, hidden, seed=15)
    w = w.float()
    out = cuda_moe_grouped(x, w, ids, *packed)
    alone = torch.cat([cuda_moe_bulk(x[i:i + 1], w[i:i + 1], ids[i:i + 1], *packed, **ROW_EXACT)
                       for i in range(256)])
    assert torch.equal(out, alone)
    ref = moe_reference(x.float(), w, ids, ex.as_fp32())
    assert ((out.sum(1) - ref).abs().max() / ref.abs().max()).item() < 2e-2
    xs, ws, idss = x[:40].clone(), w[:40].clone(), ids[:40].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cuda_moe_grouped(xs, ws, idss, *packed, tokens_per_chunk=16)
    for trial in range(3):
        nx, nw, nids = _random_routing(40, e, hidden, seed=20 + trial)
        xs.copy_(nx)
        ws.copy_(nw.float())
        idss.copy_(nids)
        graph.replay()
        one = torch.cat([cuda_moe_bulk(xs[i:i + 1], ws[i:i + 1], idss[i:i + 1], *packed, **ROW_EXACT)
                         for i in range(40)])
        assert torch.equal(captured, one), trial


def test_moe_routes_rows_to_the_grouped_kernel_and_row_exact_rows_to_one_family():
    """:class:`MoE` with ``hopper_bulk``: calls of at most 16 tokens run the block-scaled one-pair kernel,
    17 to ``GROUPED_DECODE_MAX_TOKENS`` (decode rows or prompt tokens) the grouped kernel, more the grouped
    GEMMs; the row-exact path gives every decode row the folded one-pair kernel's bits at 1, 16, 17, 256 and
    300 rows (slices of 256)."""
    from replicas.kernels.moe import GROUPED_DECODE_MAX_TOKENS, MoE, MoEChoice
    from replicas.kernels.moe.grouped_gemm import experts_partials
    from replicas.kernels.moe.hopper_bulk import cuda_moe_bulk
    from replicas.kernels.moe.mma_format import mxfp4_activations

    experts = Experts(torch.bfloat16, seed=72)
    moe = MoE(MoEChoice("hopper_bulk", "grouped_gemm", False), pdl=False)
    assert moe.row_exact_decode and moe.kernel_max_tokens == GROUPED_DECODE_MAX_TOKENS
    x, w, ids = _random_routing(300, EXPERTS, HIDDEN, seed=16)
    packed = (experts.gate_up_proj_blocks, experts.gate_up_proj_scales, experts.gate_up_proj_bias,
              experts.down_proj_blocks, experts.down_proj_scales, experts.down_proj_bias, 1.702, 7.0)
    alone = torch.cat([cuda_moe_bulk(x[i:i + 1], w[i:i + 1], ids[i:i + 1], *packed, pdl=False, **ROW_EXACT)
                       for i in range(300)])
    for m in (1, 16, 17, 256, 300):
        parts = moe.row_exact_partials(x[:m], w[:m], ids[:m], experts, prefill=False,
                                       x_mxfp4=mxfp4_activations(x[:m]))
        assert torch.equal(parts, alone[:m]), m
    assert torch.equal(moe.partials(x[:16], w[:16], ids[:16], experts),
                       cuda_moe_bulk(x[:16], w[:16], ids[:16], *packed, pdl=False))
    m = GROUPED_DECODE_MAX_TOKENS  # decode rows and prompt tokens alike
    assert torch.equal(moe.partials(x[:m], w[:m], ids[:m], experts), alone[:m])
    n = m + 1  # the grouped GEMMs above
    assert torch.equal(moe.partials(x[:n], w[:n], ids[:n], experts), experts_partials(x[:n], w[:n], ids[:n], experts))
