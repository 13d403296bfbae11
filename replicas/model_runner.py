"""Model runner: turns a scheduled batch into tensors and runs the forward.

A batch is a list of ``(request, num_new_tokens)``: request ``r`` feeds
``r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + n]`` at those
positions, with KV written through ``r.block_table``.
"""

from __future__ import annotations

import torch

from replicas.kernels.paged_attention import PAGE_SIZE, AttentionMetadata
from replicas.request import Request


def build_metadata(batch: list[tuple[Request, int]], device: torch.device | str,
                   input_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, AttentionMetadata]:
    """Flatten a batch into ``input_ids [T]`` and :class:`AttentionMetadata` (the list path: Python per
    token; the oracle of :meth:`replicas.step_inputs.StepInputs.build`, which the runner uses).

    ``input_tokens`` (``[len(batch)]`` int64 on ``device``, a pure-decode batch only) replaces the requests'
    token ids as ``input_ids``: the tokens a previous step picked and the host has not read yet.

    Raises:
        ValueError: a request's block table does not cover its new tokens.
    """
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    tables: list[torch.Tensor] = []
    for req, n in batch:
        start = req.num_computed_tokens
        end = start + n
        if len(req.block_table) * PAGE_SIZE < end:
            raise ValueError(f"request {req.request_id}: {len(req.block_table)} pages cannot hold {end} tokens")
        ids.extend(req.all_token_ids[start:end] if input_tokens is None else [0] * n)
        for pos in range(start, end):
            positions.append(pos)
            slots.append(req.block_table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
        query_start.append(query_start[-1] + n)
        context_lens.append(end)
        tables.append(torch.tensor(req.block_table, dtype=torch.long, device=device))
    meta = AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start=query_start,
        context_lens=context_lens,
        block_tables=tables,
    )
    if input_tokens is not None:
        return input_tokens.to(device=device, dtype=torch.long), meta
    return torch.tensor(ids, dtype=torch.long, device=device), meta


class ModelRunner:
    """Runs the model over the replica's KV cache.

    Args:
        model: a model whose ``forward(input_ids, meta, kv_planes)`` returns ``[B, vocab]`` fp32 logits.
        kv_planes: per layer ``(key_plane, value_plane)``.
        device: where inputs are built.
        graphs: optional :class:`~replicas.decode_graphs.DecodeGraphs`: pure-decode steps that fit a
            bucket replay a CUDA graph instead of the eager forward.
        inputs: optional :class:`~replicas.step_inputs.StepInputs`: step metadata built as tensors in
            persistent device buffers (else :func:`build_metadata`'s lists).
        kernels: the model's resolved ``DecodeOps.prefill_kernels`` (engine config ``prefill_kernels`` on a
            GPU with Triton): the Triton prefill attention serves the eager forward (each forward's
            ``AttentionMetadata.kernels``); False keeps the torch reference path.
        batch_invariant: the model's resolved ``DecodeOps.batch_invariant``: decode rows (a generated token,
            the prompt already in the cache) always run the model's ``decode_static`` (a graph or eagerly) and
            prompt tokens the eager forward, in separate forwards when a step mixes them, so each kind always
            meets the same row-exact kernels (``docs/exactness.md``).
    """

    def __init__(self, model: torch.nn.Module, kv_planes, device: torch.device | str, graphs=None,
                 inputs=None, kernels: bool = False, batch_invariant: bool = False):
        self.model = model
        self.kv_planes = kv_planes
        self.device = device
        self.graphs = graphs
        self.inputs = inputs
        self.kernels = kernels
        self.batch_invariant = batch_invariant

    @torch.inference_mode()
    def execute(self, batch: list[tuple[Request, int]], input_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Forward the batch; KV of the new tokens lands in the cache.

        Args:
            batch: ``(request, num_new_tokens)`` pairs.
            input_tokens: for a pure-decode batch (one new token per request), ``[len(batch)]`` int64 on the
                runner's device: each request's input token, copied into the step's inputs on the device
                instead of read from ``req.all_token_ids`` (async scheduling: the previous step's picks,
                which the host has not read yet). None: the requests' own token ids.

        Returns:
            ``[len(batch), vocab]`` fp32 logits of each request's last new token.

        Raises:
            ValueError: ``input_tokens`` is given for a batch that is not pure decode, or does not have one
                entry per request.
        """
        if input_tokens is not None and (input_tokens.shape != (len(batch),) or any(n != 1 for _, n in batch)):
            raise ValueError(f"input_tokens {tuple(input_tokens.shape)} need a pure-decode batch of that size")
        if self.batch_invariant:
            return self._execute_split(batch, input_tokens)
        tensors = self.inputs is not None and self.inputs.fits(batch)
        if self.graphs is not None:
            size = self.graphs.bucket(batch)
            if size is not None:
                if tensors:  # the staged inputs feed the graph with device copies
                    input_ids, meta = self.inputs.build(batch, self.kernels, input_tokens)
                    logits = self.graphs.run_staged(input_ids, meta.positions, meta.device.block_table, size)
                else:
                    logits = self.graphs.run(batch, size, input_tokens)
                if logits is not None:
                    return logits
                if tensors:
                    return self.model(input_ids, meta, self.kv_planes)
        if tensors:
            input_ids, meta = self.inputs.build(batch, self.kernels, input_tokens)
        else:
            input_ids, meta = build_metadata(batch, self.device, input_tokens)
            meta.kernels = self.kernels
        return self.model(input_ids, meta, self.kv_planes)

    def _execute_split(self, batch: list[tuple[Request, int]], input_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`execute` with decode rows and prompt tokens in separate forwards (``batch_invariant``)."""
        decode = [i for i, (req, n) in enumerate(batch) if n == 1 and req.prefill_done]
        if len(decode) == len(batch):
            return self._decode_static(batch, input_tokens)
        if not decode:
            return self._eager(batch)
        rest = sorted(set(range(len(batch))) - set(decode))
        dec = self._decode_static([batch[i] for i in decode])
        pre = self._eager([batch[i] for i in rest])
        out = torch.empty(len(batch), dec.shape[1], dtype=torch.float32, device=dec.device)
        out[torch.tensor(decode, device=dec.device)] = dec
        out[torch.tensor(rest, device=dec.device)] = pre
        return out

    def _decode_static(self, batch: list[tuple[Request, int]], input_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Fp32 logits ``[len(batch), vocab]`` of a pure-decode batch through the model's ``decode_static``:
        a bucket's CUDA graph when one serves it, else eagerly (``input_tokens`` as :meth:`execute`)."""
        if self.graphs is not None:
            size = self.graphs.bucket(batch)
            if size is not None:
                logits = self.graphs.run(batch, size, input_tokens)
                if logits is not None:
                    return logits
        width = max(len(req.block_table) for req, _ in batch)
        table = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (req, _) in enumerate(batch):
            table[i, :len(req.block_table)] = torch.tensor(req.block_table, dtype=torch.long)
        positions = torch.tensor([req.num_computed_tokens for req, _ in batch], dtype=torch.long)
        dev = self.device
        if input_tokens is None:
            tokens = torch.tensor([req.all_token_ids[req.num_computed_tokens] for req, _ in batch],
                                  dtype=torch.long).to(dev)
        else:
            tokens = input_tokens.to(device=dev, dtype=torch.long)
        return self.model.decode_static(tokens, positions.to(dev), table.to(dev), self.kv_planes).float()

    def _eager(self, batch: list[tuple[Request, int]]) -> torch.Tensor:
        if self.inputs is not None and self.inputs.fits(batch):
            input_ids, meta = self.inputs.build(batch, self.kernels)
        else:
            input_ids, meta = build_metadata(batch, self.device)
            meta.kernels = self.kernels
        return self.model(input_ids, meta, self.kv_planes)

    @torch.inference_mode()
    def execute_with_prompt_logits(self, batch: list[tuple[Request, int]],
                                   want: list[bool]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Forward the batch (eagerly), also returning every new token's logits for the requests in ``want``.

        Args:
            batch: as :meth:`execute`.
            want: per request, whether to return the logits of all its new tokens (prompt logprobs).

        Returns:
            ``([len(batch), vocab] fp32 logits of each request's last new token, per request either None or
            [num_new_tokens, vocab] fp32 logits of each of its new tokens, in order)``.
        """
        input_ids, meta = build_metadata(batch, self.device)
        spans, indices = [], []
        for i, want_all in enumerate(want):
            start, end = meta.query_start[i], meta.query_start[i + 1]
            first = end - 1 if not want_all else start
            spans.append((len(indices), end - first))
            indices.extend(range(first, end))
        meta.logits_indices = indices
        logits = self.model(input_ids, meta, self.kv_planes)  # [sum of spans, vocab]
        last = logits[[offset + count - 1 for offset, count in spans]]
        rows = [logits[offset:offset + count] if w else None for (offset, count), w in zip(spans, want, strict=True)]
        return last, rows
