"""Greedy output depends on the prompt alone, in bf16 on the GPU, with ``batch_invariant`` on
(``docs/exactness.md``): exact equality, never tolerances.

A small random GPT-OSS (sinks, a sliding window, 16 experts) and the 20b shape with 4 layers: the persistent
lane's tokens equal the standard lane's, the standard lane's tokens at concurrency 64 equal the same requests
one at a time, a prompt prefilled in chunks of three sizes leaves the same KV and logits as prefilled whole,
and a prefix-cache hit the same as a cold prefill; binding a ``cuda_graph`` backend leaves the cache as it
was. The grouped MoE GEMMs at a fixed height and the decode attention at a fixed split count are row-exact
at every row count."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.gpu.conftest import dummy_core, persistent_tokens, prompts_for, standard_tokens  # noqa: E402

ROWS = (1, 2, 3, 7, 16, 17, 64, 100, 256)


@pytest.fixture(scope="module", params=["small-gpt-oss", "gpt-oss-20b-4-layers"])
def core(request):
    c = dummy_core(request.param, torch.bfloat16, 512, batch_invariant=True, max_num_seqs=256,
                   num_kv_blocks=64 * 32 + 64, enable_prefix_caching=True)
    c.model.lm_head.weight.data.mul_(20)  # random logits spread out: ties would hide nothing, but be rare
    assert c.model.ops.batch_invariant
    yield c
    del c
    torch.cuda.empty_cache()


def test_persistent_lane_equals_standard_lane(core):
    """20 prompts x 128 tokens: the standard lane (all at once: batched prefill, mixed steps, decode graphs of
    20) against the persistent lane's ``cuda_graph`` quanta, one request at a time. Prefix caching is on, so
    the persistent requests also reuse the standard lane's cached prompt pages: a prefix-cache hit == cold."""
    prompts = prompts_for(core, 20)
    together = standard_tokens(core, prompts)
    persistent = persistent_tokens(core, prompts)
    same = sum(a == b for a, b in zip(persistent, together, strict=True))
    assert same == len(prompts), f"persistent == standard for {same}/{len(prompts)}"


def test_binding_a_cuda_graph_backend_changes_no_byte_of_the_cache(core):
    """The backend's warm-up decodes through page 0 (docs/exactness.md, "Binding a persistent backend"); bound
    to a cache whose page 0 holds data (a prefix-cached prompt, as in the test above), it leaves every byte."""
    from replicas.persistent.contract import CacheBinding
    from replicas.persistent.cuda_graph import CudaGraphBackend

    g = torch.Generator(device="cuda").manual_seed(5)
    for k, v in core.kv_cache.planes():
        k[0].copy_(torch.randn(k[0].shape, device="cuda", generator=g).to(k.dtype))
        v[0].copy_(torch.randn(v[0].shape, device="cuda", generator=g).to(v.dtype))
    before = core.kv_cache.tensor.clone()
    backend = CudaGraphBackend(core.model, torch.device("cuda"), core.config.max_model_len)
    backend.bind_cache(CacheBinding.from_kv_tensor(core.kv_cache.tensor))
    assert backend.use_graphs and len(backend._graphs) == 8
    assert torch.equal(core.kv_cache.tensor, before)


def test_concurrent_standard_requests_equal_each_alone(core):
    """64 requests at once (prefill chunks beside decodes, decode graphs up to 64) against each alone."""
    prompts = prompts_for(core, 64, seed=11)
    many = standard_tokens(core, prompts, tokens=64, budget=2048)
    alone = [standard_tokens(core, [p], tokens=64)[0] for p in prompts]
    same = sum(a == b for a, b in zip(many, alone, strict=True))
    assert same == len(prompts), f"c=64 == alone for {same}/{len(prompts)}"


def _prefill_logits(core, prompt: list[int], chunk: int | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill ``prompt`` in chunks of ``chunk`` tokens (None: whole) through the model runner; return the
    last logits and the prompt's K plane rows of every layer."""
    from replicas.request import Request, SamplingParams

    req = Request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    req.block_table = core.allocator.allocate(-(-len(prompt) // 16))
    try:
        step = chunk or len(prompt)
        logits = None
        while req.num_computed_tokens < len(prompt):
            n = min(step, len(prompt) - req.num_computed_tokens)
            logits = core.runner.execute([(req, n)])
            req.num_computed_tokens += n
        slots = [req.block_table[p // 16] * 16 + p % 16 for p in range(len(prompt))]
        keys = [kp.flatten(0, 1)[slots].clone() for kp, _ in core.kv_cache.planes()]
        return logits[0].clone(), keys
    finally:
        core.allocator.free(req.block_table)


def test_chunked_prefill_equals_whole(core):
    """A 300-token prompt, longer than the 128-token window, so the windowed layers' key tiles start past 0:
    chunks of 16 (a prefix-cache hit's tail starts at a page boundary, mid query tile), 100 and 257."""
    prompt = sum(prompts_for(core, 6, seed=3), [])[:300]
    assert len(prompt) == 300
    whole_logits, whole_keys = _prefill_logits(core, prompt, None)
    for chunk in (16, 100, 257):
        logits, keys = _prefill_logits(core, prompt, chunk)
        assert torch.equal(logits, whole_logits), chunk
        assert all(torch.equal(a, b) for a, b in zip(keys, whole_keys, strict=True)), chunk


def test_grouped_moe_rows_are_exact_at_every_token_count(core):
    """The decode family's grouped GEMMs (fixed M-block height): each token's partials equal the token alone."""
    from replicas.kernels.moe import ROW_EXACT_BLOCK_M

    layer = core.model.model.layers[0].mlp
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = core.model.config.hidden_size
    probe = torch.randn(1, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w, ids = core.model.ops.route(layer.router, probe)
    for prefill in (False, True):
        alone = core.model.ops.moe.row_exact_partials(probe, w, ids, layer.experts, prefill)
        for m in ROWS:
            x = torch.randn(m, hidden, device="cuda", generator=g).to(torch.bfloat16)
            r = m // 2
            x[r] = probe[0]
            ww, ii = core.model.ops.route(layer.router, x)
            got = core.model.ops.moe.row_exact_partials(x, ww, ii, layer.experts, prefill)
            assert torch.equal(got[r], alone[0]), (prefill, m, ROW_EXACT_BLOCK_M)


def test_decode_attention_rows_are_exact_at_every_batch(core):
    """Fixed split count: a sequence's attention output does not depend on the batch beside it."""
    from replicas.kernels.paged_attention import PAGE_SIZE

    attn = core.model.model.layers[1].self_attn  # full attention (layer 0 is windowed)
    kp, vp = core.kv_cache.planes()[1]
    g = torch.Generator(device="cuda").manual_seed(1)
    kp.copy_(torch.randn(kp.shape, device="cuda", generator=g).to(kp.dtype))
    vp.copy_(torch.randn(vp.shape, device="cuda", generator=g).to(vp.dtype))
    blocks = kp.shape[0]
    width = 32
    heads, d = attn.num_heads, attn.head_dim

    def run(b: int, seed: int):
        gg = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(b, heads, d, device="cuda", generator=gg).to(torch.bfloat16)
        table = torch.randint(0, blocks, (b, width), device="cuda", generator=gg)
        ctx = torch.randint(1, width * PAGE_SIZE, (b,), device="cuda", generator=gg)
        return q, table, ctx

    q1, t1, c1 = run(1, 99)
    ws: dict = {}
    alone = core.model.ops.decode_attention(q1, kp, vp, t1, c1, attn.scale, sinks=attn.sinks, workspace=ws)
    for b in ROWS:
        q, table, ctx = run(b, b)
        r = b // 2
        q[r], table[r], ctx[r] = q1[0], t1[0], c1[0]
        out = core.model.ops.decode_attention(q, kp, vp, table, ctx, attn.scale, sinks=attn.sinks, workspace=ws)
        assert torch.equal(out[r], alone[0]), b
