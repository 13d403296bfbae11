"""Random inputs and runs the GPU tests and the benchmarks share: packed MXFP4 experts, paged attention batches,
a small GPT-OSS shape, random prompts and their greedy tokens on each lane. Nothing here is used while serving.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

SMALL_GPT_OSS = {
    "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": 16, "vocab_size": 4096,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "pad_token_id": 0, "eos_token_id": 1,
}
"""``config.json`` fields over gpt-oss-20b's (``ops.tools.make_tiny_gpt_oss.real_config("20b")``): a small
GPT-OSS with sinks, a 128-token window on every other layer and 16 experts, for whole-engine checks."""


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` in fp32."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def random_experts(e: int, hidden: int, inter: int, dtype: torch.dtype, seed: int, device: str | torch.device):
    """``E`` random packed MXFP4 experts with GPT-OSS's buffer names (uint8 ``*_blocks`` ``[E, rows, cols/32,
    16]`` and ``*_scales`` ``[E, rows, cols/32]`` with codes 118..123, i.e. scales 2**-9..2**-4 as trained
    experts; biases ``0.1 * N(0, 1)`` in ``dtype``; ``alpha`` 1.702, ``limit`` 7.0)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def packed(rows, cols):
        b = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8, device=device)
        s = torch.randint(118, 124, (e, rows, cols // 32), generator=g, dtype=torch.uint8, device=device)
        return b, s

    gub, gus = packed(2 * inter, hidden)
    db, ds = packed(hidden, inter)
    return SimpleNamespace(
        gate_up_proj_blocks=gub, gate_up_proj_scales=gus, down_proj_blocks=db, down_proj_scales=ds,
        gate_up_proj_bias=(0.1 * torch.randn(e, 2 * inter, generator=g, device=device)).to(dtype),
        down_proj_bias=(0.1 * torch.randn(e, hidden, generator=g, device=device)).to(dtype),
        alpha=1.702, limit=7.0, decode_layout=False)


def repacked_copy(experts):
    """A copy of ``experts`` with the blocks in the decode layout (what the model holds on Hopper)."""
    from replicas.kernels.moe.decode_layout import repack_

    out = SimpleNamespace(**vars(experts))
    out.gate_up_proj_blocks = repack_(experts.gate_up_proj_blocks.clone())
    out.down_proj_blocks = repack_(experts.down_proj_blocks.clone())
    out.decode_layout = True
    return out


def fp32_copy(experts):
    """A copy of ``experts`` with every floating tensor in fp32 (the reference's inputs)."""
    return SimpleNamespace(**{k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                              for k, v in vars(experts).items()})


def attention_batch(q_lens: list[int], ctx_lens: list[int], heads: tuple[int, int, int], dtype: torch.dtype,
                    device: str | torch.device, seed: int = 0):
    """Random queries ``[sum(q_lens), H, D]`` and cache planes ``[blocks, 16, KVH, D]`` in ``dtype`` (``heads``
    = ``(H, KVH, D)``), and the batch's :class:`~replicas.kernels.paged_attention.AttentionMetadata`: sequence
    ``i`` has ``q_lens[i]`` new tokens ending at context ``ctx_lens[i]``, its pages shuffled."""
    from replicas.kernels.paged_attention import AttentionMetadata

    num_heads, kv_heads, head_dim = heads
    g = torch.Generator(device=device).manual_seed(seed)
    pages = [-(-c // 16) for c in ctx_lens]
    blocks = sum(pages) + 4
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g, device=device).to(dtype)
    kp = torch.randn(blocks, 16, kv_heads, head_dim, generator=g, device=device).to(dtype)
    vp = torch.randn(blocks, 16, kv_heads, head_dim, generator=g, device=device).to(dtype)
    perm = torch.randperm(blocks, generator=g, device=device)
    tables, used = [], 0
    for n in pages:
        tables.append(perm[used:used + n])
        used += n
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    positions = torch.cat([torch.arange(c - n, c, device=device) for n, c in zip(q_lens, ctx_lens, strict=True)])
    meta = AttentionMetadata(positions=positions, slot_mapping=positions, query_start=starts,
                             context_lens=list(ctx_lens), block_tables=tables)
    return q, kp, vp, meta


def random_prompts(vocab: int, n: int, seed: int = 7) -> list[list[int]]:
    """``n`` prompts of 20..299 random token ids in ``[3, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in torch.randint(20, 300, (n,), generator=g)]


def standard_greedy(core, prompts: list[list[int]], tokens: int = 128, budget: int = 4096) -> list[list[int]]:
    """Greedy tokens (``ignore_eos``) of ``prompts`` all added at once to one standard-lane engine over ``core``
    (chunked prefill under ``budget`` tokens per step, mixed with decodes).

    Raises:
        AssertionError: a KV page was not returned."""
    from replicas.engine import LLMEngine
    from replicas.request import SamplingParams
    from replicas.scheduler import SchedulerConfig

    engine = LLMEngine(core, SchedulerConfig(256, budget, True))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    out: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for ch in engine.step():
            out[ch.request_id] += ch.token_ids
    assert core.allocator.num_used == 0, "KV pages not returned"
    return [out[f"s{i}"] for i in range(len(prompts))]


def persistent_greedy(core, prompts: list[list[int]], tokens: int = 128) -> list[list[int]]:
    """Greedy tokens (``ignore_eos``) of ``prompts`` one at a time on the persistent lane: the ``cuda_graph``
    backend on a GPU, ``eager`` elsewhere.

    Raises:
        AssertionError: a KV page was not returned."""
    from replicas.messages import GenerateRequest
    from replicas.persistent.lane import PersistentLane
    from replicas.request import SamplingParams

    device = torch.device(core.config.resolved_device())
    if device.type == "cuda":
        from replicas.persistent.cuda_graph import CudaGraphBackend

        backend = CudaGraphBackend(core.model, device, core.config.max_model_len)
    else:
        from replicas.persistent.eager import EagerBackend

        backend = EagerBackend(core.model, device)
    lane = PersistentLane(core, backend)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    out = [[t for ch in lane.generate(GenerateRequest(f"p{i}", p, params)) for t in ch.token_ids]
           for i, p in enumerate(prompts)]
    assert core.allocator.num_used == 0, "KV pages not returned"
    return out
