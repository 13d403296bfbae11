"""Engine benchmark: batch-one TTFT and TPOT of our lanes against transformers, on one device.

No Ray: the engine parts are built directly. For each model shape (random
weights generated on the device), one request with a ``--prompt-len`` token
prompt generates ``--new-tokens`` tokens (EOS ignored) on:

* ``persistent/cuda_graph`` — our persistent lane, quanta replayed from CUDA graphs;
* ``persistent/eager`` — our persistent lane, reference backend;
* ``standard`` — our continuous-batching lane at batch one;
* ``hf/eager`` — transformers ``generate`` (same shape, its own random weights);
* ``hf/static+compile`` — transformers with ``cache_implementation="static"``
  (transformers compiles the forward itself), when ``--hf-compile``.

TTFT = time to the first token; TPOT = (time to the last token − TTFT) /
(tokens − 1). Bytes per token = weights read + KV read at the mean context;
the floor is that over the HBM bandwidth (``--bandwidth-tbps``, H200: 4.8).

Usage (H200): ``python -m ops.bench_engine --write-docs``;
CPU smoke run: ``python -m ops.bench_engine --device cpu --tiny``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SMOLLM2_135M = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": 1,
}
"""SmolLM2-135M-Instruct's architecture (its config.json, HF model card)."""

TINY = {**SMOLLM2_135M, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


@dataclass
class Row:
    shape: str
    lane: str
    ttft_ms: float
    tpot_ms: float
    bytes_per_token: float
    floor_ms: float
    kernels_per_token: float | None = None

    @property
    def fraction_of_floor(self) -> float:
        return self.floor_ms / self.tpot_ms if self.tpot_ms else 0.0


class _NullTokenizer:
    """Stands in for a tokenizer when none is available: the benchmark measures token ids, not text."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def build_core(raw_cfg: dict, device: torch.device, dtype: torch.dtype, max_model_len: int, tokenizer=None):
    """An :class:`EngineCore` over a randomly initialised Llama-family model (std 0.02), on ``device``."""
    from replicas.config import EngineConfig
    from replicas.engine import EngineCore
    from replicas.kv_cache import KVCache, PageAllocator
    from replicas.model_runner import ModelRunner
    from replicas.models.config import ModelConfig
    from replicas.models.llama import LlamaForCausalLM, rope_tables

    cfg = ModelConfig.from_dict(raw_cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.normal_(p, std=0.02)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    cos, sin = rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    model.eval()
    ecfg = EngineConfig(model="random", device=str(device), dtype=str(dtype).removeprefix("torch."),
                        max_model_len=max_model_len, num_kv_blocks=2 * -(-max_model_len // 16) + 8,
                        enable_prefix_caching=False, progress=False)
    kv = KVCache(cfg, ecfg.resolved_num_kv_blocks(), dtype, device)
    return EngineCore(config=ecfg, model=model, tokenizer=tokenizer or _NullTokenizer(), kv_cache=kv,
                      allocator=PageAllocator(kv.num_blocks), runner=ModelRunner(model, kv.planes(), device),
                      eos_token_ids=frozenset(cfg.eos_token_ids))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_persistent(core, backend, prompt: list[int], new_tokens: int, reps: int) -> tuple[float, float]:
    """Median (TTFT, TPOT) in ms of one request through a :class:`PersistentLane` with ``backend``."""
    from replicas.messages import GenerateRequest
    from replicas.persistent.lane import PersistentLane
    from replicas.request import SamplingParams

    lane = PersistentLane(core, backend)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ttfts, tpots = [], []
    for rep in range(reps + 1):
        _sync(core.runner.device)
        t0 = time.perf_counter()
        stamps, n = [], 0
        for chunk in lane.generate(GenerateRequest(f"b{rep}", prompt, params)):
            n += len(chunk.token_ids)
            stamps.append(time.perf_counter())
        assert n == new_tokens, n
        if rep:  # rep 0 warms up
            ttfts.append((stamps[0] - t0) * 1e3)
            tpots.append((stamps[-1] - stamps[0]) * 1e3 / (new_tokens - 1))
    return statistics.median(ttfts), statistics.median(tpots)


def time_standard(core, prompt: list[int], new_tokens: int, reps: int) -> tuple[float, float]:
    """Median (TTFT, TPOT) in ms of one request alone on our standard lane."""
    from replicas.engine import LLMEngine
    from replicas.request import SamplingParams

    engine = LLMEngine(core)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ttfts, tpots = [], []
    for rep in range(reps + 1):
        _sync(core.runner.device)
        t0 = time.perf_counter()
        engine.add_request(f"s{rep}", prompt, params)
        stamps = []
        while engine.has_unfinished():
            if engine.step():
                stamps.append(time.perf_counter())
        if rep:
            ttfts.append((stamps[0] - t0) * 1e3)
            tpots.append((stamps[-1] - stamps[0]) * 1e3 / (new_tokens - 1))
    return statistics.median(ttfts), statistics.median(tpots)


def time_hf(raw_cfg: dict, device, dtype, prompt: list[int], new_tokens: int, reps: int, compile_: bool):
    """Median (TTFT, TPOT) in ms of transformers ``generate`` (greedy) on a same-shape random model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(**{k: v for k, v in raw_cfg.items() if k != "model_type"})
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_cfg).to(device=device, dtype=dtype).eval()
    if compile_:
        model.generation_config.cache_implementation = "static"
    ids = torch.tensor([prompt], device=device)
    kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}

    def run(n):
        _sync(device)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync(device)
        return (time.perf_counter() - t) * 1e3

    run(new_tokens)  # warm-up (and compilation)
    ttft = statistics.median(run(1) for _ in range(reps))
    full = statistics.median(run(new_tokens) for _ in range(reps))
    return ttft, (full - ttft) / (new_tokens - 1)


def count_kernels_per_token(backend) -> int | None:
    """CUDA kernels one static decode step launches (profiled eagerly, outside the graph)."""
    if backend.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        backend._body(1)
        torch.cuda.synchronize(backend.device)
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def kernel_breakdown(backend, context: int) -> tuple[list[tuple[str, int, float]], float, float]:
    """Where one decode step's GPU time goes, and the host gap of a quantum.

    Profiles one step of the (compiled) static body at ``context`` tokens and
    groups CUDA kernels by name. Also times an 8-step graph replay with CUDA
    events (GPU time) against the wall clock of the same replay plus its read-back.

    Returns:
        ``[(kernel, count, total_us)]`` sorted by time, GPU ms per 8-step quantum,
        wall ms per 8-step quantum.
    """
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    b = backend.buffers
    b.position.fill_(context)
    b.block_table.copy_(torch.arange(backend.max_blocks, device=backend.device))
    backend._body(1)
    torch.cuda.synchronize(backend.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        b.position.fill_(context)
        backend._body(1)
        torch.cuda.synchronize(backend.device)
    groups: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            groups[e.name[:60]].append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
    rows = sorted(((k, len(v), sum(v)) for k, v in groups.items()), key=lambda r: -r[2])
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    walls, gpus = [], []
    for _ in range(20):
        b.position.fill_(context)
        torch.cuda.synchronize(backend.device)
        t = time.perf_counter()
        start.record()
        backend._graphs[8].replay()
        stop.record()
        torch.cat([b.out_tokens, b.count]).tolist()
        walls.append((time.perf_counter() - t) * 1e3)
        gpus.append(start.elapsed_time(stop))
    return rows, statistics.median(gpus), statistics.median(walls)


def bytes_per_token(core, context: int) -> float:
    """Weights read once (tied embeddings counted once) + K and V of ``context`` tokens in every layer."""
    params = {id(p): p for p in core.model.parameters()}
    weights = sum(p.numel() * p.element_size() for p in params.values())
    cfg = core.model.config
    kv = 2 * cfg.num_layers * context * cfg.num_kv_heads * cfg.head_dim * core.kv_cache.tensor.element_size()
    return float(weights + kv)


def run(args) -> list[Row]:
    from replicas.persistent.cuda_graph import CudaGraphBackend
    from replicas.persistent.eager import EagerBackend

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shapes = {"tiny": TINY} if args.tiny else {"smollm2-135m": SMOLLM2_135M}
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    rows: list[Row] = []
    for shape, raw in shapes.items():
        max_len = args.prompt_len + args.new_tokens + 16
        core = build_core(raw, device, dtype, max_len, tokenizer)
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(3, raw["vocab_size"], (args.prompt_len,), generator=g).tolist()
        bpt = bytes_per_token(core, args.prompt_len + args.new_tokens // 2)
        floor = bpt / (args.bandwidth_tbps * 1e12) * 1e3

        def row(lane, ttft, tpot, kernels=None, shape=shape, bpt=bpt, floor=floor):
            rows.append(Row(shape, lane, ttft, tpot, bpt, floor, kernels))
            print(f"  {shape:14s} {lane:22s} TTFT {ttft:8.2f} ms  TPOT {tpot:8.3f} ms", flush=True)

        graph = CudaGraphBackend(core.model, device, max_len)
        row("persistent/cuda_graph", *time_persistent(core, graph, prompt, args.new_tokens, args.reps),
            count_kernels_per_token(graph))
        row("persistent/eager", *time_persistent(core, EagerBackend(core.model, device), prompt,
                                                 args.new_tokens, args.reps))
        row("standard", *time_standard(core, prompt, args.new_tokens, args.reps))
        if not args.no_hf:
            row("hf/eager", *time_hf(raw, device, dtype, prompt, args.new_tokens, args.reps, False))
            if args.hf_compile:
                row("hf/static+compile", *time_hf(raw, device, dtype, prompt, args.new_tokens, args.reps, True))
        del core
    return rows


def table(rows: list[Row]) -> str:
    head = ("| shape | lane | TTFT ms | TPOT ms | MB/token | floor ms | of floor | kernels/token |\n"
            "|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r.shape} | {r.lane} | {r.ttft_ms:.2f} | {r.tpot_ms:.3f} | {r.bytes_per_token / 1e6:.1f} | "
        f"{r.floor_ms:.4f} | {r.fraction_of_floor:.1%} | {r.kernels_per_token if r.kernels_per_token else ''} |\n"
        for r in rows)
    return head + body


def machine() -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "CPU"
    import transformers

    return f"{gpu}; torch {torch.__version__}; transformers {transformers.__version__}; {time.strftime('%Y-%m-%d')}"


def main(argv: list[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bandwidth-tbps", type=float, default=4.8, help="HBM bandwidth for the floor (H200: 4.8)")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama shape (CPU smoke run)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peers")
    p.add_argument("--hf-compile", action="store_true", help="also time transformers static cache + compile")
    p.add_argument("--tokenizer", help="tokenizer directory (detokenize like a server would)")
    p.add_argument("--profile", action="store_true",
                   help="only the cuda_graph lane: per-kernel breakdown of one decode step and the host gap")
    p.add_argument("--json", help="write rows as JSON here")
    p.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = p.parse_args(argv)
    if args.profile:
        return profile_main(args)
    rows = run(args)
    text = table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    if args.write_docs:
        write_docs(text, args)
    print("\n" + text)
    return rows


def profile_main(args) -> list:
    """``--profile``: print (and with ``--write-docs`` record) where a decode step's time goes."""
    from replicas.persistent.contract import CacheBinding
    from replicas.persistent.cuda_graph import CudaGraphBackend

    device = torch.device(args.device)
    if device.type != "cuda":
        raise SystemExit("--profile needs a CUDA device (it profiles CUDA kernels and graph replays)")
    max_len = args.prompt_len + args.new_tokens + 16
    core = build_core(TINY if args.tiny else SMOLLM2_135M, device, getattr(torch, args.dtype), max_len)
    backend = CudaGraphBackend(core.model, device, max_len)
    backend.bind_cache(CacheBinding.from_kv_tensor(core.kv_cache.tensor))
    rows, gpu_ms, wall_ms = kernel_breakdown(backend, args.prompt_len + args.new_tokens // 2)
    total = sum(r[2] for r in rows)
    lines = ["| kernel | launches/step | µs/step | share |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {n} | {t:.1f} | {t / total:.1%} |" for k, n, t in rows[:15]]
    lines.append(f"| (all {sum(r[1] for r in rows)} launches) | | {total:.1f} | |")
    text = "\n".join(lines) + (
        f"\n\n8-step quantum: GPU {gpu_ms:.3f} ms (CUDA events around the graph replay), "
        f"wall {wall_ms:.3f} ms with the read-back: host gap {wall_ms - gpu_ms:.3f} ms per quantum.\n")
    print(text)
    if args.write_docs:
        write_docs(text, args, marker="bench_profile", title="Where a decode step's time goes (`--profile`)",
                   command="python -m ops.bench_engine --profile")
    return rows


def write_docs(text: str, args, marker: str = "bench_engine", title: str = "Engine, batch one (`ops/bench_engine.py`)",
               command: str | None = None) -> None:
    path = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    command = command or (f"python -m ops.bench_engine --prompt-len {args.prompt_len} --new-tokens "
                          f"{args.new_tokens} --reps {args.reps}{' --hf-compile' if args.hf_compile else ''}")
    section = f"{start}\n## {title}\n\nCommand: `{command}`\nMachine: {machine()}\n\n{text}\n{end}"
    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    if start in doc:
        doc = doc[: doc.index(start)] + section + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip() + "\n\n" + section + "\n"
    path.write_text(doc)


if __name__ == "__main__":
    main()
