"""The decode MoE per token count: one MoE layer (gate_up + SwiGLU + down, per-expert fp32 partials) at
gpt-oss-120b's expert shape, per kernel, against the bytes floor of the experts it must read (a row
``kernel="bytes floor"`` per token count).

Kernels (``--kernels``):

- ``one_pair``: ``hopper_bulk``'s one-pair kernel (:mod:`replicas.kernels.moe.hopper_bulk`; at most 32 tokens);
- ``one_pair_folded``: the same in the folded family (``fold_scales``);
- ``grouped``: its grouped kernel (:mod:`replicas.kernels.moe.hopper_grouped`), once per ``--tiles`` setting;
- ``grouped_gemm``: the grouped GEMMs (:mod:`replicas.kernels.moe.grouped_gemm`) at their own M-block height;
- ``grouped_gemm_16``: the same at the fixed height 16 (the row-exact path for backends without a grouped
  decode kernel).

Each call is captured 20 times in one CUDA graph (replayed once untimed, then timed) on 8 rotating routings (so consecutive calls do not find
the experts in L2) and timed with CUDA events. Routing is uniform random top-4 of 128 experts, random weights
(the layer's arithmetic does not depend on the values).

Usage (GPU): ``python -m benchmarks.decode_moe --tokens 1 8 16 32 64 128 256 --out DIR``.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from benchmarks.kernels import graph_time_ms
from benchmarks.results import write_result


def _time_us(fn) -> float:
    """GPU µs per call of ``fn``: :func:`benchmarks.kernels.graph_time_ms` over 20 calls in one graph."""
    return graph_time_ms(fn, iters=20) * 1e3


def _calls(args, t: int, x, x_mx, w, routings, packed, experts) -> dict:
    """``{(kernel, tiles JSON): call}`` for the kernels and tiles asked for; each call takes the next routing."""
    from replicas.kernels.moe.grouped_gemm import experts_partials
    from replicas.kernels.moe.hopper_bulk import cuda_moe_bulk
    from replicas.kernels.moe.hopper_grouped import cuda_moe_grouped

    turn = [0]

    def ids():
        turn[0] += 1
        return routings[turn[0] % len(routings)]

    calls = {}
    if "one_pair" in args.kernels and t * w.shape[1] <= 128:
        calls["one_pair", "{}"] = lambda: cuda_moe_bulk(x, w, ids(), *packed, x_mxfp4=x_mx, repacked=True)
    if "one_pair_folded" in args.kernels and t * w.shape[1] <= 128:
        calls["one_pair_folded", "{}"] = lambda: cuda_moe_bulk(x, w, ids(), *packed, x_mxfp4=x_mx, repacked=True,
                                                               fold_scales=True)
    if "grouped" in args.kernels:
        for tiles in args.tiles:
            calls["grouped", tiles] = functools.partial(
                lambda tiles: cuda_moe_grouped(x, w, ids(), *packed, x_mxfp4=x_mx, repacked=True, **tiles),
                json.loads(tiles))
    if "grouped_gemm" in args.kernels:
        calls["grouped_gemm", "{}"] = lambda: experts_partials(x, w, ids(), experts)
    if "grouped_gemm_16" in args.kernels:
        calls["grouped_gemm_16", "{}"] = lambda: experts_partials(x, w, ids(), experts, block_m=16)
    return calls


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256])
    p.add_argument("--kernels", nargs="+", default=["one_pair", "one_pair_folded", "grouped", "grouped_gemm",
                                                     "grouped_gemm_16"])
    p.add_argument("--tiles", nargs="+", default=["{}"],
                   help="JSON tile settings of the grouped kernel (cuda_moe_grouped's arguments), one run each")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--bandwidth-tbps", type=float, default=None,
                   help="for the floor; default: 4.8 on an H200, 3.35 on an H100")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    from ops.tools.fixtures import random_experts, repacked_copy
    from replicas.kernels.moe.grouped_gemm import expert_bytes
    from replicas.kernels.moe.mma_format import mxfp4_activations

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    tbps = args.bandwidth_tbps or (4.8 if "H200" in name else 3.35)
    e, hidden, inter, k = args.experts, 2880, 2880, 4
    experts = repacked_copy(random_experts(e, hidden, inter, torch.bfloat16, seed=3, device=dev))
    experts.decode_layout = True
    packed = (experts.gate_up_proj_blocks, experts.gate_up_proj_scales, experts.gate_up_proj_bias,
              experts.down_proj_blocks, experts.down_proj_scales, experts.down_proj_bias, 1.702, 7.0)
    rows, reads = [], []
    for t in args.tokens:
        g = torch.Generator(device=dev).manual_seed(t)
        x = torch.randn(t, hidden, generator=g, device=dev).bfloat16()
        x_mx = mxfp4_activations(x)
        w = torch.softmax(torch.randn(t, k, generator=g, device=dev), -1).bfloat16()
        routings = [torch.stack([torch.randperm(e, generator=g, device=dev)[:k] for _ in range(t)]) for _ in range(8)]
        read = sum(int(r.unique().numel()) for r in routings) / len(routings)
        floor_us = expert_bytes(1, hidden, inter) * read / (tbps * 1e12) * 1e6
        reads.append(f"{t} tokens {read:.1f}")
        rows.append({"shape": "gpt-oss-120b", "tokens": t, "kernel": "bytes floor", "tiles": "", "us": round(floor_us, 1)})
        calls = _calls(args, t, x, x_mx, w, routings, packed, experts)
        for (kernel, tiles), fn in calls.items():
            try:
                us = _time_us(fn)
            except Exception as exc:  # noqa: BLE001 - a setting that cannot run is reported, not fatal
                print(f"{t:4d} tokens {kernel} {tiles}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            rows.append({"shape": "gpt-oss-120b", "tokens": t, "kernel": kernel, "tiles": tiles, "us": round(us, 1)})
            print(f"{t:4d} tokens {kernel:16s} {tiles:50s} {us:8.1f} us  floor {floor_us:7.1f} us "
                  f"({floor_us / us:5.1%})", flush=True)
    write_result("decode_moe", rows, args.out,
                 notes=f"one MoE layer, {e} experts top-{k}, widths {hidden}/{inter}, random weights and uniform "
                       f"routing, experts in the decode layout; floor: the distinct experts' packed bytes at "
                       f"{tbps} TB/s ({name}); distinct experts read per call (mean of 8 routings): "
                       + ", ".join(reads))
    return rows


if __name__ == "__main__":
    main()
