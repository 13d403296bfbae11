"""Kernel micro-benchmarks on an NVIDIA GPU: decode kernels against the HBM bandwidth, per tile configuration.

Families (``--kernels``, comma-separated; default: all):

- ``triton_portable``, ``triton_fp32``, ``triton_tc``, ``hopper_bulk``: the MoE decode backends at gpt-oss-120b's expert shape
  (hidden 2880, expert width 2880, 128 experts, top-4: one decode token reads 4 experts' packed gate_up
  and down matrices, 52.9 MB), 16 expert sets rotated so that L2 never holds the weights;
- ``dense``: the batch-one bf16 GEMV (:mod:`replicas.kernels.triton_gemv`) against cuBLAS at the
  attention projections' and the router's shapes;
- ``attention``: split-K decode attention (split + merge) at gpt-oss-120b's attention shape, per split
  count, full context and a 128-token window.

Each call is captured many times in one CUDA graph and timed with CUDA events; a cuBLAS bf16 GEMV of
265 MB is printed first as the achievable-bandwidth yardstick.

Usage (GPU): ``python -m benchmarks.kernels [--kernels hopper_bulk,triton_tc,dense,attention]``.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch


def graph_time_ms(fn, iters: int = 50) -> float:
    """GPU ms per call of ``fn``: ``iters`` calls captured in one CUDA graph (no Python launch cost), replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


def _sweep(title: str, call, grid: dict[str, tuple], top: int, mb: float, prefix: str = "") -> list[tuple]:
    """Time ``call(**config)`` for every configuration of ``grid`` (a configuration that does not compile is
    skipped), print the ``top`` fastest with their GB/s for ``mb`` megabytes per call, and return
    ``(prefix?, *config values, ms)`` rows."""
    rows = []
    for values in itertools.product(*grid.values()):
        config = dict(zip(grid, values, strict=True))
        try:
            ms = graph_time_ms(lambda config=config: call(**config))
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is skipped
            print(f"  {title} {config}: {type(exc).__name__}")
            continue
        rows.append((*((prefix,) if prefix else ()), *values, ms))
    print(f"{title}, best configurations:")
    for row in sorted(rows, key=lambda r: r[-1])[:top]:
        values = row[1:-1] if prefix else row[:-1]
        shown = " ".join(f"{name}={value}" for name, value in zip(grid, values, strict=True))
        print(f"    {shown}: {row[-1] * 1e3:7.1f} us  {mb / row[-1]:6.0f} GB/s")
    return rows


MOE_GRIDS = {
    "triton_portable": {"block_j": (8, 16), "block_r": (4, 8), "groups_per_tile": (8,)},
    "triton_fp32": {"block_j": (2, 4, 8), "block_r": (4, 8, 16), "blocks_per_step": (8, 16, 32), "num_warps": (2, 4)},
    "triton_tc": {"num_warps": (4,), "down_num_warps": (4, 8), "depth": (1,), "down_depth": (1, 2), "pairs": (1, 2),
                  "down_pairs": (1, 2)},
    "hopper_bulk": {"num_warps": (4, 8), "down_num_warps": (4, 8), "down_pairs": (1, 2), "stages": (1, 2),
                    "blocks_per_sm": (2, 6, 8)},
}
"""Tile grids swept per MoE decode backend (:data:`replicas.kernels.moe.TILE_KEYS`); each configuration
runs the backend's kernel as :class:`replicas.kernels.moe.MoE` would (``moe_tiles``)."""


def main(argv: list[str] | None = None) -> list[tuple]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--inter", type=int, default=2880)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--top", type=int, default=6, help="configurations printed per kernel family")
    p.add_argument("--kernels", default=",".join([*MOE_GRIDS, "dense", "attention"]),
                   help="comma-separated: MoE decode backends (triton_portable, triton_fp32, triton_tc, "
                        "hopper_bulk), dense, attention")
    p.add_argument("--grid", default="{}",
                   help='JSON: tile grids that replace a family\'s default one, e.g. \'{"triton_tc": {"depth": [1, 2]}}\'')
    args = p.parse_args(argv)
    families = set(args.kernels.split(","))
    grids = {name: {k: tuple(v) for k, v in grid.items()} for name, grid in json.loads(args.grid).items()}
    dev = torch.device("cuda")
    e, h, i, k, t = args.experts, args.hidden, args.inter, args.top_k, args.tokens
    gu_b = torch.randint(0, 256, (e, 2 * i, h // 32, 16), dtype=torch.uint8, device=dev)
    gu_s = torch.randint(118, 124, (e, 2 * i, h // 32), dtype=torch.uint8, device=dev)
    dn_b = torch.randint(0, 256, (e, h, i // 32, 16), dtype=torch.uint8, device=dev)
    dn_s = torch.randint(118, 124, (e, h, i // 32), dtype=torch.uint8, device=dev)
    gu_bias = torch.randn(e, 2 * i, device=dev, dtype=torch.bfloat16)
    dn_bias = torch.randn(e, h, device=dev, dtype=torch.bfloat16)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    # a different expert set per call (the calls are captured in one graph), so that consecutive calls do not
    # hit in the 50 MB L2
    id_sets = [torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)]) for _ in range(16)]
    turn = [0]
    w = torch.softmax(torch.randn(t, k, device=dev), -1).to(torch.bfloat16)
    experts_used = id_sets[0].unique().numel()
    moved = experts_used * (gu_b[0].numel() + gu_s[0].numel() + dn_b[0].numel() + dn_s[0].numel())
    dense = torch.randn(16 * i, h, device=dev, dtype=torch.bfloat16)  # larger than L2
    ms = graph_time_ms(lambda: torch.nn.functional.linear(x, dense), iters=20)
    print(f"cuBLAS bf16 GEMV [{16 * i} x {h}] ({dense.numel() * 2 / 1e6:.1f} MB): {ms * 1e3:.1f} us, "
          f"{dense.numel() * 2 / ms / 1e6:.0f} GB/s")
    print(f"MoE: {t} token(s), {experts_used} experts read, {moved / 1e6:.1f} MB per call")
    from types import SimpleNamespace

    from replicas.kernels.moe import MoE, resolve_moe
    from replicas.kernels.moe.mma_format import mxfp4_activations

    experts = SimpleNamespace(gate_up_proj_blocks=gu_b, gate_up_proj_scales=gu_s, gate_up_proj_bias=gu_bias,
                              down_proj_blocks=dn_b, down_proj_scales=dn_s, down_proj_bias=dn_bias,
                              alpha=1.702, limit=7.0)
    x_mx = mxfp4_activations(x)  # the format the add+RMSNorm before them writes
    rows = []
    for name, grid in MOE_GRIDS.items():
        if name not in families:
            continue

        def call(name=name, **tiles):
            turn[0] += 1
            model_dtype = torch.float32 if name == "triton_fp32" else torch.bfloat16  # the backend's models
            moe = MoE(resolve_moe(name, dev, model_dtype, repack=False, tiles=tiles), pdl=False)
            ids = id_sets[turn[0] % len(id_sets)]
            if moe.partials(x, w, ids, experts, x_mx if moe.takes_mxfp4_activations else None) is None:
                moe(x, w, ids, experts)
        rows += _sweep(name, call, grids.get(name, grid), args.top, moved / 1e6, prefix=name)
    if "dense" in families:
        rows += _bench_dense(dev)
    if "attention" in families:
        rows += _bench_attention(dev)
    return rows


def _bench_attention(dev: torch.device) -> list[tuple]:
    """Split-K decode attention (split + merge launches) at gpt-oss-120b's attention shape (64 query heads,
    8 KV heads, head dim 64, sinks), full context and a 128-token window, per split count."""
    from replicas.kernels.paged_attention import PAGE_SIZE
    from replicas.kernels.triton_decode_attention import triton_decode_attention

    heads, kvh, d, blocks = 64, 8, 64, 512
    kp = torch.randn(blocks, PAGE_SIZE, kvh, d, device=dev, dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    q = torch.randn(1, heads, d, device=dev, dtype=torch.bfloat16)
    sinks = torch.randn(heads, device=dev)
    table = torch.randperm(blocks, device=dev)[:256].view(1, -1)
    out = []
    for ctx in (1152, 4096):
        lens = torch.tensor([ctx], device=dev)
        for window in (None, 128):
            for splits in (8, 16, 32, 64):
                ws: dict = {}
                ms = graph_time_ms(lambda splits=splits, window=window, ws=ws, lens=lens: triton_decode_attention(
                    q, kp, vp, table, lens, 0.125, sinks=sinks, sliding_window=window, num_splits=splits,
                    workspace=ws))
                print(f"attention ctx={ctx} window={window} splits={splits:2d}: {ms * 1e3:6.1f} us")
                out.append((ctx, window, splits, ms))
    return out


def _bench_dense(dev: torch.device) -> list[tuple]:
    """The batch-one bf16 GEMV (``triton_gemv``) against cuBLAS (``F.linear``) at gpt-oss-120b's attention
    projections and router; 8 weight copies rotated per call so that L2 never holds them."""
    from replicas.kernels.triton_gemv import triton_gemv

    rows = []
    for name, n, k in (("qkv", 5120, 2880), ("o_proj", 2880, 4096), ("router", 128, 2880)):
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(8)]
        b = torch.randn(n, device=dev, dtype=torch.bfloat16)
        xi = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        mb = n * k * 2 / 1e6
        turn = [0]

        def call(fn, ws=ws, b=b, xi=xi, turn=turn, **tiles):
            turn[0] += 1
            fn(xi, ws[turn[0] % len(ws)], b, **tiles)
        ms = graph_time_ms(lambda call=call: call(torch.nn.functional.linear))
        print(f"dense {name} [{n} x {k}] ({mb:.1f} MB): cuBLAS {ms * 1e3:6.1f} us {mb / ms:6.0f} GB/s")
        rows += _sweep(f"triton_gemv {name}", lambda call=call, **tiles: call(triton_gemv, **tiles),
                       {"block_n": (4, 8, 16), "block_k": (256, 512, 1024), "num_warps": (4, 8)}, 4, mb,
                       prefix=name)
    return rows


if __name__ == "__main__":
    main()
