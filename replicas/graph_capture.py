"""CUDA-graph capture, written once for both lanes.

The persistent lane's ``cuda_graph`` backend records one graph per quantum size and the standard lane
(:mod:`replicas.decode_graphs`) one per batch-size bucket; both warm up on a side stream first (Triton
compilation, allocator growth stay out of the graphs), then capture into one shared memory pool.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch


def capture_graphs(bodies: dict[Hashable, Callable[[], None]], device: torch.device | str,
                   warmup: Callable[[], None] | None = None, warmup_runs: int = 2, pool=None
                   ) -> dict[Hashable, torch.cuda.CUDAGraph]:
    """Capture each of ``bodies`` (key → a function with no arguments that launches the work on the current
    stream, reading and writing only static tensors) as one CUDA graph.

    Args:
        bodies: what to record, by key.
        device: the CUDA device.
        warmup: run ``warmup_runs`` times on a side stream before any capture (default: every body once
            per run), so that compilation and allocations happen outside the graphs.
        pool: a graph memory pool (``torch.cuda.graph_pool_handle()``) to share with graphs captured
            earlier; a new one by default. All graphs captured here share it.

    Returns:
        ``{key: graph}``; ``graph.replay()`` runs the recorded launches.

    Raises:
        RuntimeError: a body cannot be captured (e.g. it synchronizes with the host); graphs captured
            before it in this call are dropped.
    """
    device = torch.device(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup_runs):
            if warmup is not None:
                warmup()
            else:
                for body in bodies.values():
                    body()
    torch.cuda.current_stream(device).wait_stream(side)
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    graphs = {}
    for key, body in bodies.items():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            body()
        graphs[key] = graph
    torch.cuda.synchronize(device)
    return graphs
