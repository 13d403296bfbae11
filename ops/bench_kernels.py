"""Kernel micro-benchmarks on an NVIDIA GPU: decode kernels against the HBM bandwidth, per tile configuration.

Families (``--kernels``, comma-separated; default: all):

- ``simt``, ``mma``, ``scaled``, ``gemv``: the MXFP4 MoE GEMV variants at gpt-oss-120b's expert shape
  (hidden 2880, expert width 2880, 128 experts, top-4: one decode token reads 4 experts' packed gate_up
  and down matrices, 52.9 MB), 16 expert sets rotated so that L2 never holds the weights;
- ``dense``: the batch-one bf16 GEMV (:mod:`replicas.kernels.triton_gemv`) against cuBLAS at the
  attention projections' and the router's shapes;
- ``attention``: split-K decode attention (split + merge) at gpt-oss-120b's attention shape, per split
  count, full context and a 128-token window.

Each call is captured many times in one CUDA graph and timed with CUDA events; a cuBLAS bf16 GEMV of
265 MB is printed first as the achievable-bandwidth yardstick.

Usage (GPU): ``python -m ops.bench_kernels [--kernels gemv,dense,attention]``.
"""

from __future__ import annotations

import argparse
import itertools

import torch


def _time_ms(fn, iters: int = 50) -> float:
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


def main(argv: list[str] | None = None) -> list[tuple]:
    from replicas.kernels.triton_moe import triton_moe

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--inter", type=int, default=2880)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--top", type=int, default=6, help="configurations printed per kernel family")
    p.add_argument("--kernels", default="simt,mma,scaled,gemv,dense,attention",
                   help="comma-separated kernel families to time: simt, mma, scaled, gemv, dense, attention")
    args = p.parse_args(argv)
    families = set(args.kernels.split(","))
    dev = torch.device("cuda")
    e, h, i, k, t = args.experts, args.hidden, args.inter, args.top_k, args.tokens
    gu_b = torch.randint(0, 256, (e, 2 * i, h // 32, 16), dtype=torch.uint8, device=dev)
    gu_s = torch.randint(118, 124, (e, 2 * i, h // 32), dtype=torch.uint8, device=dev)
    dn_b = torch.randint(0, 256, (e, h, i // 32, 16), dtype=torch.uint8, device=dev)
    dn_s = torch.randint(118, 124, (e, h, i // 32), dtype=torch.uint8, device=dev)
    gu_bias = torch.randn(e, 2 * i, device=dev, dtype=torch.bfloat16)
    dn_bias = torch.randn(e, h, device=dev, dtype=torch.bfloat16)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    # a different expert set per call, so that consecutive calls do not hit in the 50 MB L2
    id_sets = [torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)]) for _ in range(16)]
    ids = id_sets[0]
    turn = [0]
    w = torch.softmax(torch.randn(t, k, device=dev), -1).to(torch.bfloat16)
    experts_used = ids.unique().numel()
    moved = experts_used * (gu_b[0].numel() + gu_s[0].numel() + dn_b[0].numel() + dn_s[0].numel())
    results = []
    dense = torch.randn(16 * i, h, device=dev, dtype=torch.bfloat16)  # larger than L2
    ms = _time_ms(lambda: torch.nn.functional.linear(x, dense), iters=20)
    print(f"cuBLAS bf16 GEMV [{16 * i} x {h}] ({dense.numel() * 2 / 1e6:.1f} MB): {ms * 1e3:.1f} us, "
          f"{dense.numel() * 2 / ms / 1e6:.0f} GB/s")
    print(f"MoE: {t} token(s), {experts_used} experts read, {moved / 1e6:.1f} MB per call")
    for bj, br, gt in itertools.product((8, 16), (4, 8), (8,)) if "simt" in families else ():
        def call(bj=bj, br=br, gt=gt):
            turn[0] += 1
            triton_moe(x, w, id_sets[turn[0] % len(id_sets)], gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias, 1.702, 7.0, residual=x,
                       block_j=bj, block_r=br, groups_per_tile=gt)
        ms = _time_ms(call)
        results.append((bj, br, gt, ms))
    if results:
        print("portable kernels (triton_moe), best configurations:")
    for bj, br, gt, ms in sorted(results, key=lambda r: r[-1])[:args.top]:
        print(f"    block_j={bj:2d} block_r={br:2d} groups/tile={gt}: {ms * 1e3:7.1f} us  "
              f"{moved / ms / 1e6:6.0f} GB/s")
    from replicas.kernels.triton_moe_mma import triton_moe_partials

    mma = []
    for bj, br, splits, warps in itertools.product((16, 32), (16, 32), (3, 5, 8), (2,)) if "mma" in families else ():
        def call_mma(bj=bj, br=br, splits=splits, warps=warps):
            turn[0] += 1
            triton_moe_partials(x, w, id_sets[turn[0] % len(id_sets)], gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias,
                                1.702, 7.0, block_j=bj, block_r=br, splits=splits, num_warps=warps)
        mma.append((bj, br, splits, warps, _time_ms(call_mma)))
    if mma:
        print("tensor-core kernels (triton_moe_mma, 3 launches), best configurations:")
    for bj, br, splits, warps, ms in sorted(mma, key=lambda r: r[-1])[:args.top]:
        print(f"    block_j={bj:2d} block_r={br:2d} splits={splits} warps={warps}: {ms * 1e3:7.1f} us  "
              f"{moved / ms / 1e6:6.0f} GB/s")
    from replicas.kernels.triton_moe_scaled import triton_moe_scaled

    scaled = []
    for bn, bk, warps, stages in (itertools.product((16, 32, 64), (128, 256, 512), (2, 4), (2, 3, 4))
                                  if "scaled" in families else ()):
        def call_scaled(bn=bn, bk=bk, warps=warps, stages=stages):
            turn[0] += 1
            triton_moe_scaled(x, w, id_sets[turn[0] % len(id_sets)], gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias,
                              1.702, 7.0, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
        try:
            scaled.append((bn, bk, warps, stages, _time_ms(call_scaled)))
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is skipped
            print(f"  dot_scaled block_n={bn} block_k={bk} warps={warps} stages={stages}: {type(exc).__name__}")
    if scaled:
        print("tl.dot_scaled kernels (triton_moe_scaled, 2 launches), best configurations:")
    for bn, bk, warps, stages, ms in sorted(scaled, key=lambda r: r[-1])[:args.top]:
        print(f"    block_n={bn:2d} block_k={bk:3d} warps={warps} stages={stages}: {ms * 1e3:7.1f} us  "
              f"{moved / ms / 1e6:6.0f} GB/s")
    from replicas.kernels.triton_moe_gemv import triton_moe_gemv

    gemv = []
    for bj, br, gb, warps, depth in (itertools.product((2, 4, 8), (4, 8, 16), (8, 16, 32), (2, 4), (1, 2))
                                     if "gemv" in families else ()):
        def call_gemv(bj=bj, br=br, gb=gb, warps=warps, depth=depth):
            turn[0] += 1
            triton_moe_gemv(x, w, id_sets[turn[0] % len(id_sets)], gu_b, gu_s, gu_bias, dn_b, dn_s, dn_bias,
                            1.702, 7.0, block_j=bj, block_r=br, blocks_per_step=gb, num_warps=warps,
                            prefetch=depth)
        try:
            gemv.append((bj, br, gb, warps, depth, _time_ms(call_gemv)))
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is skipped
            print(f"  gemv block_j={bj} block_r={br} blocks/step={gb} warps={warps} prefetch={depth}: "
                  f"{type(exc).__name__}")
    if gemv:
        print("SIMT fp32 kernels (triton_moe_gemv, 2 launches), best configurations:")
    for bj, br, gb, warps, depth, ms in sorted(gemv, key=lambda r: r[-1])[:args.top]:
        print(f"    block_j={bj} block_r={br:2d} blocks/step={gb:2d} warps={warps} prefetch={depth}: "
              f"{ms * 1e3:7.1f} us  {moved / ms / 1e6:6.0f} GB/s")
    dense = _bench_dense(x) if "dense" in families else []
    attention = _bench_attention(dev) if "attention" in families else []
    return results + mma + scaled + gemv + dense + attention


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
                ms = _time_ms(lambda splits=splits, window=window, ws=ws, lens=lens: triton_decode_attention(
                    q, kp, vp, table, lens, 0.125, sinks=sinks, sliding_window=window, num_splits=splits,
                    workspace=ws))
                print(f"attention ctx={ctx} window={window} splits={splits:2d}: {ms * 1e3:6.1f} us")
                out.append((ctx, window, splits, ms))
    return out


def _bench_dense(x: torch.Tensor) -> list[tuple]:
    """The batch-one bf16 GEMV (``triton_gemv``) against cuBLAS (``F.linear``) at gpt-oss-120b's attention
    projections and router; 8 weight copies rotated per call so that L2 never holds them."""
    out = []
    for name, n, k in (("qkv", 5120, 2880), ("o_proj", 2880, 4096), ("router", 128, 2880)):
        out += [(name, *r) for r in _bench_dense_shape(name, n, k, x.device)]
    return out


def _bench_dense_shape(name: str, n: int, k: int, dev: torch.device) -> list[tuple]:
    from replicas.kernels.triton_gemv import triton_gemv

    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(8)]
    b = torch.randn(n, device=dev, dtype=torch.bfloat16)
    xi = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    mb = n * k * 2 / 1e6
    turn = [0]

    def cublas():
        turn[0] += 1
        torch.nn.functional.linear(xi, ws[turn[0] % 8], b)
    ms = _time_ms(cublas)
    print(f"dense {name} [{n} x {k}] ({mb:.1f} MB): cuBLAS {ms * 1e3:6.1f} us {mb / ms:6.0f} GB/s")
    rows = []
    for bn, bk, warps in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8)):
        def gemv(bn=bn, bk=bk, warps=warps):
            turn[0] += 1
            triton_gemv(xi, ws[turn[0] % 8], b, block_n=bn, block_k=bk, num_warps=warps)
        try:
            rows.append((bn, bk, warps, _time_ms(gemv)))
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is skipped
            print(f"  gemv block_n={bn} block_k={bk} warps={warps}: {type(exc).__name__}")
    for bn, bk, warps, ms in sorted(rows, key=lambda r: r[-1])[:4]:
        print(f"    triton_gemv block_n={bn:2d} block_k={bk:4d} warps={warps}: {ms * 1e3:6.1f} us "
              f"{mb / ms:6.0f} GB/s")
    return rows


if __name__ == "__main__":
    main()
