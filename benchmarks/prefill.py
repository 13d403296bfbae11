"""Prefill and standard-lane benchmark on one GPU, in one call: kernel checks, kernel peers, TTFT, batching.

Parts (``--parts``; by default the two model shapes, ``hf``, ``kernels``, ``lanes``, ``tiles``, in that
order; each in its own ``try``, so one failing part does not lose the others; a time budget,
``--budget-s``, skips what would not fit). The kernels' correctness checks in bf16 are GPU tests
(``tests/gpu/test_prefill_gpu.py``), not part of this benchmark.
* ``kernels`` — kernel-level timings at gpt-oss-120b's layer shapes, tokens 1, 16, 64, 1,024, 8,192, with
  the peers side by side: prefill attention against ``torch.nn.functional.scaled_dot_product_attention``
  (flash backend, causal, without sinks: the peer cannot take them); the MoE layer (both GEMMs and the
  SwiGLU) against ``matmul_ogs`` of OpenAI's ``triton_kernels`` (the copy vLLM ships under
  ``vllm/third_party/triton_kernels``; ``--triton-kernels DIR`` names the folder holding the
  ``triton_kernels`` package) and against the MoE path this project ran before (decode kernels up to 16
  tokens, else each routed expert dequantized); compute and bytes floors.
* ``gpt-oss-120b`` / ``gpt-oss-20b`` — random weights of the released shapes (``benchmarks/engine.py``):
  TTFT at prompts of 128, 1,024 and 8,192 tokens, batch one, on the persistent lane and the standard lane,
  with the floor (compute at ``--tflops``, bytes at ``--bandwidth-tbps``); a repeated 2,000-token
  prompt on the persistent lane with prefix caching (only the uncached rest is prefilled). For 120b also the
  standard lane at concurrency 1, 8, 16, 64, 256 (random 1,024-token prompts, 128 new tokens, greedy):
  output tok/s, ITL median/p99, the median decode step at full concurrency and its fraction of the
  bandwidth floor of what it reads (dense weights, the distinct experts ``c`` tokens route to, the KV).
* ``lanes`` — a small random GPT-OSS in fp32, bf16 and bf16 with ``batch_invariant``: greedy tokens of 20
  prompts x 128 identical between the persistent lane and the standard lane (new prefill, decode graphs
  past 16 sequences), and the standard lane at concurrency 64 against the same requests one at a time (how
  many match; ``docs/exactness.md``).
* ``hf`` — the transformers peer on the gpt-oss-20b shape (its own random bf16 weights, experts dense, as
  ``benchmarks/engine.py`` builds it): TTFT (``generate`` of one token) at the same prompts, with its dynamic
  cache (eager) and with ``cache_implementation="static"`` (transformers compiles the forward itself). Run it
  in the same call as ``gpt-oss-20b`` for the side-by-side.
* ``tiles`` — tile alternatives of the grouped MoE GEMMs (64, 1,024, 8,192 tokens) and of the prefill
  attention (8,192 tokens), for choosing the defaults.

Everything is printed as tables at the end and written to ``--out`` (default ``$OUT``): ``report.md``
(tables, command, GPU and versions), ``errors.txt`` (tracebacks of failed parts) and one result file per
study (:mod:`benchmarks.results`: ``batch_one``, ``standard_sweep``, ``lane_agreement``), which
``benchmarks/results/`` keeps for ``docs/benchmarks.md``.

Usage (H200, one command, under 9 minutes):
``python -m benchmarks.prefill --out $OUT --triton-kernels .carry``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.results import machine
from ops.tools import fixtures
from ops.tools.fixtures import SMALL_GPT_OSS, rel_err, repacked_copy

PARTS = ("gpt-oss-120b", "gpt-oss-20b", "hf", "kernels", "lanes", "tiles")
"""In priority order: the headline measurements first, so a run cut short by its time budget keeps them."""


class Settings:
    """Shapes and sizes of a run: the real ones on a GPU, tiny ones for ``--smoke`` (CPU, Triton's interpreter,
    fp32: checks that the script itself runs, not the numbers)."""

    device = "cuda"
    dtype = torch.bfloat16
    smoke = False
    tokens = (1, 16, 64, 1024, 8192)
    moe_tokens = (1, 8, 16, 64, 256, 1024, 8192)  # 8 and 256: the standard lane's c=8 and c=256 decode steps
    prompts = (128, 1024, 8192)
    profile_prompts = (128, 1024)
    profile_concurrency = (1, 8, 64, 256)  # the sweep's decode steps profiled
    warm_prompts = (16, 128, 300, 500, 1000, 2000, 8192)  # the decode MoE kernels (<= 16 tokens), every grouped
    # block height and both attention variants: the first call of each compiles (NVRTC for hopper_bulk)
    concurrency = (1, 8, 16, 64, 256)
    sweep_batched_tokens = 8192  # the sweep's scheduler: tokens per step (chunked prefill mixed with decodes)
    sweep_prompt = 1024
    repeat_prompt = 2000
    heads = (64, 8, 64)  # query heads, KV heads, head_dim (gpt-oss)
    moe = (128, 2880, 2880, 4)  # experts, hidden, expert width, top-k (gpt-oss-120b)
    check_experts = 32
    moe_check_tokens = (1, 17, 300, 2000)
    lanes = (20, 128, 64)  # prompts, tokens, concurrency
    engine: dict = {}  # engine config fields of the model parts (--engine)

    @classmethod
    def make_smoke(cls) -> None:
        cls.device, cls.dtype, cls.smoke = "cpu", torch.float32, True
        cls.tokens, cls.prompts, cls.warm_prompts, cls.concurrency = (1, 16, 40), (16, 40), (40,), (1, 3)
        cls.profile_prompts, cls.profile_concurrency = (40,), (3,)
        cls.moe_tokens = cls.tokens
        cls.sweep_prompt, cls.repeat_prompt, cls.sweep_batched_tokens = 24, 40, 32  # prefill spans several steps
        cls.heads, cls.moe, cls.check_experts, cls.moe_check_tokens = (8, 2, 16), (8, 64, 64, 2), 8, (1, 9)
        cls.lanes = (3, 6, 4)


S = Settings


def sync() -> None:
    if S.device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------- report


class Report:
    """Tables collected part by part, written to ``out`` after every part (a run cut short keeps them)."""

    def __init__(self, out: Path, argv: list[str], budget_s: float):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.command = "python -m benchmarks.prefill " + " ".join(argv)
        self.sections: list[tuple[str, list[str]]] = []
        self.rows: dict[str, list[dict]] = {}
        self.errors: list[str] = []
        self.studies: dict[str, list[dict]] = {}
        self.t0 = time.perf_counter()
        self.budget_s = budget_s

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def table(self, title: str, header: list[str], rows: list[list], note: str = "") -> None:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(_fmt(v) for v in r) + " |" for r in rows]
        if note:
            lines += ["", note]
        self.sections.append((title, lines))
        self.rows.setdefault(title, []).extend(dict(zip(header, r, strict=False)) for r in rows)
        print(f"\n### {title}\n" + "\n".join(lines), flush=True)
        self.write()

    def note(self, title: str, text: str) -> None:
        self.sections.append((title, [text]))
        print(f"\n### {title}\n{text}", flush=True)
        self.write()

    def error(self, part: str, exc: BaseException) -> None:
        text = f"== {part}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        self.errors.append(text)
        print(text, flush=True)
        self.write()

    def study(self, name: str, rows: list[dict]) -> None:
        """Add ``rows`` to study ``name`` and (re)write its result file in ``out``
        (:func:`benchmarks.results.write_result`): a run cut short keeps what it measured."""
        from benchmarks.results import write_result

        self.studies.setdefault(name, []).extend(rows)
        write_result(name, self.studies[name], self.out, command=self.command)

    def markdown(self) -> str:
        head = [f"Command: `{self.command}`", f"Machine: {machine()}", ""]
        body = []
        for title, lines in self.sections:
            body += [f"### {title}", "", *lines, ""]
        return "\n".join(head + body)

    def write(self) -> None:
        (self.out / "report.md").write_text(self.markdown())
        (self.out / "errors.txt").write_text("\n".join(self.errors) or "no errors\n")


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "—"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def cuda_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` on the GPU (CUDA events around each call; the wall clock on CPU)."""
    if S.smoke:
        reps, warmup = 1, 0
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        if S.device != "cuda":
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def random_experts(e: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    """:func:`ops.tools.fixtures.random_experts` on ``S.device``."""
    return fixtures.random_experts(e, hidden, inter, dtype, seed, S.device)


def attention_batch(q_lens, ctx_lens, seed=0):
    """:func:`ops.tools.fixtures.attention_batch` with ``S.heads``, ``S.dtype`` and ``S.device``."""
    return fixtures.attention_batch(q_lens, ctx_lens, S.heads, S.dtype, S.device, seed)


# ------------------------------------------------------------------------------------------- kernels


def part_kernels(rep: Report, args) -> None:
    try:
        _attention_kernels(rep, args)
    except Exception as exc:  # noqa: BLE001
        rep.error("kernels/attention", exc)
    try:
        _moe_kernels(rep, args)
    except Exception as exc:  # noqa: BLE001
        rep.error("kernels/moe", exc)


def _attention_kernels(rep: Report, args) -> None:
    import torch.nn.functional as F

    from replicas.kernels.paged_attention import paged_attention
    from replicas.kernels.prefill_attention import attention_flops

    heads, kvh, d = S.heads
    backend = "FLASH_ATTENTION" if S.device == "cuda" else "MATH"
    rows = []
    for n in S.tokens:
        q, kp, vp, meta = attention_batch([n], [n], seed=n)
        sinks = torch.randn(heads, device=S.device).to(S.dtype)
        full = cuda_ms(lambda q=q, kp=kp, vp=vp, meta=meta, s=sinks: paged_attention(q, kp, vp, meta, 0.125, sinks=s))
        win = cuda_ms(lambda q=q, kp=kp, vp=vp, meta=meta, s=sinks: paged_attention(q, kp, vp, meta, 0.125, sinks=s,
                                                                                   sliding_window=128))
        qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        ks = kp.flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0).contiguous()  # [1, KVH, n, D] (contiguous, not paged)
        vs = vp.flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0).contiguous()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa_call(q=qs, k=ks, v=vs, causal=n > 1, **kw):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.125, **kw)

        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                sdpa = cuda_ms(lambda f=sdpa_call: f(enable_gqa=True))
        except Exception as exc:  # noqa: BLE001 - GQA not on the flash backend here: expand the KV heads
            print(f"SDPA flash without enable_gqa ({exc})")
            ke, ve = ks.repeat_interleave(heads // kvh, 1), vs.repeat_interleave(heads // kvh, 1)
            with sdpa_kernel(getattr(SDPBackend, backend)):
                sdpa = cuda_ms(lambda f=sdpa_call, k=ke, v=ve: f(k=k, v=v))
        fl, fl_w = attention_flops([n], [n], heads, d), attention_flops([n], [n], heads, d, window=128)
        rows.append([n, full * 1e3, fl / full / 1e9, win * 1e3, fl_w / win / 1e9, sdpa * 1e3, fl / sdpa / 1e9,
                     sdpa / full])
    rep.table("Prefill attention, one sequence, gpt-oss-120b heads (64 q / 8 kv, head_dim 64), bf16",
              ["tokens", "ours µs (sinks)", "ours TFLOP/s", "ours µs (sinks, window 128)", "TFLOP/s",
               "SDPA flash µs (no sinks)", "SDPA TFLOP/s", "SDPA / ours"], rows,
              "Ours reads K/V through the page table (16-token pages); SDPA reads contiguous K/V. FLOPs = 4 H D "
              "per visible (query, key) pair.")


def _matmul_ogs(tk_dir: str | None):
    """``(prepare(experts) -> weights, run(x, logits, weights) -> [T, hidden])`` over OpenAI's ``triton_kernels``
    (as vLLM calls it for gpt-oss on Hopper), or an error string."""
    if not tk_dir or S.device != "cuda":
        return "not run: no --triton-kernels folder" if not tk_dir else "not run: needs a GPU"
    sys.path.insert(0, str(Path(tk_dir).resolve()))
    try:
        import triton_kernels.swiglu
        from triton_kernels.matmul_ogs import (
            FlexCtx,
            FnSpecs,
            FusedActivation,
            PrecisionConfig,
            matmul_ogs,
        )
        from triton_kernels.matmul_ogs_details import opt_flags
        from triton_kernels.numerics import InFlexData
        from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
        from triton_kernels.tensor_details import layout
    except Exception as exc:  # noqa: BLE001
        return f"not run: import failed ({type(exc).__name__}: {exc})"
    try:  # the copies up to mid-2025 (vLLM <= 0.11) route with triton_kernels.routing
        from triton_kernels.routing import routing

        act = FusedActivation(FnSpecs("swiglu", triton_kernels.swiglu.swiglu_fn, ("alpha", "limit")), (1.702, 7.0), 2)
    except ImportError:  # later copies (vLLM 0.19): top-k to a sparse matrix, then ragged metadata
        from triton_kernels.matmul_ogs import GatherIndx, RoutingData, ScatterIndx
        from triton_kernels.tensor import make_ragged_tensor_metadata
        from triton_kernels.topk import topk

        def routing(logits, k, sm_first=False):
            sparse = topk(logits, k, apply_softmax=not sm_first)
            dispatch = sparse.mask_metadata.row_sorted_indx
            combine = sparse.mask_metadata.col_sorted_indx
            ragged = make_ragged_tensor_metadata(sparse.mask_metadata.col_sum, dispatch.shape[0])
            rdata = RoutingData(sparse.vals.flatten()[combine], ragged.block_sizes, logits.shape[-1], k, ragged)
            return rdata, GatherIndx(combine, dispatch), ScatterIndx(dispatch, combine)

        act = FusedActivation(FnSpecs("swiglu", triton_kernels.swiglu.swiglu_fn, ("alpha", "limit"), reduction_n=2),
                              (1.702, 7.0))

    if torch.cuda.get_device_capability()[0] == 9:
        opt_flags.update_opt_flags_constraints({"split_k": 1})

    def swizzle(blocks, scales):
        e, n, g, _ = blocks.shape
        value = blocks.view(e, n, g * 16).transpose(-2, -1)  # [E, K/2, N]
        if torch.cuda.get_device_capability()[0] == 9:
            scales = torch.nn.functional.pad(scales, (0, -g % 4))  # vLLM's Hopper workaround (K groups % 4)
        scale = scales.transpose(-2, -1)  # [E, K/32, N]
        vl, vopts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        sl, sopts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
        w = convert_layout(wrap_torch_tensor(value, dtype=FP4), vl, **vopts)
        s = convert_layout(wrap_torch_tensor(scale), sl, **sopts)
        return w, PrecisionConfig(weight_scale=s, flex_ctx=FlexCtx(rhs_data=InFlexData()))

    def prepare(ex):
        w1, pc1 = swizzle(ex.gate_up_proj_blocks, ex.gate_up_proj_scales)
        w2, pc2 = swizzle(ex.down_proj_blocks, ex.down_proj_scales)
        return w1, pc1, ex.gate_up_proj_bias.float(), w2, pc2, ex.down_proj_bias.float()

    def run(x, logits, w, k=4):
        w1, pc1, b1, w2, pc2, b2 = w
        rdata, gather, scatter = routing(logits, k, sm_first=False)
        h = matmul_ogs(x, w1, b1, rdata, gather_indx=gather, precision_config=pc1, fused_activation=act)
        return matmul_ogs(h, w2, b2, rdata, scatter_indx=scatter, precision_config=pc2, gammas=rdata.gate_scal)

    return prepare, run


def _moe_kernels(rep: Report, args) -> None:
    from replicas.kernels.moe import MoE, resolve_moe
    from replicas.kernels.moe.grouped_gemm import expert_bytes, experts_moe

    # the previous path: decode kernels up to 16 tokens, else each routed expert dequantized
    previous = MoE(resolve_moe("auto", torch.device(S.device), S.dtype, prefill_kernels=False), pdl=False)

    e, hidden, inter, k = S.moe
    experts = random_experts(e, hidden, inter, S.dtype, seed=3)
    packed = repacked_copy(experts)  # the layout the model holds on Hopper
    peer = _matmul_ogs(args.triton_kernels)
    peer_w = None
    if not isinstance(peer, str):
        try:
            peer_w = peer[0](experts)
        except Exception as exc:  # noqa: BLE001
            peer = f"not run: weight swizzle failed ({type(exc).__name__}: {exc})"
    rows, notes = [], []
    for t in S.moe_tokens:
        g = torch.Generator(device=S.device).manual_seed(t)
        x = torch.randn(t, hidden, generator=g, device=S.device).to(S.dtype)
        logits = torch.randn(t, e, generator=g, device=S.device).to(S.dtype)
        top, ids = torch.topk(logits.float(), k, dim=-1)
        weights = torch.softmax(top, -1).to(S.dtype)
        distinct = int(torch.unique(ids).numel())
        floor_bytes = expert_bytes(distinct, hidden, inter) / (args.bandwidth_tbps * 1e12) * 1e3
        floor_flops = 2 * t * k * 3 * hidden * inter / (args.tflops * 1e12) * 1e3
        floor = max(floor_bytes, floor_flops)
        ours = cuda_ms(lambda x=x, w=weights, i=ids, ex=packed: experts_moe(x, w, i, ex))
        ours_ck = cuda_ms(lambda x=x, w=weights, i=ids, ex=experts: experts_moe(x, w, i, ex))
        before = float("nan")
        if t <= 1024:  # the previous path: decode kernels up to 16 tokens, else per-expert dequantization
            before = cuda_ms(lambda x=x, w=weights, i=ids, ex=packed: previous(x, w, i, ex), reps=3, warmup=1)
        peer_ms, peer_err = float("nan"), float("nan")
        if not isinstance(peer, str):
            try:
                run_peer = peer[1]
                peer_ms = cuda_ms(lambda x=x, lg=logits, f=run_peer, pw=peer_w: f(x, lg, pw))
                peer_err = rel_err(run_peer(x, logits, peer_w), experts_moe(x, weights, ids, packed))
            except Exception as exc:  # noqa: BLE001
                peer = f"failed at {t} tokens ({type(exc).__name__}: {str(exc)[:200]})"
        rows.append([t, distinct, floor_bytes, floor_flops, ours, floor / ours, ours_ck, peer_ms, peer_err, before])
    if isinstance(peer, str):
        notes.append(f"matmul_ogs: {peer}")
    rep.table(f"MoE layer (gate_up + SwiGLU + down, {e} experts, top {k}, widths {hidden}/{inter}), "
              f"{str(S.dtype).removeprefix('torch.')}, ms",
              ["tokens", "experts read", "bytes floor", "compute floor", "ours (decode layout)", "of floor",
               "ours (checkpoint layout)", "matmul_ogs", "matmul_ogs vs ours (rel diff)", "previous path"], rows,
              f"Floors: distinct experts' packed bytes at {args.bandwidth_tbps} TB/s; 2 T K (3 H I) FLOP at "
              f"{args.tflops} TFLOP/s. matmul_ogs includes its routing (top-k from the logits) and its "
              "scatter-sum; ours takes the top-k ids and sums the K partials in fp32. " + " ".join(notes))
    experts = packed = peer_w = None  # noqa: F841 - free the weights before the next part
    if S.device == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------- models


def gpt_oss_config(shape: str) -> dict:
    from ops.tools.model_shapes import shape_config

    return shape_config("tiny-gpt-oss" if S.smoke else shape)


def model_costs(model) -> dict:
    """Per-token FLOP (2 x the weights each prefill token multiplies: attention projections, router and ``K``
    experts; the LM head once per sequence) and the bytes of every weight (packed experts included)."""
    cfg = model.config
    dense_flop_params = 0
    dense_bytes = 0
    expert_params = 0
    expert_bytes_all = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.startswith("rope_"):
            continue
        size = t.numel() * t.element_size()
        if ".experts." in name:
            expert_bytes_all += size
            if name.endswith("_blocks"):
                expert_params += t.numel() * 2  # two codes per byte
            continue
        dense_bytes += size
        if "layers." in name and name.endswith("weight") and t.dim() == 2:
            dense_flop_params += t.numel()
    return {
        "flop_per_token": 2 * (dense_flop_params + expert_params * cfg.experts_per_token / cfg.num_experts),
        "lm_head_flop": 2 * model.lm_head.weight.numel(),
        "dense_bytes": dense_bytes,
        "expert_bytes": expert_bytes_all,
        "per_expert_layer_bytes": expert_bytes_all / (cfg.num_experts * cfg.num_layers),
    }


def prefill_floor(model, tokens: int, args) -> tuple[float, float]:
    """(compute floor ms, bytes floor ms) of a batch-one prefill of ``tokens`` tokens."""
    from replicas.kernels.prefill_attention import attention_flops

    cfg = model.config
    c = model_costs(model)
    attn = sum(attention_flops([tokens], [tokens], cfg.num_heads, cfg.head_dim, window=cfg.layer_window(i))
               for i in range(cfg.num_layers))
    flop = c["flop_per_token"] * tokens + c["lm_head_flop"] + attn
    distinct = cfg.num_experts * (1 - (1 - cfg.experts_per_token / cfg.num_experts) ** tokens)
    kv = 2 * cfg.num_layers * tokens * cfg.num_kv_heads * cfg.head_dim * 2
    embed = model.model.embed_tokens.weight
    table = 0 if embed is model.lm_head.weight else embed.numel() * embed.element_size()  # only rows are read
    byt = c["dense_bytes"] - table + distinct * c["per_expert_layer_bytes"] * cfg.num_layers + kv
    return flop / (args.tflops * 1e12) * 1e3, byt / (args.bandwidth_tbps * 1e12) * 1e3


def decode_step_floor(model, c: int, context: int, args) -> float:
    """Bandwidth floor (ms) of one decode step of ``c`` sequences at ``context`` tokens: every dense weight
    once, the expected distinct experts ``c`` tokens route to per layer (uniform routing: random weights),
    each sequence's KV (the window on sliding layers)."""
    cfg = model.config
    costs = model_costs(model)
    distinct = cfg.num_experts * (1 - (1 - cfg.experts_per_token / cfg.num_experts) ** c)
    kv_tokens = sum(min(context, cfg.layer_window(i) or context) for i in range(cfg.num_layers))
    kv = c * 2 * kv_tokens * cfg.num_kv_heads * cfg.head_dim * 2
    embed = model.model.embed_tokens.weight
    table = 0 if embed is model.lm_head.weight else embed.numel() * embed.element_size()  # only rows are read
    byt = costs["dense_bytes"] - table + distinct * costs["per_expert_layer_bytes"] * cfg.num_layers + kv
    return byt / (args.bandwidth_tbps * 1e12) * 1e3


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def ttft_persistent(core, prompt: list[int], cached: list[int] | None = None) -> float:
    """Milliseconds to the first chunk of one greedy request on the persistent lane (the backend is not called:
    one token, the prefill's); ``cached`` gets the prompt tokens the prefix cache served."""
    from replicas.messages import GenerateRequest
    from replicas.persistent.eager import EagerBackend
    from replicas.persistent.lane import PersistentLane
    from replicas.request import SamplingParams

    lane = PersistentLane(core, EagerBackend(core.model, core.runner.device))
    sync()
    t0 = time.perf_counter()
    chunks = list(lane.generate(GenerateRequest("ttft", prompt, SamplingParams(max_tokens=1, temperature=0.0))))
    ms = (time.perf_counter() - t0) * 1e3
    assert chunks and chunks[0].token_ids, chunks
    if cached is not None:
        cached.append(lane.prefix_hit_tokens)
    return ms


def ttft_standard(core, prompt: list[int]) -> float:
    from replicas.engine import LLMEngine
    from replicas.request import SamplingParams
    from replicas.scheduler import SchedulerConfig

    cfg = core.config
    engine = LLMEngine(core, SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, True))
    sync()
    t0 = time.perf_counter()
    engine.add_request("ttft", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        if engine.step():
            break
    ms = (time.perf_counter() - t0) * 1e3
    while engine.has_unfinished():
        engine.step()
    return ms


def _kernel_rows(prof, top: int) -> tuple[float, list[list]]:
    """The CUDA kernels a ``torch.profiler`` run recorded: ``(GPU busy ms, rows)``, rows ``[kernel, launches, ms,
    share of busy]`` for the ``top`` kernels by GPU time (the rest summed in one row). Busy time is the sum of the
    kernels' durations."""
    from torch.autograd import DeviceType

    per: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            slot = per.setdefault(e.name, [0, 0.0])
            slot[0] += 1
            slot[1] += e.time_range.elapsed_us() / 1e3
    busy = sum(v[1] for v in per.values())
    ranked = sorted(per.items(), key=lambda kv: -kv[1][1])
    rows = [[name if len(name) <= 70 else name[:67] + "...", n, ms, ms / busy if busy else float("nan")]
            for name, (n, ms) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        ms = sum(v[1] for _, v in rest)
        rows.append([f"({len(rest)} other kernels)", int(sum(v[0] for _, v in rest)), ms, ms / busy if busy else 0.0])
    return busy, rows


def _profiler():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if S.device == "cuda" else []))


def profile_prefill(core, prompt: list[int], top: int = 14) -> tuple[float, float, list[list]]:
    """One standard-lane prefill of ``prompt`` under ``torch.profiler``: ``(wall ms, GPU busy ms, rows)`` (rows as
    :func:`_kernel_rows`). Busy well below the wall time: the forward is bound by the host (Python and launches);
    close to it, by the GPU."""
    with _profiler() as prof:
        wall = ttft_standard(core, prompt)
        sync()
    busy, rows = _kernel_rows(prof, top)
    return wall, busy, rows


def part_model(rep: Report, args, shape: str) -> None:
    from benchmarks.engine import build_core

    raw = gpt_oss_config(shape)
    sweep = shape == "gpt-oss-120b" and "sweep" not in args.skip
    max_len = max(*S.prompts, S.repeat_prompt) + 256
    per_seq = -(-(S.sweep_prompt + args.new_tokens + 16) // 16)
    blocks = (max(S.concurrency) * per_seq + 2 * -(-max_len // 16) + 64) if sweep else 3 * -(-max_len // 16)
    t0 = time.perf_counter()
    core = build_core(raw, torch.device(S.device), S.dtype, max_len,
                      {"num_kv_blocks": blocks, "max_num_seqs": 256, "max_num_batched_tokens": S.sweep_batched_tokens,
                       "enable_prefix_caching": True, **S.engine})
    invariant = bool(S.engine.get("batch_invariant", False))
    vocab = raw["vocab_size"]
    build_s = time.perf_counter() - t0
    mem = torch.cuda.memory_allocated() / 2**30 if S.device == "cuda" else 0.0
    print(f"{shape}: built in {build_s:.1f} s, {mem:.1f} GiB", flush=True)
    try:
        t0 = time.perf_counter()
        for n in S.warm_prompts:  # compile every tile configuration before timing
            try:
                ttft_persistent(core, random_prompt(vocab, n, seed=n))
            except Exception as exc:  # noqa: BLE001 - reported; that length fails below too
                rep.error(f"{shape}/warm-up {n} tokens", exc)
                if core.model.layered_kernel_forward:  # keep measuring on the layer modules' kernel path
                    core.model.layered_kernel_forward = False
                    rep.note(f"{shape}: kernel forward failed", "forward_kernels raised in the warm-up (see "
                             "errors.txt); everything below ran the layer modules with the prefill kernels")
        warm_s = time.perf_counter() - t0
        rows = []
        for n in S.prompts:
            comp, byt = prefill_floor(core.model, n, args)
            try:
                pers = statistics.median(ttft_persistent(core, random_prompt(vocab, n, 100 + r))
                                         for r in range(args.reps))
                std = statistics.median(ttft_standard(core, random_prompt(vocab, n, 200 + r))
                                        for r in range(args.reps))
                rows.append([n, pers, std, comp, byt, max(comp, byt) / min(pers, std)])
                rep.study("batch_one", [{"shape": shape, "lane": lane, "ttft_ms": ms, "tpot_ms": None,
                                         "prompt_tokens": n, "batch_invariant": invariant}
                                        for lane, ms in (("persistent", pers), ("standard", std))])
            except Exception as exc:  # noqa: BLE001 - the other lengths still run
                rep.error(f"{shape}/TTFT {n} tokens", exc)
                rows.append([n, float("nan"), float("nan"), comp, byt, f"failed: {type(exc).__name__}"])
        rep.table(f"TTFT, batch one, {shape} (random weights), ms",
                  ["prompt", "persistent lane", "standard lane", "compute floor", "bytes floor", "of floor"], rows,
                  f"Median of {args.reps} fresh random prompts (no prefix-cache hits); floor = max(compute at "
                  f"{args.tflops} TFLOP/s, bytes at {args.bandwidth_tbps} TB/s), overlapped. Built in {build_s:.0f} s, "
                  f"warm-up (compiling) {warm_s:.0f} s.")
        for n in S.profile_prompts:
            if rep.left() < 60:
                break
            try:
                wall, busy, prof_rows = profile_prefill(core, random_prompt(vocab, n, 500 + n))
                rep.table(f"Where a {n:,}-token prefill's GPU time goes, {shape} (standard lane, under the profiler)",
                          ["kernel", "launches", "ms", "share of GPU busy"], prof_rows,
                          f"Wall {wall:,.1f} ms under the profiler, GPU busy {busy:,.1f} ms (sum of kernel "
                          f"durations, {busy / wall:.0%} of wall): "
                          + ("the kernels bound the forward." if busy >= 0.8 * wall else
                             "busy well below wall: the host (Python, launches) bounds the forward."))
            except Exception as exc:  # noqa: BLE001
                rep.error(f"{shape}/profile {n} tokens", exc)
        prompt = random_prompt(vocab, S.repeat_prompt, 400)
        hits: list[int] = []
        try:
            times = [ttft_persistent(core, prompt, hits) for _ in range(3)]
        except Exception as exc:  # noqa: BLE001
            rep.error(f"{shape}/repeated prompt", exc)
            times, hits = [float("nan")] * 3, [-1] * 3
        rep.table(f"Persistent lane, repeated {S.repeat_prompt:,}-token prompt, {shape}, prefix caching on",
                  ["request", "TTFT ms", "prompt tokens from the prefix cache"],
                  [["first (cold)", times[0], hits[0]], ["repeat (prefix cached)", times[1], hits[1]],
                   ["repeat again", times[2], hits[2]]],
                  "The repeats prefill only the tokens past the last full cached page (at most 16). The warm-up "
                  "ran a 16-token prefill first: the first forward of at most 16 tokens in a process compiles the "
                  "decode MoE kernels (NVRTC), which a repeat measured before it would pay.")
        if sweep:
            _sweep(rep, args, core, shape, invariant)
    finally:
        del core
        import gc

        gc.collect()
        if S.device == "cuda":
            torch.cuda.empty_cache()


def _sweep(rep: Report, args, core, shape: str = "gpt-oss-120b", invariant: bool = False) -> None:
    graphs = core.runner.graphs
    t0 = time.perf_counter()
    if graphs is not None:
        graphs.capture_all()
    capture_s = time.perf_counter() - t0
    steps: list[tuple[int, int]] = []  # (sequences, tokens) of every forward
    execute = core.runner.execute

    def recording(batch, **kwargs):  # kwargs: input_tokens (async scheduling)
        steps.append((len(batch), sum(n for _, n in batch)))
        return execute(batch, **kwargs)

    core.runner.execute = recording
    rows = []
    last_s = 0.0
    try:
        for c in S.concurrency:
            if rep.left() < max(30.0, 4.5 * last_s):
                rows.append([c] + [float("nan")] * 7 + ["skipped: time budget"])
                continue
            try:
                rows.append(_sweep_one(core, c, args, steps))
            except Exception as exc:  # noqa: BLE001 - reported; larger concurrencies would fail the same way
                rep.error(f"sweep c={c}", exc)
                rows.append([c] + [float("nan")] * 7 + [f"failed: {type(exc).__name__}"])
                break
            last_s = rows[-1][7]
            r = rows[-1]
            rep.study("standard_sweep", [{"shape": shape, "concurrency": c, "decode_step_ms": r[4],
                                          "step_floor_ms": r[5], "output_tok_s": r[1], "itl_median_ms": r[2],
                                          "batch_invariant": invariant, "note": r[8] or None}])
            prof = _profile_decode(rep, core, c, steps) if c in S.profile_concurrency else None
            if prof:
                rep.table(f"Where a {c}-row decode step's GPU time goes, {shape} (standard lane, CUDA graph replay, "
                          "under the profiler)", ["kernel", "launches per step", "ms per step", "share of GPU busy"],
                          prof["rows"], f"{prof['steps']} full decode steps profiled; GPU busy {prof['busy_ms']:.2f} ms "
                          f"per step (sum of kernel durations) against a median step of {r[4]:.2f} ms unprofiled: "
                          "the difference is time the GPU sat idle within the step (launch gaps, host work, "
                          "the token read). With programmatic dependent launch (the engine's pdl, on by default) "
                          "a kernel starts before the one it depends on ends and its recorded time includes "
                          "that wait, so busy can exceed the step; --engine pdl=false attributes time "
                          "exactly.")
    finally:
        core.runner.execute = execute
    failed = sorted(graphs._failed) if graphs else None
    rep.table("Standard lane, gpt-oss-120b (random weights): random 1,024-token prompts, 128 new tokens, greedy",
              ["concurrency", "output tok/s", "ITL median ms", "ITL p99 ms", "decode step ms (all c)",
               "step floor ms", "of floor", "wall s", "note"], rows,
              f"All requests added at once; chunked prefill ({S.sweep_batched_tokens:,} tokens per step) mixed with "
              f"decodes; decode steps replay CUDA graphs (buckets {graphs.batch_sizes if graphs else None}, captured up front in "
              f"{capture_s:.0f} s; failed to capture: {failed}). Step floor: dense weights + the expected distinct "
              f"experts of c tokens (uniform routing) + the KV at the mean context, at {args.bandwidth_tbps} TB/s. "
              "The note gives the median number of distinct token ids the c rows emitted per decode step: a hint, "
              "not a count of experts. Rows that keep emitting the same tokens tend to route alike, so few "
              "distinct tokens would suggest the step reads fewer experts than the floor's uniform routing assumes.")


def _sweep_one(core, c: int, args, steps: list) -> list:
    """One concurrency of the standard-lane sweep; returns its table row."""
    from replicas.engine import LLMEngine
    from replicas.request import SamplingParams
    from replicas.scheduler import SchedulerConfig

    vocab = core.model.config.vocab_size
    engine = LLMEngine(core, SchedulerConfig(256, S.sweep_batched_tokens, True))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    stamps: dict[str, list[float]] = {}
    step_ms: list[float] = []
    distinct: list[int] = []  # distinct token ids among the c rows of each step that gave every row a token
    steps.clear()
    sync()
    t_start = time.perf_counter()
    for i in range(c):
        engine.add_request(f"c{c}-{i}", random_prompt(vocab, S.sweep_prompt, 10_000 * c + i), params)
    while engine.has_unfinished():
        a = time.perf_counter()
        out = engine.step()
        now = time.perf_counter()
        step_ms.append((now - a) * 1e3)
        for chunk in out:
            stamps.setdefault(chunk.request_id, []).append(now)
        if len(out) == c:  # greedy random-weight rows that keep agreeing may route alike (fewer experts read)
            distinct.append(len({chunk.token_ids[0] for chunk in out}))
    dur = time.perf_counter() - t_start
    itl = sorted((b - a) * 1e3 for s in stamps.values() for a, b in zip(s, s[1:], strict=False))
    full = [ms for ms, (b, t) in zip(step_ms, steps, strict=False) if b == c and t == c]
    step = statistics.median(full) if full else float("nan")
    floor = decode_step_floor(core.model, c, S.sweep_prompt + args.new_tokens // 2, args)
    p99 = itl[min(len(itl) - 1, int(0.99 * len(itl)))] if itl else float("nan")
    assert core.allocator.num_free == core.allocator.num_blocks
    note = f"{statistics.median(distinct):.0f} distinct tokens per step" if distinct and c > 1 else ""
    return [c, c * args.new_tokens / dur, statistics.median(itl) if itl else float("nan"), p99, step, floor,
            floor / step if full else float("nan"), dur, note]


def _profile_decode(rep: Report, core, c: int, steps: list, profiled: int = 4) -> dict | None:
    """``c`` fresh requests on a new engine, decoded until eight full decode steps (``c`` rows, one token each)
    have run, then ``profiled`` more under ``torch.profiler``: ``{"steps", "busy_ms", "rows"}``, GPU busy time
    and :func:`_kernel_rows` per step; ``None`` if it failed (reported) or ran out of steps. Separate from the
    timed run, whose numbers the profiler would slow."""
    from replicas.engine import LLMEngine
    from replicas.request import SamplingParams
    from replicas.scheduler import SchedulerConfig

    vocab = core.model.config.vocab_size
    engine = LLMEngine(core, SchedulerConfig(256, S.sweep_batched_tokens, True))
    # the first requests decode while the last prompts are still being prefilled: give them enough tokens to
    # still be running when every request decodes
    prefill_steps = -(-c * S.sweep_prompt // S.sweep_batched_tokens)
    params = SamplingParams(max_tokens=prefill_steps + 8 + profiled + 4, temperature=0.0, ignore_eos=True)
    for i in range(c):
        engine.add_request(f"p{c}-{i}", random_prompt(vocab, S.sweep_prompt, 77_000 * c + i), params)
    steps.clear()
    result = None
    try:
        while engine.has_unfinished() and sum(1 for b, t in steps if b == c and t == c) < 8:
            engine.step()
        first = len(steps)
        sync()
        with _profiler() as prof:
            for _ in range(profiled):
                engine.step()
            sync()
        n = sum(1 for b, t in steps[first:] if b == c and t == c)
        if n == profiled:
            busy, rows = _kernel_rows(prof, 12)
            result = {"steps": n, "busy_ms": busy / n,
                      "rows": [[k, launches / n, ms / n, share] for k, launches, ms, share in rows]}
    except Exception as exc:  # noqa: BLE001 - the sweep's numbers stand without it
        rep.error(f"profile c={c}", exc)
    finally:
        while engine.has_unfinished():
            engine.step()
    return result


# ------------------------------------------------------------------------------------------- tiles


MOE_TILES = {  # tokens -> (block_n, block_k, num_warps, num_stages) tried (120b: 128 experts, top 4)
    64: [(128, 64, 4, 4), (64, 64, 4, 4), (128, 128, 4, 3)],
    128: [(128, 64, 4, 4), (64, 64, 4, 4), (128, 128, 4, 4)],
    1024: [(128, 64, 4, 4), (128, 64, 8, 4), (64, 64, 4, 4), (128, 128, 4, 4)],
    8192: [(128, 64, 4, 4), (128, 64, 8, 4), (128, 64, 4, 5)],
}

ATTN_TILES = [(128, 64, 4, 2), (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)]
"""``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the prefill attention tried at 8,192 tokens."""


def part_tiles(rep: Report, args) -> None:
    """Tile alternatives of the two kernels (for choosing defaults; every result is checked against the
    default tile's)."""
    from replicas.kernels.moe import grouped_gemm as mg

    e, hidden, inter, k = S.moe
    experts = repacked_copy(random_experts(e, hidden, inter, S.dtype, seed=5))
    rows = []
    for t, tiles in MOE_TILES.items():
        if S.smoke:
            t, tiles = 9, tiles[:2]
        if rep.left() < 30:
            break
        g = torch.Generator(device=S.device).manual_seed(t)
        x = torch.randn(t, hidden, generator=g, device=S.device).to(S.dtype)
        top, ids = torch.topk(torch.randn(t, e, generator=g, device=S.device), k, dim=-1)
        w = torch.softmax(top, -1).to(S.dtype)
        bm = mg.pick_block_m(t * k, e)
        want = mg.experts_moe(x, w, ids, experts)
        for bn, bk, warps, stages in tiles:
            tile = mg.TileConfig(bm, bn, bk, warps, stages)
            try:
                ms = cuda_ms(lambda x=x, w=w, i=ids, tile=tile: mg.experts_moe(x, w, i, experts, tile=tile))
                err = rel_err(mg.experts_moe(x, w, ids, experts, tile=tile), want)
                rows.append([f"MoE {t} tokens", f"M{bm} N{bn} K{bk} w{warps} s{stages}", ms, err])
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile
                rows.append([f"MoE {t} tokens", f"M{bm} N{bn} K{bk} w{warps} s{stages}", float("nan"),
                             f"{type(exc).__name__}: {str(exc)[:80]}"])
    if "attention" not in args.skip:
        _attention_tiles(rep, rows)
    rep.table("Tile alternatives (first row of each group: the default), gpt-oss-120b layer shapes",
              ["kernel", "tile", "ms", "rel diff to default"], rows)


def _attention_tiles(rep: Report, rows: list) -> None:
    """Rows of :data:`ATTN_TILES` at 8,192 tokens (each checked against the default tile's output)."""
    from replicas.kernels import prefill_attention as pa
    from replicas.kernels.paged_attention import paged_attention

    n = 40 if S.smoke else 8192
    q, kp, vp, meta = attention_batch([n], [n], seed=9)
    sinks = torch.randn(S.heads[0], device=S.device).to(S.dtype)
    want = paged_attention(q, kp, vp, meta, 0.125, sinks=sinks)
    dev = meta.device_view(q.device)
    for bm, bn, warps, stages in ATTN_TILES[:2] if S.smoke else ATTN_TILES:
        if rep.left() < 15:
            break
        config = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        block_t = pa.tokens_per_tile(q.shape[1], kp.shape[2], bm)  # the tile map depends on BLOCK_M
        num_tiles = pa.num_tiles_for(meta.query_lens, block_t)
        tiles = pa.tile_map(dev.query_start, block_t, num_tiles)

        def call(config=config, num_tiles=num_tiles, tiles=tiles):
            return pa.triton_prefill_attention(q, kp, vp, dev.query_start, dev.context_lens, dev.block_table,
                                               0.125, num_tiles, sinks=sinks, tiles=tiles, config=config)

        try:
            ms = cuda_ms(call)
            rows.append([f"attention {n} tokens", f"M{bm} N{bn} w{warps} s{stages}", ms, rel_err(call(), want)])
        except Exception as exc:  # noqa: BLE001
            rows.append([f"attention {n} tokens", f"M{bm} N{bn} w{warps} s{stages}", float("nan"),
                         f"{type(exc).__name__}: {str(exc)[:80]}"])


# ------------------------------------------------------------------------------------------- lanes


def lanes_agreement(dtype=torch.float32, prompts_n: int = 20, tokens: int = 128, concurrency: int = 64,
                    batch_invariant: bool = False) -> dict:
    """Greedy tokens of a small random GPT-OSS: the standard lane (all prompts at once; new prefill kernels,
    decode graphs past 16 sequences) against the persistent lane (``cuda_graph`` backend), and the standard
    lane at ``concurrency`` against the same requests one at a time. Returns the counts."""
    from benchmarks.engine import build_core
    from ops.tools.make_tiny_gpt_oss import real_config

    core = build_core({**real_config("20b"), **SMALL_GPT_OSS}, torch.device(S.device), dtype, 512,
                      {"num_kv_blocks": concurrency * 32 + 64, "max_num_seqs": 256,
                       "batch_invariant": batch_invariant})
    core.model.lm_head.weight.data.mul_(20)  # spread the random logits: wide argmax margins
    prompts = fixtures.random_prompts(SMALL_GPT_OSS["vocab_size"], max(prompts_n, concurrency))
    together = fixtures.standard_greedy(core, prompts[:prompts_n], tokens)
    persistent = fixtures.persistent_greedy(core, prompts[:prompts_n], tokens)
    many = fixtures.standard_greedy(core, prompts[:concurrency], tokens)
    alone = [fixtures.standard_greedy(core, [p], tokens)[0] for p in prompts[:concurrency]]
    graphs = core.runner.graphs
    return {
        "persistent_vs_standard": sum(a == b for a, b in zip(persistent, together, strict=True)),
        "prompts": prompts_n,
        "concurrent_vs_alone": sum(a == b for a, b in zip(many, alone, strict=True)),
        "concurrency": concurrency,
        "graph_buckets_used": sorted(graphs._graphs) if graphs else [],
        "first_divergence": [next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                             for a, b in zip(many, alone, strict=True) if a != b][:8],
    }


def part_lanes(rep: Report, args) -> None:
    rows = []
    n, tokens, c = S.lanes
    runs = [(torch.float32, False)] if S.smoke else [(torch.float32, False), (torch.bfloat16, False),
                                                      (torch.bfloat16, True)]
    for dtype, invariant in runs:
        name = str(dtype).removeprefix("torch.") + (" batch_invariant" if invariant else "")
        if rep.left() < 40:
            rows.append([name, "skipped: time budget", "", "", ""])
            continue
        r = lanes_agreement(dtype, n, tokens, c, batch_invariant=invariant)
        rows.append([name, f"{r['persistent_vs_standard']}/{r['prompts']}",
                     f"{r['concurrent_vs_alone']}/{r['concurrency']}", str(r["graph_buckets_used"]),
                     str(r["first_divergence"])])
        shape = f"small random GPT-OSS, {tokens} tokens"
        rep.study("lane_agreement", [
            {"check": "persistent == standard", "dtype": name, "shape": shape,
             "identical": r["persistent_vs_standard"], "total": r["prompts"]},
            {"check": f"standard c={c} == one at a time", "dtype": name, "shape": shape,
             "identical": r["concurrent_vs_alone"], "total": r["concurrency"]}])
    rep.table(f"Lane agreement: small random GPT-OSS (hidden 256, 16 experts, sinks, window), {tokens} greedy tokens",
              ["dtype", f"persistent == standard ({n} prompts)", f"standard c={c} == one at a time",
               "decode graph buckets used", "first differing token (c=64 vs alone)"], rows)


# ------------------------------------------------------------------------------------------- transformers


def part_hf(rep: Report, args) -> None:
    import transformers

    from benchmarks.engine import hf_model, time_hf

    raw = gpt_oss_config("gpt-oss-20b")
    t0 = time.perf_counter()
    model = hf_model(raw, torch.device(S.device), S.dtype)
    build_s = time.perf_counter() - t0
    rows = []
    try:
        for n in S.prompts:
            if rep.left() < 45:
                rows.append([n, float("nan"), float("nan"), "skipped: time budget"])
                continue
            prompt = random_prompt(raw["vocab_size"], n, 300 + n)
            cells: list = [n]
            for static in (False, True):
                try:
                    cells.append(time_hf(model, torch.device(S.device), prompt, 2, args.reps, static)[0])
                except Exception as exc:  # noqa: BLE001 - out of memory at 8,192, a version without the path
                    rep.error(f"hf/TTFT {n} tokens static={static}", exc)
                    cells.append(float("nan"))
            rows.append(cells + [""])
    finally:
        del model
        import gc

        gc.collect()
        if S.device == "cuda":
            torch.cuda.empty_cache()
    rep.table("TTFT, batch one, gpt-oss-20b shape, transformers (random bf16 weights, experts dense), ms",
              ["prompt", "transformers, dynamic cache", "transformers, static cache", "note"], rows,
              f"transformers {transformers.__version__}; `generate` of one greedy token (`benchmarks.engine.time_hf`), "
              f"median of {args.reps} after an untimed call per length; built in {build_s:.0f} s. The static cache is what transformers "
              "compiles (its decode forward); the first token is its prefill either way. Ours: the gpt-oss-20b "
              "table of the same call.")


# ------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> Report | None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_prefill_out"), help="results folder (default $OUT)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    p.add_argument("--skip", default="", help="sub-parts to leave out: sweep, attention (of tiles)")
    p.add_argument("--triton-kernels", help="folder holding OpenAI's triton_kernels package (vLLM's copy)")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting new work after this many seconds")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--bandwidth-tbps", type=float, default=4.8, help="HBM bandwidth for the floors (H200: 4.8)")
    p.add_argument("--tflops", type=float, default=790.0, help="dense bf16 TFLOP/s for the floors (H200, measured)")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                   help="engine config field for the model parts (repeatable; numbers, booleans and JSON objects "
                        "are parsed), e.g. batch_invariant=true or moe_tiles='{\"tokens_per_chunk\": 16}'")
    p.add_argument("--concurrency", type=lambda v: tuple(int(c) for c in v.split(",")), default=None,
                   help="the standard-lane sweep's concurrencies, comma-separated (default 1,8,16,64,256; the KV "
                        "cache is sized for the largest: on an 80 GB card gpt-oss-120b fits up to 64)")
    p.add_argument("--profile-concurrency", type=lambda v: tuple(int(c) for c in v.split(",") if c), default=None,
                   help="the sweep's concurrencies whose decode step is also profiled, in a separate short run "
                        "(default 1,8,64,256; '' for none)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, Triton's interpreter, tiny shapes: checks that the script runs (numbers meaningless)")
    args = p.parse_args(argv)
    S.engine = {k: json.loads(v.lower() if v.lower() in ("true", "false") else v) if v[:1].isdigit() or
                v[:1] == "{" or v.lower() in ("true", "false") else v for k, v in (kv.split("=", 1) for kv in args.engine)}
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        S.make_smoke()
        args.new_tokens = min(args.new_tokens, 4)
    elif not torch.cuda.is_available():
        raise SystemExit("benchmarks.prefill needs a CUDA GPU (or --smoke)")
    if args.concurrency:
        S.concurrency = args.concurrency
    if args.profile_concurrency is not None:
        S.profile_concurrency = args.profile_concurrency
    rep = Report(Path(args.out), argv, args.budget_s)
    runners = {"kernels": part_kernels, "lanes": part_lanes, "tiles": part_tiles,
               "hf": part_hf,
               "gpt-oss-120b": lambda r, a: part_model(r, a, "gpt-oss-120b"),
               "gpt-oss-20b": lambda r, a: part_model(r, a, "gpt-oss-20b")}
    for part in [x.strip() for x in args.parts.split(",") if x.strip()]:
        if part not in runners:
            raise SystemExit(f"unknown part {part!r}; choose from {', '.join(PARTS)}")
        if rep.left() < 20:
            rep.note(f"{part}: skipped", f"not started: {rep.left():.0f} s of the time budget left")
            continue
        t0 = time.perf_counter()
        print(f"\n=== {part} ({rep.left():.0f} s left)", flush=True)
        try:
            runners[part](rep, args)
        except Exception as exc:  # noqa: BLE001 - the other parts still run
            rep.error(part, exc)
        finally:
            if S.device == "cuda":
                torch.cuda.empty_cache()
        print(f"=== {part} took {time.perf_counter() - t0:.0f} s", flush=True)
    print("\n\n" + rep.markdown(), flush=True)
    if rep.errors:
        print(f"\n{len(rep.errors)} part(s) failed: see {rep.out / 'errors.txt'}", flush=True)
    return rep


if __name__ == "__main__":
    main()
