"""CUDA graphs for the standard lane's decode steps, one per batch-size bucket.

A step in which every scheduled sequence feeds exactly one token (pure decode)
and whose batch fits a bucket replays a graph of the model's static decode
step (``decode_static``, the same step the persistent lane's quanta record)
instead of launching the forward's kernels one by one from Python. The batch
is padded to the bucket: padding rows carry position -1, which the Triton
RoPE/KV-write and attention kernels treat as "write nothing, read nothing";
their logits are dropped. Graphs are captured lazily, the first time a bucket
is needed, with every row padding (so capture writes nothing to the cache),
and share one memory pool. A bucket whose capture fails (e.g. a step that
must synchronize with the host) is remembered and served eagerly. Everything
else (prefill chunks, mixed steps, batches above the largest bucket) runs the
eager forward. As vLLM does, ``enforce_eager`` turns this off.
"""

from __future__ import annotations

import logging

import torch

from replicas.graph_capture import capture_graphs
from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.request import Request

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
"""Buckets captured on demand (as ``EngineConfig.cuda_graph_batch_sizes``: up to the default ``max_num_seqs``)."""


class DecodeGraphs:
    """Per-bucket CUDA graphs of ``model.decode_static`` over the replica's KV planes.

    Args:
        model: a model with ``decode_static(token [B], position [B], block_table [B, max_blocks],
            kv_planes) -> [B, vocab]`` logits (kept here as fp32).
        kv_planes: per layer ``(key_plane, value_plane)``.
        device: a CUDA device.
        max_model_len: context limit; sets the padded block-table width.
        batch_sizes: the buckets.
    """

    def __init__(self, model, kv_planes, device: torch.device, max_model_len: int,
                 batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES):
        self.model = model
        self.kv_planes = kv_planes
        self.device = torch.device(device)
        limit = model.max_decode_graph_batch  # e.g. GPT-OSS: its MoE kernels' batch limit (None: none)
        self.batch_sizes = tuple(sorted(b for b in batch_sizes if limit is None or b <= limit))
        self.max_blocks = -(-max_model_len // PAGE_SIZE)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}
        self._failed: set[int] = set()
        self._pool = None
        self.replays = 0

    def bucket(self, batch: list[tuple[Request, int]]) -> int | None:
        """The bucket that serves ``batch``, or None (not pure decode, too large, or a failed bucket)."""
        if any(n != 1 for _, n in batch):
            return None
        size = next((b for b in self.batch_sizes if b >= len(batch)), None)
        if size is None or size in self._failed:
            return None
        if any(len(r.block_table) > self.max_blocks for r, _ in batch):
            return None
        return size

    @torch.inference_mode()
    def run(self, batch: list[tuple[Request, int]], size: int,
            input_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits ``[len(batch), vocab]`` fp32 of a pure-decode ``batch`` from the graph of bucket ``size``,
        or None when that bucket cannot be captured (the caller runs the eager forward). ``input_tokens``
        (``[len(batch)]`` int64 on the device), if given, are the rows' input tokens instead of the
        requests' last token ids (copied on the device)."""
        entry = self._graphs.get(size) or self._capture(size)
        if entry is None:
            return None
        graph, buf = entry
        host = torch.zeros(size, 2 + self.max_blocks, dtype=torch.long)
        host[:, 1] = -1  # padding rows
        for i, (req, _) in enumerate(batch):
            pos = req.num_computed_tokens
            if input_tokens is None:
                host[i, 0] = req.all_token_ids[pos]
            host[i, 1] = pos
            host[i, 2:2 + len(req.block_table)] = torch.tensor(req.block_table, dtype=torch.long)
        if buf["staging"].is_cuda:  # pinned, not waited on: a pageable copy would wait for the queued steps
            buf["staging"].copy_(host.pin_memory(), non_blocking=True)
        else:
            buf["staging"].copy_(host)
        if input_tokens is not None:
            buf["staging"][: len(batch), 0].copy_(input_tokens)
        graph.replay()
        self.replays += 1
        return buf["logits"][: len(batch)].clone()

    @torch.inference_mode()
    def run_staged(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                   size: int) -> torch.Tensor | None:
        """:meth:`run` from device tensors (:class:`~replicas.step_inputs.StepInputs`): ``tokens`` and
        ``positions`` ``[B]``, ``block_table`` ``[B, max_blocks]``, copied into the graph's staging buffer on
        the device (no host loop, no sync); rows ``B..size-1`` become padding (position -1)."""
        entry = self._graphs.get(size) or self._capture(size)
        if entry is None:
            return None
        graph, buf = entry
        n = tokens.shape[0]
        staged = buf["staging"]
        staged[:n, 0].copy_(tokens)
        staged[:n, 1].copy_(positions)
        staged[n:, 1].fill_(-1)
        staged[:n, 2:2 + block_table.shape[1]].copy_(block_table)
        graph.replay()
        self.replays += 1
        return buf["logits"][:n].clone()

    def capture_all(self) -> list[int]:
        """Capture every bucket not captured yet, largest first, and return the buckets that could not be
        captured. Largest first, the decode attention's split-K workspace (shared by every bucket, and never
        freed while a graph may replay it: :func:`~replicas.kernels.triton_decode_attention.partial_buffers`)
        is allocated once, at its largest size, instead of growing bucket by bucket."""
        for size in sorted(self.batch_sizes, reverse=True):
            if size not in self._graphs and size not in self._failed:
                self._capture(size)
        return sorted(self._failed)

    def _body(self, buf: dict[str, torch.Tensor]) -> None:
        staged = buf["staging"]
        buf["logits"].copy_(self.model.decode_static(staged[:, 0], staged[:, 1], staged[:, 2:], self.kv_planes))

    def _capture(self, size: int):
        staging = torch.zeros(size, 2 + self.max_blocks, dtype=torch.long, device=self.device)
        staging[:, 1] = -1  # every row padding while warming up and capturing: nothing touches the cache
        buf = {"staging": staging}
        try:
            with torch.inference_mode():
                probe = self.model.decode_static(staging[:, 0], staging[:, 1], staging[:, 2:], self.kv_planes)
                buf["logits"] = torch.empty(probe.shape, dtype=torch.float32, device=probe.device)  # sampled
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                graph = capture_graphs({size: lambda: self._body(buf)}, self.device, pool=self._pool)[size]
        except Exception as exc:  # noqa: BLE001 - an uncapturable bucket runs eagerly from now on
            logger.warning("decode CUDA graph for batch size %d not captured (%s); that size runs eagerly",
                           size, exc)
            self._failed.add(size)
            return None
        self._graphs[size] = (graph, buf)
        return self._graphs[size]
