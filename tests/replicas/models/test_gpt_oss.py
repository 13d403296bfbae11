"""GPT-OSS over the paged KV cache agrees with transformers' ``GptOssForCausalLM``.

A tiny random GPT-OSS (4 layers, 8 experts, hidden 64, 8 q / 2 kv heads of
head_dim 16, MXFP4 experts, YaRN RoPE, sliding window 128 on even layers) is
written by ``ops.tools.make_tiny_gpt_oss`` into a temp dir and loaded by our engine
and by transformers (which dequantizes the MXFP4 experts on CPU itself), both
in fp32. Prompts of 150-200 tokens are longer than the window and cross page
boundaries; pages are deliberately non-contiguous.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ops.tools.make_tiny_gpt_oss import make_tiny_gpt_oss
from replicas.config import EngineConfig
from replicas.engine import EngineCore, LLMEngine
from replicas.kernels import paged_attention as pa
from replicas.kernels.moe.mxfp4 import MXFP4Error
from replicas.kernels.paged_attention import PAGE_SIZE, AttentionMetadata, paged_attention, write_kv
from replicas.kernels.reference import clamped_swiglu
from replicas.kv_cache import KVCache
from replicas.models.gpt_oss import GptOssForCausalLM, rope_inv_freq
from replicas.models.gpt_oss_config import GptOssConfig
from replicas.models.registry import model_class
from replicas.persistent.eager import EagerBackend
from replicas.persistent.lane import PersistentLane
from replicas.request import SamplingParams
from replicas.scheduler import SchedulerConfig
from tests.replicas.conftest import (
    TORCH_THREADS,
    assert_pool_full,
    greedy_request,
    run_standard,
    tokens_of,
)

NEW_TOKENS = 64
GREEDY_64 = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _rel_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    """fp32 agreement: ``|ours - ref| <= rel * max|ref|`` (the logit scale)."""
    tol = rel * ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= tol, f"max |diff| {err:.3g} > {tol:.3g}"


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss"), seed=0)


@pytest.fixture(scope="module")
def gpt_core(tiny_dir) -> EngineCore:
    return EngineCore.load(EngineConfig(
        model=str(tiny_dir), dtype="float32", progress=False, max_model_len=512, torch_threads=TORCH_THREADS,
    ))


@pytest.fixture(scope="module")
def hf_gpt(tiny_dir):
    """transformers' model over the same directory, fp32, MXFP4 experts dequantized at load."""
    from transformers import GptOssForCausalLM as HFGptOss
    from transformers import Mxfp4Config

    model = HFGptOss.from_pretrained(tiny_dir, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True))
    assert model.config._attn_implementation == "eager"  # the sinks path; GPT-OSS has no SDPA
    return model.eval()


@pytest.fixture(scope="module")
def prompts(gpt_core) -> list[list[int]]:
    """Two random prompts, 200 and 150 tokens: past the 128-token window, not page-aligned."""
    gen = torch.Generator().manual_seed(7)
    vocab = gpt_core.model.config.vocab_size
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (200, 150)]


@pytest.fixture(scope="module")
def hf_greedy_64(hf_gpt, prompts) -> list[list[int]]:
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.inference_mode():
            gen = hf_gpt.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
        out.append(gen[0, len(ids):].tolist())
    return out


# --------------------------------------------------------------------------------- config and load


def test_registry_and_config(tiny_dir, gpt_core):
    assert model_class(tiny_dir) is GptOssForCausalLM
    cfg = gpt_core.model.config
    assert isinstance(cfg, GptOssConfig)
    assert (cfg.model_type, cfg.num_layers, cfg.num_experts, cfg.experts_per_token) == ("gpt_oss", 4, 8, 4)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 8, 2, 16)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert [cfg.layer_window(i) for i in range(4)] == [128, None, 128, None]
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling.factor == 32 and cfg.rope_scaling.truncate is False
    assert cfg.vocab_size == len(gpt_core.tokenizer) == 49152
    assert cfg.eos_token_ids == (gpt_core.tokenizer.eos_token_id,) and gpt_core.eos_token_ids == {2}
    assert gpt_core.kv_cache.tensor.shape == (2, 4, gpt_core.kv_cache.num_blocks, PAGE_SIZE, 2, 16)
    experts = gpt_core.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_blocks.dtype == torch.uint8 and experts.gate_up_proj_blocks.shape == (8, 128, 2, 16)


def test_weights_equal_transformers(gpt_core, hf_gpt):
    """Every tensor loads to the same values, MXFP4 experts included (ours dequantized, transposed)."""
    from replicas.kernels.moe.mxfp4 import dequantize_mxfp4

    ref = hf_gpt.state_dict()
    ours = gpt_core.model.state_dict()
    for name, t in ours.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            t, name = dequantize_mxfp4(t, ours[base + "_scales"], torch.float32).transpose(1, 2), base
        assert torch.equal(t, ref[name]), name


@pytest.mark.parametrize(
    ("rope", "truncate"),
    [({"rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "original_max_position_embeddings": 4096, "truncate": False}, "rope_theta": 150000}, False),
     ({"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "original_max_position_embeddings": 4096, "rope_theta": 150000.0}}, True),
     ({}, False)],
    ids=["rope_scaling", "rope_parameters_default_truncate", "absent"],
)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_yarn_matches_transformers(rope, truncate, head_dim):
    """Both config spellings (and none) give transformers' YaRN inverse frequencies and attention factor."""
    from transformers import GptOssConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {"model_type": "gpt_oss", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 64, "intermediate_size": 64, "head_dim": head_dim, "vocab_size": 100,
           "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 131072, **rope}
    ours = GptOssConfig.from_dict(raw)
    assert ours.rope_theta == 150000.0 and ours.rope_scaling.truncate is truncate
    hf = HFConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
    inv, scale = rope_inv_freq(head_dim, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(inv, ref_inv, rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)


def test_config_rejects_bad_fields():
    base = {"model_type": "gpt_oss", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "hidden_size": 64, "intermediate_size": 64, "head_dim": 16, "vocab_size": 100, "num_local_experts": 4}
    assert GptOssConfig.from_dict(base).layer_types == ("sliding_attention", "full_attention")
    for bad, match in [
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3"),
        ({"quantization_config": {"quant_method": "fp8"}}, "fp8"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"model_type": "llama"}, "model_type"),
    ]:
        with pytest.raises(ValueError, match=match):
            GptOssConfig.from_dict({**base, **bad})


@pytest.fixture(scope="module")
def tiny_tensors(tiny_dir) -> dict[str, torch.Tensor]:
    return load_file(tiny_dir / "model.safetensors")


def _broken_copy(tiny_dir, tensors, tmp_path, edit):
    shutil.copyfile(tiny_dir / "config.json", tmp_path / "config.json")
    tensors = dict(tensors)
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


L0 = "model.layers.0."


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t.pop(L0 + "self_attn.sinks"), r"missing \['model.layers.0.self_attn.sinks'\]"),
        (lambda t: t.update({L0 + "self_attn.q_proj.weight": torch.zeros(64, 64)}),
         r"model.layers.0.self_attn.q_proj.weight has shape \(64, 64\), expected \(128, 64\)"),
        (lambda t: t.update({L0 + "mlp.router.bias": torch.zeros(8, dtype=torch.uint8)}),
         "model.layers.0.mlp.router.bias has dtype torch.uint8"),
        (lambda t: t.update({L0 + "mlp.experts.down_proj_blocks": t[L0 + "mlp.experts.down_proj_blocks"].to(torch.int8)}),
         "model.layers.0.mlp.experts.down_proj_blocks: dtype torch.int8"),
        (lambda t: t.update({L0 + "mlp.experts.gate_up_proj_scales": t[L0 + "mlp.experts.gate_up_proj_scales"][:, :64].contiguous()}),
         "model.layers.0.mlp.experts.gate_up_proj_scales: shape"),
        (lambda t: t.update({L0 + "mlp.experts.down_proj_scales": torch.full_like(t[L0 + "mlp.experts.down_proj_scales"], 255)}),
         "model.layers.0.mlp.experts.down_proj_scales: contains the E8M0 NaN"),
        (lambda t: t.update({L0 + "mlp.experts.gate_up_proj": t.pop(L0 + "mlp.experts.gate_up_proj_blocks").float()}),
         "dense expert weights are not supported"),
    ],
    ids=["missing", "shape", "dtype", "blocks_dtype", "scales_shape", "scales_nan", "dense_experts"],
)
def test_bad_checkpoint_names_the_tensor(tiny_dir, tiny_tensors, tmp_path, edit, match):
    path = _broken_copy(tiny_dir, tiny_tensors, tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        GptOssForCausalLM.from_pretrained(path, dtype=torch.float32, progress=False)


def test_bad_checkpoint_mxfp4_errors_are_mxfp4_errors(tiny_dir, tiny_tensors, tmp_path):
    def edit(t):
        t[L0 + "mlp.experts.down_proj_blocks"] = t[L0 + "mlp.experts.down_proj_blocks"][..., :8].contiguous()

    with pytest.raises(MXFP4Error, match="down_proj_blocks: shape"):
        GptOssForCausalLM.from_pretrained(_broken_copy(tiny_dir, tiny_tensors, tmp_path, edit), progress=False)


# ------------------------------------------------------------------------------ paged attention


class _SinkModule:
    """What transformers' GPT-OSS ``eager_attention_forward`` reads from its module."""

    training = False

    def __init__(self, groups: int, sinks: torch.Tensor):
        self.num_key_value_groups, self.sinks = groups, sinks


@pytest.mark.parametrize(
    ("q_len", "ctx", "window", "with_sinks"),
    [(1, 1, 128, True), (1, 200, 128, True), (1, 200, None, True), (37, 200, 128, True), (200, 200, 128, True),
     (200, 200, 5, False), (13, 90, 16, False), (13, 90, None, True), (5, 40, 1, True)],
)
def test_paged_attention_matches_transformers_eager(q_len, ctx, window, with_sinks):
    """Sinks and the window over shuffled pages equal transformers' dense eager attention with the
    sliding-window mask ``kv_idx > q_idx - W`` (``masking_utils.sliding_window_overlay``)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(q_len * 1000 + ctx)
    h, kvh, d, blocks = 8, 2, 16, 24
    keys, values = torch.randn(ctx, kvh, d, generator=gen), torch.randn(ctx, kvh, d, generator=gen)
    query = torch.randn(q_len, h, d, generator=gen)
    sinks = torch.randn(h, generator=gen) if with_sinks else None
    table = torch.randperm(blocks, generator=gen)[: -(-ctx // PAGE_SIZE)]
    pos = torch.arange(ctx)
    slots = table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
    kp, vp = torch.zeros(blocks, PAGE_SIZE, kvh, d), torch.zeros(blocks, PAGE_SIZE, kvh, d)
    write_kv(keys, values, kp, vp, slots)
    meta = AttentionMetadata(pos[ctx - q_len:], slots[ctx - q_len:], [0, q_len], [ctx], [table])
    ours = paged_attention(query, kp, vp, meta, d**-0.5, sinks=sinks, sliding_window=window)

    qpos, kpos = torch.arange(ctx - q_len, ctx)[:, None], torch.arange(ctx)[None, :]
    visible = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    mask = torch.zeros(q_len, ctx).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]
    module = _SinkModule(h // kvh, sinks if with_sinks else torch.full((h,), float("-inf")))
    ref, _ = eager_attention_forward(
        module, query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        mask, scaling=d**-0.5,
    )
    torch.testing.assert_close(ours, ref[0], rtol=0, atol=2e-6)


def test_paged_attention_row_chunks_and_plain_path(monkeypatch):
    """Row-chunking under a tiny score budget changes nothing; a window past the context and no sinks
    equals the original SDPA path."""
    gen = torch.Generator().manual_seed(3)
    h, kvh, d, ctx, q_len = 4, 2, 8, 70, 30
    kp, vp = torch.randn(8, PAGE_SIZE, kvh, d, generator=gen), torch.randn(8, PAGE_SIZE, kvh, d, generator=gen)
    table = torch.tensor([5, 0, 7, 2, 6])
    pos = torch.arange(ctx - q_len, ctx)
    meta = AttentionMetadata(pos, table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE, [0, q_len], [ctx], [table])
    q = torch.randn(q_len, h, d, generator=gen)
    sinks = torch.randn(h, generator=gen)
    whole = paged_attention(q, kp, vp, meta, 0.3, sinks=sinks, sliding_window=9)
    monkeypatch.setattr(pa, "SCORE_BUDGET", h * 20)
    chunked = paged_attention(q, kp, vp, meta, 0.3, sinks=sinks, sliding_window=9)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    plain = paged_attention(q, kp, vp, meta, 0.3)
    torch.testing.assert_close(paged_attention(q, kp, vp, meta, 0.3, sliding_window=ctx), plain, rtol=0, atol=1e-6)


def test_clamped_swiglu_matches_transformers():
    from transformers import GptOssConfig as HFConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    x = torch.linspace(-12, 12, 96).view(2, 48)  # well past the +-7 clamp on both sides
    ref = GptOssExperts(HFConfig(hidden_size=32, intermediate_size=24, num_local_experts=1))._apply_gate(x)
    assert torch.equal(clamped_swiglu(x, 1.702, 7.0), ref)


# ------------------------------------------------------------------------- the model vs transformers


def _forward_chunks(model, kv: KVCache, table: torch.Tensor, ids: list[int], bounds: list[int]) -> list[torch.Tensor]:
    """Feed ``ids`` in chunks ``[bounds[j], bounds[j+1])``; each chunk's last-token logits ``[vocab]``."""
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        pos = torch.arange(a, b)
        meta = AttentionMetadata(pos, table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE, [0, b - a], [b], [table])
        out.append(model(torch.tensor(ids[a:b]), meta, kv.planes())[0])
    return out


@pytest.fixture(scope="module")
def hf_all_logits(hf_gpt, prompts, hf_greedy_64) -> list[torch.Tensor]:
    """transformers' logits at every position of prompt + its greedy continuation, ``[T, vocab]``."""
    with torch.inference_mode():
        return [hf_gpt(torch.tensor([p + g])).logits[0] for p, g in zip(prompts, hf_greedy_64, strict=True)]


def test_logits_match_transformers_chunked_prefill_then_decode(gpt_core, prompts, hf_greedy_64, hf_all_logits):
    """Prefill in chunks (77 + 123, crossing the window and pages), then 24 single-token decodes."""
    model = gpt_core.model
    ids = prompts[0] + hf_greedy_64[0][:24]
    kv = KVCache(model.config, 32, torch.float32, "cpu")
    table = torch.randperm(32, generator=torch.Generator().manual_seed(11))[:15]
    bounds = [0, 77, 200, *range(201, len(ids) + 1)]
    got = _forward_chunks(model, kv, table, ids, bounds)
    ref = hf_all_logits[0]
    for b, logits in zip(bounds[1:], got, strict=True):
        _rel_close(logits, ref[b - 1])
    assert got[-1].argmax().item() == hf_greedy_64[0][24]


def test_logits_match_transformers_batched(gpt_core, prompts, hf_all_logits):
    """Two sequences in one forward: one decoding at position 200, one prefilling 150 tokens."""
    model = gpt_core.model
    kv = KVCache(model.config, 32, torch.float32, "cpu")
    t0, t1 = torch.arange(13).flip(0) * 2 + 1, torch.arange(10) * 2  # disjoint, scattered pages
    _forward_chunks(model, kv, t0, prompts[0], [0, 200])  # sequence 0's prompt in the cache
    seq0_next = int(hf_all_logits[0][199].argmax())
    ids = [seq0_next] + prompts[1]
    pos = torch.cat((torch.tensor([200]), torch.arange(150)))
    tables = [t0, t1]
    owner = [0] + [1] * 150
    slots = torch.stack([tables[o][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for o, p in zip(owner, pos, strict=True)])
    meta = AttentionMetadata(pos, slots, [0, 1, 151], [201, 150], tables)
    logits = model(torch.tensor(ids), meta, kv.planes())
    _rel_close(logits[0], hf_all_logits[0][200])
    _rel_close(logits[1], hf_all_logits[1][149])


def test_window_and_sinks_change_the_logits(gpt_core, prompts, hf_all_logits):
    """The equivalence above is sensitive: dropping the window or the sinks moves logits by far more
    than its tolerance."""
    model = gpt_core.model
    attn = [layer.self_attn for layer in model.model.layers]
    ref = hf_all_logits[0][199]

    def last_logits():
        kv = KVCache(model.config, 16, torch.float32, "cpu")
        return _forward_chunks(model, kv, torch.arange(13), prompts[0], [0, 200])[0]

    try:
        for a in attn:
            a.sliding_window = None
        no_window = last_logits()
    finally:
        for a, w in zip(attn, (128, None, 128, None), strict=True):
            a.sliding_window = w
    saved = [a.sinks.detach().clone() for a in attn]
    try:
        for a in attn:
            a.sinks.data.fill_(float("-inf"))
        no_sinks = last_logits()
    finally:
        for a, s in zip(attn, saved, strict=True):
            a.sinks.data.copy_(s)
    scale = ref.abs().max()
    assert (no_window - ref).abs().max() > 1e-2 * scale
    assert (no_sinks - ref).abs().max() > 1e-2 * scale
    _rel_close(last_logits(), ref)


# ---------------------------------------------------------------------------------- both lanes


def test_standard_lane_greedy_matches_transformers(gpt_core, prompts, hf_greedy_64):
    """Both prompts batched, prefilled in chunks of 48 tokens (not page-aligned), 64 greedy tokens each."""
    engine = LLMEngine(gpt_core, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=48))
    chunks = run_standard(engine, {f"r{i}": (ids, GREEDY_64) for i, ids in enumerate(prompts)})
    for i in range(len(prompts)):
        assert tokens_of(chunks[f"r{i}"]) == hf_greedy_64[i], f"prompt {i}"
        assert chunks[f"r{i}"][-1].finish_reason == "length"
    assert_pool_full(gpt_core)


@pytest.mark.parametrize("index", [0, 1])
def test_persistent_lane_greedy_matches_transformers(gpt_core, prompts, hf_greedy_64, index):
    lane = PersistentLane(gpt_core, EagerBackend(gpt_core.model, gpt_core.runner.device))
    items = list(lane.generate(greedy_request(f"p{index}", prompts[index], GREEDY_64)))
    assert all(type(i).__name__ == "GenerationChunk" for i in items), items
    assert tokens_of(items) == hf_greedy_64[index]
    assert [len(c.token_ids) for c in items] == [1] + [8] * 7 + [7]
    assert lane.healthy and items[-1].finish_reason == "length"
    assert_pool_full(gpt_core)


@pytest.mark.parametrize("index", [0, 1])
def test_static_decode_step_greedy_matches_transformers(gpt_core, prompts, hf_greedy_64, index):
    """The ``cuda_graph`` backend's static body (fused-kernel references on CPU: RoPE + KV write, add +
    RMSNorm, top-k routing, MoE) gives transformers' 64 greedy tokens, in 8-token quanta."""
    from replicas.persistent.cuda_graph import CudaGraphBackend

    backend = CudaGraphBackend(gpt_core.model, "cpu", gpt_core.config.max_model_len)
    assert backend.use_graphs is False
    lane = PersistentLane(gpt_core, backend)
    items = list(lane.generate(greedy_request(f"g{index}", prompts[index], GREEDY_64)))
    assert tokens_of(items) == hf_greedy_64[index]
    assert [len(c.token_ids) for c in items] == [1] + [8] * 7 + [7]
    assert_pool_full(gpt_core)


def test_fused_qkv_is_a_view_of_the_projections(gpt_core):
    attn = gpt_core.model.model.layers[0].self_attn
    fused_w, fused_b = attn._qkv
    assert attn.q_proj.weight.data_ptr() == fused_w.data_ptr()
    assert attn.v_proj.bias.data_ptr() == fused_b[-attn.v_proj.bias.numel():].data_ptr()
    x = torch.randn(3, gpt_core.model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    ref = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    torch.testing.assert_close(attn.qkv_proj(x), ref)


def test_warm_up_runs_a_prompt_per_grouped_gemm_height(gpt_core):
    """GPT-OSS gives ``LLMEngine.warm_up`` the smallest prompt length past the decode kernels' 16 tokens that
    reaches each M-block height of its grouped MoE GEMMs (each height its own compiled kernel), and the warm-up
    runs them."""
    from replicas.kernels.moe import DECODE_MAX_TOKENS
    from replicas.kernels.moe.grouped_gemm import pick_block_m

    cfg = gpt_core.model.config
    lengths = gpt_core.model.warm_up_prompt_lengths(400)
    height = {t: pick_block_m(t * cfg.experts_per_token, cfg.num_experts) for t in range(DECODE_MAX_TOKENS + 1, 401)}
    assert [height[t] for t in lengths] == sorted(set(height.values())) == [16, 32, 64, 128]
    for t in lengths:  # the smallest length of its height
        assert t == DECODE_MAX_TOKENS + 1 or height[t - 1] != height[t]
    done = LLMEngine(gpt_core).warm_up(lengths=(16,), batch=2, batch_len=8, new_tokens=1)
    assert done["prompts"] == 1 + len(lengths) + 2


def test_warm_up_reaches_every_grouped_gemm_height_a_step_can_take(tiny_dir):
    """A step may hold more prompt tokens than one prompt (``max_num_batched_tokens`` against
    ``max_model_len``): a served burst packs several prompts into one step. The warm-up reaches every M-block
    height such a step can reach, splitting a count longer than one prompt over prompts prefilled together
    (the H200's first burst of 1,024-token 120b prompts compiled the 128-row kernels inside the requests,
    3.2 s, when the warm-up stopped at one prompt's 1,340 tokens)."""
    from replicas.kernels.moe import DECODE_MAX_TOKENS
    from replicas.kernels.moe.grouped_gemm import pick_block_m, token_counts_per_block_m

    core = EngineCore.load(EngineConfig(model=str(tiny_dir), dtype="float32", progress=False, max_model_len=48,
                                        max_num_batched_tokens=1024, num_kv_blocks=64,
                                        torch_threads=TORCH_THREADS))
    cfg = core.model.config
    want = token_counts_per_block_m(cfg.num_experts, cfg.experts_per_token, DECODE_MAX_TOKENS + 1, 1024)
    assert max(want.values()) > 48  # the largest height needs more tokens than one prompt holds
    steps = []
    execute = core.runner.execute

    def recording(batch):
        steps.append(sum(n for _, n in batch))
        return execute(batch)

    core.runner.execute = recording
    LLMEngine(core).warm_up(lengths=(16,), batch=2, batch_len=8, new_tokens=1)
    reached = {pick_block_m(t * cfg.experts_per_token, cfg.num_experts) for t in steps if t > DECODE_MAX_TOKENS}
    assert reached == set(want), (steps, want)
    assert core.allocator.num_free == core.allocator.num_blocks
    # one sequence per step: no count above one prompt's length is tried (such a prompt would be refused)
    steps.clear()
    LLMEngine(core, SchedulerConfig(1, 1024, True)).warm_up(lengths=(16,), batch=2, batch_len=8, new_tokens=1)
    assert steps and max(steps) <= 48 - 1
    assert core.allocator.num_free == core.allocator.num_blocks
