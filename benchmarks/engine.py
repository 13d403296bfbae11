"""Engine benchmark: batch-one TTFT and TPOT of our lanes against transformers, on one device.

No Ray: each engine core is built as a replica builds it (``EngineCore.load``; random weights through
``load_format=dummy``), and each ``--variants`` setting builds its own model. For each model shape
(``--shapes``: SmolLM2-135M with its real weights when ``--smollm2`` points at
its GGUF or HF directory, else random ones; GPT-OSS-20b and -120b with random
weights generated on the device, experts packed MXFP4 as in the released
checkpoints), one request with a ``--prompt-len`` token prompt generates
``--new-tokens`` tokens (EOS ignored) on:

* ``persistent/cuda_graph`` — our persistent lane, quanta replayed from CUDA graphs;
* ``persistent/eager`` — our persistent lane, reference backend;
* ``standard`` — our continuous-batching lane at batch one (its decode steps replay
  per-batch-size CUDA graphs on a GPU: :mod:`replicas.decode_graphs`);
* ``hf/eager`` — transformers ``generate`` (same shape, its own random bf16
  weights; GPT-OSS experts dense bf16, so 120b does not fit one GPU and is skipped);
* ``hf/static+compile`` — transformers with ``cache_implementation="static"``
  (transformers compiles the forward itself), when ``--hf-compile``.

The slow lanes (our eager/standard lanes and the peers) generate
``--slow-new-tokens`` tokens for the GPT-OSS shapes to bound the run time; the
table's ``tokens`` column says how many each TPOT is over.

TTFT = time to the first token; TPOT = (time to the last token − TTFT) /
(tokens − 1). Bytes per token = weights read for one token (every dense
weight, the LM head once, one embedding row ignored, and for MoE layers only
the ``K`` routed experts of ``E``) + the KV read at the mean context (window-
limited on sliding layers); the floor is that over the HBM bandwidth
(``--bandwidth-tbps``, H200: 4.8).

Usage (H200): ``python -m benchmarks.engine --hf-compile --smollm2 PATH --results benchmarks/results``
(``--profile`` adds the per-kernel breakdown of the last shape);
CPU smoke run: ``python -m benchmarks.engine --device cpu --tiny``.
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

from ops.tools.model_shapes import SHAPES, shape_config, write_config_dir


@dataclass
class Row:
    shape: str
    lane: str
    ttft_ms: float
    tpot_ms: float
    bytes_per_token: float
    floor_ms: float
    kernels_per_token: float | None = None
    tokens: int = 0
    note: str = ""

    @property
    def fraction_of_floor(self) -> float:
        return self.floor_ms / self.tpot_ms if self.tpot_ms else 0.0


def build_core(shape: str | dict, device: torch.device, dtype: torch.dtype, max_model_len: int,
               overrides: dict | None = None, smollm2: str | None = None):
    """An :class:`~replicas.engine.EngineCore` built the way a replica builds one (:meth:`EngineCore.load`):
    ``load_format=dummy`` over a directory holding ``shape``'s ``config.json`` (a name of
    :mod:`ops.tools.model_shapes` or a config dict; random weights generated
    on ``device``; GPT-OSS experts random packed MXFP4), or the real SmolLM2 weights at ``smollm2``.

    ``overrides``: engine config fields (the ``--variants`` settings: kernels, pipelining, ...). The KV
    cache holds two ``max_model_len`` sequences; prefix caching is off (every rep prefills).

    Raises:
        pydantic.ValidationError: an unknown or bad override.
    """
    import tempfile

    from replicas.config import EngineConfig
    from replicas.engine import EngineCore

    settings = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "max_model_len": max_model_len,
                "num_kv_blocks": 2 * -(-max_model_len // 16) + 8, "enable_prefix_caching": False, "progress": False,
                **(overrides or {})}
    if smollm2:
        return EngineCore.load(EngineConfig(model=smollm2, **settings))
    with tempfile.TemporaryDirectory() as tmp:
        return EngineCore.load(EngineConfig(model=str(write_config_dir(shape, tmp)), load_format="dummy", **settings))


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


def direct_records(core, lane: str, prompts: list[list[int]], new_tokens: int, concurrency: int = 1,
                   backend=None) -> list:
    """Per-request timings of ``prompts`` served by our lanes directly (no Ray, no HTTP), measured as
    ``benchmarks.serve`` measures them through the server, for a Serve-vs-engine comparison.

    ``lane="persistent"``: one request at a time through a :class:`PersistentLane` with ``backend``
    (default ``cuda_graph``); ``"standard"``: an :class:`LLMEngine` keeping ``concurrency`` requests in
    flight (a new one is added as soon as one finishes, like the benchmark client's semaphore). Every
    request makes exactly ``new_tokens`` tokens (EOS ignored). TTFT = add → first chunk; ITL = gaps
    between a request's chunks (a quantum is one chunk); E2EL = add → last chunk.

    Returns:
        ``benchmarks.serve.RequestRecord`` per prompt, in order (times in seconds).
    """
    from benchmarks.serve import RequestRecord
    from replicas.engine import LLMEngine
    from replicas.messages import GenerateRequest
    from replicas.persistent.factory import create_backend
    from replicas.persistent.lane import PersistentLane
    from replicas.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    records = [RequestRecord(lane=lane, prompt_tokens=len(p)) for p in prompts]
    device = core.runner.device
    if lane == "persistent":
        lane_ = PersistentLane(core, backend or create_backend("cuda_graph", core))
        for i, p in enumerate(prompts):
            _sync(device)
            t0 = last = time.perf_counter()
            rec = records[i]
            for chunk in lane_.generate(GenerateRequest(f"d{i}", p, params)):
                now = time.perf_counter()
                if rec.ttft is None:
                    rec.ttft = now - t0
                else:
                    rec.itl.append(now - last)
                last = now
                rec.output_tokens += len(chunk.token_ids)
            rec.e2el, rec.ok = last - t0, rec.output_tokens == new_tokens
        return records
    engine = LLMEngine(core)
    start: dict[str, float] = {}
    last: dict[str, float] = {}
    queue = list(range(len(prompts)))

    def add() -> None:
        i = queue.pop(0)
        start[f"d{i}"] = last[f"d{i}"] = time.perf_counter()
        engine.add_request(f"d{i}", prompts[i], params)

    _sync(device)
    for _ in range(min(concurrency, len(queue))):
        add()
    while engine.has_unfinished():
        chunks = engine.step()
        now = time.perf_counter()
        for ch in chunks:
            rec = records[int(ch.request_id[1:])]
            if rec.ttft is None:
                rec.ttft = now - start[ch.request_id]
            else:
                rec.itl.append(now - last[ch.request_id])
            last[ch.request_id] = now
            rec.output_tokens += len(ch.token_ids)
            if ch.finish_reason is not None:
                rec.e2el, rec.ok = now - start[ch.request_id], True
                if queue:
                    add()
    return records


def hf_model(raw_cfg: dict, device, dtype):
    """transformers' model for ``raw_cfg`` (Llama or GPT-OSS; experts dense), random weights, on ``device``."""
    import transformers

    torch.manual_seed(0)
    if raw_cfg["model_type"] == "gpt_oss":
        kwargs = {k: v for k, v in raw_cfg.items() if k not in ("model_type", "quantization_config")}
        cfg, cls = transformers.GptOssConfig(**kwargs), transformers.GptOssForCausalLM
    else:
        cfg = transformers.LlamaConfig(**{k: v for k, v in raw_cfg.items() if k != "model_type"})
        cls = transformers.LlamaForCausalLM
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype directly (20b dense experts: 42 GB in bf16)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def time_hf(model, device, prompt: list[int], new_tokens: int, reps: int, compile_: bool):
    """Median (TTFT, TPOT) in ms of transformers ``generate`` (greedy) on ``model``."""
    if compile_:
        model.generation_config.cache_implementation = "static"
    else:
        model.generation_config.cache_implementation = None
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


def bytes_per_token(model, context: int, kv_dtype_bytes: int) -> float:
    """HBM bytes one decode token reads at ``context`` tokens: weights + KV.

    Every parameter and packed buffer once (tied embeddings once, as the LM head), except the
    embedding table (one row is read) and MoE experts (only ``K`` of ``E``: the routed ones);
    K and V of ``context`` tokens in every layer (at most the window on sliding layers).
    """
    cfg = model.config
    tensors = {id(t): (n, t) for n, t in [*model.named_parameters(), *model.named_buffers()]
               if not n.startswith("rope_")}
    embed = model.model.embed_tokens.weight
    total = 0.0
    for name, t in tensors.values():
        size = t.numel() * t.element_size()
        if t is embed and embed is not model.lm_head.weight:
            continue
        if ".experts." in name:
            size *= cfg.experts_per_token / cfg.num_experts
        total += size
    for layer in model.model.layers:
        window = getattr(layer.self_attn, "sliding_window", None)
        tokens = min(context, window) if window else context
        total += 2 * tokens * cfg.num_kv_heads * cfg.head_dim * kv_dtype_bytes
    return total


def run(args) -> list[Row]:
    from replicas.persistent.factory import create_backend

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows: list[Row] = []
    variants = [parse_variant(v) for v in args.variants.split(";")] if args.variants else []
    for shape in args.shapes.split(","):
        raw = shape_config(shape)
        gpt_oss = raw["model_type"] == "gpt_oss"
        slow_tokens = min(args.slow_new_tokens, args.new_tokens) if gpt_oss else args.new_tokens
        max_len = args.prompt_len + args.new_tokens + 16
        real = shape == "smollm2-135m" and args.smollm2
        label = shape + (" (real weights)" if real else "")
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(3, raw["vocab_size"], (args.prompt_len,), generator=g).tolist()
        for i, overrides in enumerate([{}] + variants):
            t0 = time.perf_counter()
            core = build_core(shape, device, dtype, max_len, overrides, smollm2=args.smollm2 if real else None)
            print(f"{label}{' ' + describe_variant(overrides) if overrides else ''}: built in "
                  f"{time.perf_counter() - t0:.1f} s; kernels {core.describe_kernels()}", flush=True)
            bpt = bytes_per_token(core.model, args.prompt_len + args.new_tokens // 2, core.kv_cache.tensor.element_size())
            floor = bpt / (args.bandwidth_tbps * 1e12) * 1e3

            def row(lane, timing, tokens, kernels=None, note="", label=label, bpt=bpt, floor=floor):
                ttft, tpot = timing
                rows.append(Row(label, lane, ttft, tpot, bpt, floor, kernels, tokens, note))
                print(f"  {label:28s} {lane:22s} TTFT {ttft:8.2f} ms  TPOT {tpot:8.3f} ms  ({tokens} tokens)",
                      flush=True)

            graph = create_backend("cuda_graph", core)
            lane = "persistent/cuda_graph" + (f" ({describe_variant(overrides)})" if overrides else "")
            row(lane, time_persistent(core, graph, prompt, args.new_tokens, args.reps), args.new_tokens,
                count_kernels_per_token(graph))
            if args.profile and shape == (args.profile_shape or args.shapes.split(",")[-1]):
                profile_rows(graph, args.prompt_len + args.new_tokens // 2,
                             label + (f" ({describe_variant(overrides)})" if overrides else ""), args)
            del graph
            if i == 0 and "persistent/eager" not in args.skip_lanes:
                row("persistent/eager", time_persistent(core, create_backend("eager", core), prompt, slow_tokens,
                                                        1 if gpt_oss else args.reps), slow_tokens)
            if i == 0 and "standard" not in args.skip_lanes:
                row("standard", time_standard(core, prompt, slow_tokens, 1 if gpt_oss else args.reps), slow_tokens)
            del core
            _free(device)
            if args.results:  # after every build, so that a run cut short still leaves its numbers
                _save(rows, args)
        if args.no_hf or (gpt_oss and raw["num_local_experts"] > 32 and not args.hf_120b):
            continue
        try:
            hf = hf_model(raw, device, dtype)
        except Exception as exc:  # noqa: BLE001 - out of memory, or a transformers version without the model
            print(f"  transformers {shape}: not run ({type(exc).__name__}: {str(exc)[:120]})")
            continue
        for compile_ in (False, True) if args.hf_compile else (False,):
            lane = "hf/static+compile" if compile_ else "hf/eager"
            try:
                row(lane, time_hf(hf, device, prompt, slow_tokens, 1 if gpt_oss else args.reps, compile_),
                    slow_tokens, note="random weights" if real else "")
            except Exception as exc:  # noqa: BLE001 - a peer failing is reported, not fatal
                print(f"  {lane} failed: {type(exc).__name__}: {str(exc)[:200]}")
                rows.append(Row(label, lane, float("nan"), float("nan"), bpt, floor, None, 0,
                                f"failed: {type(exc).__name__}"))
            if args.results:
                _save(rows, args)
        del hf
        _free(device)
    return rows


def parse_variant(spec: str) -> dict:
    """``"pipeline_quanta=0 moe_backend=triton_tc moe_tiles=pairs:2+stages:1"`` → engine config overrides
    (space-separated ``field=value``; ``moe_tiles`` as ``name:int`` joined by ``+``), checked against
    :class:`~replicas.config.EngineConfig` at once.

    Raises:
        ValueError: a malformed item, an unknown field or a bad value.
    """
    from pydantic import ValidationError

    from replicas.config import EngineConfig

    overrides: dict = {}
    for item in spec.split():
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--variants: bad setting {item!r} (expected field=value)")
        if name == "moe_tiles":
            overrides[name] = {k: int(n) for k, _, n in (t.partition(":") for t in value.split("+") if t)}
        else:
            overrides[name] = value
    try:
        EngineConfig(**overrides)
    except ValidationError as exc:
        raise ValueError(f"--variants {spec!r}: {exc}") from None
    return overrides


def describe_variant(overrides: dict) -> str:
    return " ".join(f"{k}={'+'.join(f'{a}:{b}' for a, b in v.items()) if isinstance(v, dict) else v}"
                    for k, v in overrides.items())


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def table(rows: list[Row]) -> str:
    head = ("| shape | lane | tokens | TTFT ms | TPOT ms | MB/token | floor ms | of floor | kernels/token | note |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r.shape} | {r.lane} | {r.tokens} | {r.ttft_ms:.2f} | {r.tpot_ms:.3f} | {r.bytes_per_token / 1e6:.1f} | "
        f"{r.floor_ms:.4f} | {r.fraction_of_floor:.1%} | {r.kernels_per_token if r.kernels_per_token else ''} | "
        f"{r.note} |\n"
        for r in rows)
    return head + body


def machine() -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "CPU"
    import transformers

    return f"{gpu}; torch {torch.__version__}; transformers {transformers.__version__}; {time.strftime('%Y-%m-%d')}"


KERNEL_CLASSES = (
    ("MoE MXFP4 gate_up", ("_gate_up",)),
    ("MoE SwiGLU", ("_swiglu",)),
    ("MoE MXFP4 down", ("_down_",)),
    ("attention split-K", ("_split_kernel",)),
    ("attention merge", ("_merge_kernel",)),
    ("RoPE + KV write", ("_rope_kv",)),
    ("add + RMSNorm", ("_add_rmsnorm", "rms", "red_fused")),
    ("router top-k", ("_router_topk",)),
    ("dense GEMV (Triton)", ("_gemv_kernel",)),
    ("GEMV/GEMM (cuBLAS)", ("gemv", "gemm", "sm90", "cutlass", "xmma", "splitK", "Kernel2")),
    ("argmax / stop check", ("argmax", "arg_max", "reduce_kernel")),
)


def kernel_class(name: str) -> str:
    """Coarse class of a CUDA kernel name (ours by function name, cuBLAS by its naming)."""
    for cls, keys in KERNEL_CLASSES:
        if any(k in name for k in keys):
            return cls
    return "other elementwise"


def profile_rows(backend, context: int, label: str, args) -> str:
    """Print where one decode step of ``backend``'s model goes."""
    rows, gpu_ms, wall_ms = kernel_breakdown(backend, context)
    total = sum(r[2] for r in rows)
    launches = sum(r[1] for r in rows)
    classes: dict[str, list[float]] = {}
    for name, n, us in rows:
        c = classes.setdefault(kernel_class(name), [0, 0.0])
        c[0] += n
        c[1] += us
    lines = [f"Shape {label}, context {context}: one decode step profiled (kernels run back to back).", "",
             "| kernel class | launches/step | µs/step | share |", "|---|---|---|---|"]
    lines += [f"| {c} | {n} | {us:.1f} | {us / total:.1%} |"
              for c, (n, us) in sorted(classes.items(), key=lambda kv: -kv[1][1])]
    lines.append(f"| all | {launches} | {total:.1f} | |")
    lines += ["", "| top kernels | launches/step | µs/step |", "|---|---|---|"]
    lines += [f"| `{k}` | {n} | {t:.1f} |" for k, n, t in rows[:12]]
    step_gpu = gpu_ms / 8
    gap_us = (step_gpu - total / 1e3) * 1e3 / max(launches, 1)
    between = (f"so {gap_us:.2f} µs between consecutive kernels inside the graph" if gap_us >= 0 else
               f"so consecutive kernels overlap by {-gap_us:.2f} µs on average: programmatic dependent launch")
    lines += ["", f"8-step quantum replayed from its CUDA graph: GPU {gpu_ms:.3f} ms ({step_gpu:.3f} ms/token; "
              f"kernels alone {total / 1e3:.3f} ms/token, {between}), wall {wall_ms:.3f} ms with the read-back: "
              f"host gap {wall_ms - gpu_ms:.3f} ms per quantum."]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    return text


def plot(rows: list[Row], path: Path) -> bool:
    """TPOT per shape and lane as a bar chart (log scale) with each shape's floor; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = list(dict.fromkeys(r.shape for r in rows))
    lanes = list(dict.fromkeys(r.lane for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(lanes)
    for j, lane in enumerate(lanes):
        xs, ys = [], []
        for i, shape in enumerate(shapes):
            match = [r for r in rows if r.shape == shape and r.lane == lane and r.tpot_ms == r.tpot_ms]
            if match:
                xs.append(i + (j - (len(lanes) - 1) / 2) * width)
                ys.append(match[0].tpot_ms)
        ax.bar(xs, ys, width, label=lane)
    for i, shape in enumerate(shapes):
        floor = next(r.floor_ms for r in rows if r.shape == shape)
        ax.hlines(floor, i - 0.45, i + 0.45, colors="black", linestyles="dashed",
                  label="bandwidth floor" if i == 0 else None)
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_yscale("log")
    ax.set_ylabel("TPOT, ms/token (log)")
    ax.set_title("Batch-one decode, prompt 1024 (lower is better)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--smollm2", help="SmolLM2-135M-Instruct GGUF file or HF directory: real weights for that shape")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--slow-new-tokens", type=int, default=32,
                   help="tokens for the slow lanes (our eager/standard, transformers) on GPT-OSS shapes")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bandwidth-tbps", type=float, default=4.8, help="HBM bandwidth for the floor (H200: 4.8)")
    p.add_argument("--tiny", action="store_true", help="tiny Llama and GPT-OSS shapes (CPU smoke run)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peers")
    p.add_argument("--skip-lanes", default="", type=lambda v: {x.strip() for x in v.split(",") if x.strip()},
                   help="comma-separated lanes not to time: persistent/eager, standard")
    p.add_argument("--hf-compile", action="store_true", help="also time transformers static cache + compile")
    p.add_argument("--hf-120b", action="store_true", help="try transformers on gpt-oss-120b too (needs ~240 GB)")
    p.add_argument("--profile", action="store_true",
                   help="per-kernel breakdown of one decode step of the last shape (each variant's too), and the "
                        "host gap")
    p.add_argument("--profile-shape", help="the shape --profile breaks down (default: the last)")
    p.add_argument("--variants", default="",
                   help="also time the persistent lane with models built under these engine settings, "
                        "';'-separated, each space-separated field=value of the engine config, e.g. "
                        "'pdl=0;moe_backend=triton_tc moe_tiles=pairs:2+depth:2;pipeline_quanta=0'")
    p.add_argument("--json", help="write rows as JSON here")
    p.add_argument("--plot", help="write a PNG bar chart here")
    p.add_argument("--replot", help="only re-draw --plot from a --json file of an earlier run")
    p.add_argument("--results", type=Path, default=None,
                   help="write the batch_one study result here (benchmarks/results keeps what the docs show)")
    args = p.parse_args(argv)
    if args.tiny:
        args.shapes = "tiny,tiny-gpt-oss"
    if args.replot:
        rows = [Row(**r) for r in json.loads(Path(args.replot).read_text())]
        plot(rows, Path(args.plot or "bench_engine.png"))
        return rows
    for spec in args.variants.split(";") if args.variants else []:
        parse_variant(spec)  # a bad setting fails before anything is built
    if args.profile and args.device == "cpu":
        raise SystemExit("--profile needs a CUDA device (it profiles CUDA kernels and graph replays)")
    rows = run(args)
    text = table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    if args.results:
        print(f"wrote {_save(rows, args)}")
    if args.plot and not plot(rows, Path(args.plot)):
        print("matplotlib is not installed: no plot (re-draw later with --replot)")
    print("\n" + text)
    return rows


def _save(rows: list[Row], args) -> Path:
    from benchmarks.results import write_result

    notes = (f"Random weights unless --smollm2; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens "
             f"({args.slow_new_tokens} for the slow lanes on GPT-OSS shapes), median of {args.reps}; "
             f"floor = bytes per token at {args.bandwidth_tbps} TB/s.")
    return write_result("batch_one", result_rows(rows, args.prompt_len), args.results, notes=notes)


def result_rows(rows: list[Row], prompt_tokens: int) -> list[dict]:
    """The ``batch_one`` study's rows (:mod:`benchmarks.studies`); a lane named ``persistent [variant]`` gives
    ``lane`` and ``variant`` apart."""
    out = []
    for r in rows:
        lane, _, variant = r.lane.partition(" ")
        out.append({"shape": r.shape, "lane": lane, "variant": variant.strip("[]() ") or None,
                    "prompt_tokens": prompt_tokens, "ttft_ms": r.ttft_ms, "tpot_ms": r.tpot_ms,
                    "tpot_floor_ms": r.floor_ms, "kernels_per_token": r.kernels_per_token, "note": r.note or None})
    return out


if __name__ == "__main__":
    main()
