"""What each kernel class costs gpt-oss's decode step: the step timed with one class removed at a time.

Under programmatic dependent launch consecutive kernels overlap, so the per-kernel durations of
``benchmarks.engine --profile`` add up to more than the step and cannot say what removing or fusing a
kernel would save. This tool measures that directly: it captures the persistent lane's 8-step CUDA graph
of a random gpt-oss model (as ``benchmarks.engine`` builds it) with one kernel class replaced by a
fixed buffer, and times the replay against the full step, all on the same weights in one process.

Each ablation is a model of its own: the same weights given a :class:`~replicas.kernels.decode_ops.DecodeOps`
whose method for that class returns a fixed buffer (:meth:`GptOssForCausalLM.use_ops`); nothing in the
runtime is patched. The outputs of a removed kernel are wrong by construction (zeros, or fixed expert
ids), so only the timings mean anything; nothing here is a correctness check. The model's q/k/v
projections are fused, so the qkv projection is one ``linear`` call that "no qkv GEMV" can replace.
CUDA only.

Usage (GPU): ``python -m benchmarks.ablation [--shape gpt-oss-120b] [--context 1152] [name ...]``
(names: see ``--list``; default all).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable

import torch

from replicas.kernels.decode_ops import DecodeOps

REPLACEABLE = ("rope_kv_write", "decode_attention", "linear", "add_rmsnorm_route", "moe_add_rmsnorm")
"""The :class:`DecodeOps` methods an ablation may replace (each called by ``GptOssForCausalLM.decode_static``)."""


def ablated_ops(ops: DecodeOps, replacements: dict[str, Callable]) -> DecodeOps:
    """A copy of ``ops`` whose methods named in ``replacements`` (keys of :data:`REPLACEABLE`) are the given
    functions, each called as ``fn(ops, *args, **kwargs)`` with the original ``ops`` first.

    Raises:
        ValueError: a name outside :data:`REPLACEABLE`."""
    bad = sorted(set(replacements) - set(REPLACEABLE))
    if bad:
        raise ValueError(f"not replaceable: {bad}")
    def method(fn: Callable) -> Callable:
        return lambda self, *args, **kwargs: fn(ops, *args, **kwargs)

    cls = type("AblatedDecodeOps", (DecodeOps,), {name: method(fn) for name, fn in replacements.items()})
    return cls(**{f.name: getattr(ops, f.name) for f in dataclasses.fields(ops)})


class _Buffers:
    """Zero buffers and fixed routing made on first use (the capture's warm-up runs outside the graph)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._zeros: dict = {}

    def zeros(self, shape, dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self._zeros[key]

    def routing(self, rows: int, k: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights ``1/k`` and expert ids ``0, 2, 4, ...`` for ``rows`` tokens."""
        key = ("routing", rows, k, dtype)
        if key not in self._zeros:
            ids = torch.arange(0, 2 * k, 2, device=self.device).repeat(rows, 1)
            self._zeros[key] = (torch.full((rows, k), 1 / k, dtype=dtype, device=self.device), ids)
        return self._zeros[key]


def ablations(buf: _Buffers) -> dict[str, dict[str, Callable]]:
    """Name → replacements of :data:`REPLACEABLE` methods (empty: the full step); each replacement is called
    with the original :class:`DecodeOps` first."""

    def skip_linear(skip: Callable[[torch.Tensor], bool]):
        def linear(ops, x, weight, bias=None):
            if skip(weight):
                return buf.zeros((x.shape[0], weight.shape[0]), x.dtype)
            return DecodeOps.linear(ops, x, weight, bias)
        return linear

    def fixed_route(ops, x, delta, norm, router, mxfp4_out=False, workspace=None):
        h_mx = buf.zeros(x.shape, torch.bfloat16) if mxfp4_out else None
        return (x, x, h_mx, *buf.routing(x.shape[0], router.top_k, x.dtype))

    def no_moe(ops, h, weights, ids, experts, x, norm, weight_in_fp32, x_mxfp4=None):
        return ops.add_rmsnorm(x, None, norm, weight_in_fp32)

    return {
        "full step": {},
        "no MoE (gate_up + down)": {"moe_add_rmsnorm": no_moe},
        "no qkv GEMV": {"linear": skip_linear(lambda w: w.shape[0] > w.shape[1])},  # [(H + 2 KVH) D, hidden]
        "no qkv GEMV, RoPE + KV write": {"rope_kv_write": lambda ops, attn, x, *a, **k: buf.zeros(
            (x.shape[0], attn.num_heads, attn.head_dim), x.dtype)},
        "no o GEMV": {"linear": skip_linear(lambda w: w.shape[0] < w.shape[1])},  # [hidden, H D]
        "no attention (split + merge)": {"decode_attention": lambda ops, q, *a, **k: q},
        "no add + RMSNorm + router": {"add_rmsnorm_route": fixed_route},
    }


def time_step(core, max_model_len: int, context: int, reps: int) -> float:
    """Median GPU µs per token of the persistent lane's 8-step graph (captured now) replayed at ``context``
    tokens."""
    from replicas.persistent.contract import CacheBinding
    from replicas.persistent.factory import create_backend

    backend = create_backend("cuda_graph", core)
    backend.bind_cache(CacheBinding.from_kv_tensor(core.kv_cache.tensor))
    b = backend.buffers
    b.block_table.copy_(torch.arange(backend.max_blocks, device=b.block_table.device))
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        b.position.fill_(context)
        torch.cuda.synchronize()
        start.record()
        backend._graphs[8].replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / 8)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[tuple[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="*", help="ablations to time (default: all)")
    p.add_argument("--shape", default="gpt-oss-120b", help="gpt-oss-120b or gpt-oss-20b (random weights)")
    p.add_argument("--context", type=int, default=1152, help="tokens in the KV cache while timing")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--list", action="store_true", help="print the ablation names and exit")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    buf = _Buffers(device)
    table = ablations(buf)
    if args.list:
        print("\n".join(table))
        return []
    unknown = [n for n in args.names if n not in table]
    if unknown:
        raise SystemExit(f"unknown ablation(s) {unknown}; known: {list(table)}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.ablation needs an NVIDIA GPU: it times CUDA-graph replays")
    from benchmarks.engine import build_core

    max_len = args.context + 64
    core = build_core(args.shape, device, torch.bfloat16, max_len)
    full_ops = core.model.ops
    rows = []
    for name in args.names or list(table):
        core.model.use_ops(ablated_ops(full_ops, table[name]))
        rows.append((name, time_step(core, max_len, args.context, args.reps)))
        print(f"  {name:32s} {rows[-1][1]:9.1f} µs/token", flush=True)
    core.model.use_ops(full_ops)
    full = dict(rows).get("full step")
    print(f"\n{args.shape}, context {args.context}, CUDA-graph replay of 8 steps (median of {args.reps}):\n")
    print("| step | µs/token | cost (full step minus this) |\n|---|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} | {'' if full is None or name == 'full step' else f'{full - us:.1f}'} |")
    return rows


if __name__ == "__main__":
    main()
