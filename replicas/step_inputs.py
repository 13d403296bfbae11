"""The model runner's step inputs built as tensors: persistent device buffers, no per-token Python.

:func:`replicas.model_runner.build_metadata` (the list path, kept as the
oracle) walks every new token in Python to compute its position and cache slot.
:class:`StepInputs` instead sends per *sequence* facts to the device in one
copy and derives the per-token tensors there:

* a persistent device block table ``[max_rows, max_blocks]`` int32 with one row
  per running sequence; each step copies only the page ids that are new since
  that row was last synced (a decoding sequence gains a page every 16 tokens),
  so the host work per step is O(sequences + new pages), not O(context);
* one pinned host staging buffer per step holding the new tokens' ids, each
  sequence's row, first position, query offsets, context length, and the new
  (row, column, page) entries; one non-blocking host-to-device copy;
* on the device: the new pages are scattered into the table, the batch's rows
  gathered, and ``positions = start[seq] + (t - query_start[seq])``,
  ``slot = table[seq, position // 16] * 16 + position % 16`` computed for all
  tokens at once.

Nothing in :meth:`StepInputs.build` waits for the device. The pinned staging
buffer is rewritten only after the copy that last read it has completed (an
event recorded after each copy; in practice the previous step's sampled-token
read-back has already waited for it).

A row belongs to one :class:`~replicas.request.Request` object (and its current
block-table list: a preempted request comes back with a new list and is
resynced from page 0); rows of sequences that are no longer scheduled are
recycled when the rows run out.
"""

from __future__ import annotations

import torch

from replicas.kernels.paged_attention import PAGE_SIZE, AttentionMetadata, DeviceMetadata
from replicas.request import Request


class _TableRows:
    """``block_tables`` of :class:`AttentionMetadata` as views of the batch's rows of the device table."""

    def __init__(self, table: torch.Tensor, pages: list[int]):
        self._table, self._pages = table, pages

    def __len__(self) -> int:
        return len(self._pages)

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -len(self._pages) <= i < len(self._pages):
            raise IndexError(i)
        return self._table[i, : self._pages[i]].long()

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def request_tokens(req: Request, start: int, end: int) -> list[int]:
    """``req.all_token_ids[start:end]`` without building the whole list (prompt and output sliced apart)."""
    n_prompt = len(req.prompt_token_ids)
    if start >= n_prompt:
        return req.output_token_ids[start - n_prompt:end - n_prompt]
    if end <= n_prompt:
        return req.prompt_token_ids[start:end]
    return req.prompt_token_ids[start:] + req.output_token_ids[: end - n_prompt]


class StepInputs:
    """Persistent buffers for :class:`~replicas.model_runner.ModelRunner`'s tensor metadata path.

    Args:
        device: where the model runs.
        max_blocks: block-table width (``ceil(max_model_len / PAGE_SIZE)``; the decode graphs' width).
        max_rows: sequences whose rows are kept at once (more than the largest batch).
    """

    def __init__(self, device: torch.device | str, max_blocks: int, max_rows: int = 512):
        self.device = torch.device(device)
        self.max_blocks = max_blocks
        self.max_rows = max_rows
        self.table = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=self.device)
        self._owner: list[Request | None] = [None] * max_rows
        self._table_of: list[list[int] | None] = [None] * max_rows
        self._synced = [0] * max_rows
        self._row_of: dict[int, int] = {}  # id(request) -> row
        self._free = list(range(max_rows - 1, -1, -1))
        self._host: torch.Tensor | None = None
        self._staged: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def fits(self, batch: list[tuple[Request, int]]) -> bool:
        """Whether every block table fits the width and the batch fits the rows."""
        return len(batch) <= self.max_rows and all(len(r.block_table) <= self.max_blocks for r, _ in batch)

    def _row(self, req: Request, batch_ids: set[int], updates: list[int]) -> int:
        row = self._row_of.get(id(req))
        if row is None or self._owner[row] is not req:
            if not self._free:
                self._recycle(batch_ids)
            row = self._free.pop()
            self._owner[row], self._table_of[row], self._synced[row] = req, None, 0
            self._row_of[id(req)] = row
        table = req.block_table
        if self._table_of[row] is not table or self._synced[row] > len(table):
            self._table_of[row], self._synced[row] = table, 0  # a new (or shrunk) table: resync it all
        synced = self._synced[row]
        for col in range(synced, len(table)):
            updates += (row, col, table[col])
        self._synced[row] = len(table)
        return row

    def _recycle(self, keep: set[int]) -> None:
        """Free every row whose sequence is not in the batch being built."""
        for row, owner in enumerate(self._owner):
            if owner is not None and id(owner) not in keep:
                self._row_of.pop(id(owner), None)
                self._owner[row], self._table_of[row] = None, None
                self._free.append(row)

    def _staging(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._host is None or self._host.numel() < n:
            size = max(n, 2 * (self._host.numel() if self._host is not None else 0), 4096)
            pin = self.device.type == "cuda"
            self._host = torch.empty(size, dtype=torch.int32, pin_memory=pin)
            self._staged = torch.empty(size, dtype=torch.int32, device=self.device)
            self._copied = None
        elif self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffer (normally long done)
        return self._host, self._staged

    def build(self, batch: list[tuple[Request, int]], kernels: bool = True,
              input_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, AttentionMetadata]:
        """Flatten ``batch`` into ``input_ids [T]`` int32 and :class:`AttentionMetadata` (with its
        :class:`DeviceMetadata`), equal to :func:`~replicas.model_runner.build_metadata`'s.

        ``input_tokens`` (``[len(batch)]`` int64 on the device, a pure-decode batch only) is copied into
        ``input_ids`` on the device, behind the staging copy, in place of the requests' token ids (the
        previous step's picks, not read by the host yet).

        Raises:
            ValueError: a request's block table does not cover its new tokens, or does not fit (:meth:`fits`).
        """
        ids: list[int] = []
        starts: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        pages: list[int] = []
        for req, n in batch:
            start = req.num_computed_tokens
            end = start + n
            if len(req.block_table) * PAGE_SIZE < end:
                raise ValueError(f"request {req.request_id}: {len(req.block_table)} pages cannot hold {end} tokens")
            ids += request_tokens(req, start, end) if input_tokens is None else [0] * n
            starts.append(start)
            query_start.append(query_start[-1] + n)
            context_lens.append(end)
            pages.append(len(req.block_table))
        if not self.fits(batch):
            raise ValueError(f"batch of {len(batch)} does not fit {self.max_rows} rows x {self.max_blocks} pages")
        batch_ids = {id(r) for r, _ in batch}
        updates: list[int] = []
        rows = [self._row(req, batch_ids, updates) for req, _ in batch]
        t, b, u = len(ids), len(batch), len(updates) // 3
        flat = ids + rows + starts + query_start + context_lens + updates[0::3] + updates[1::3] + updates[2::3]
        host, staged = self._staging(len(flat))
        host.numpy()[: len(flat)] = flat
        staged[: len(flat)].copy_(host[: len(flat)], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        o = 0
        input_ids, o = staged[o:o + t], o + t
        if input_tokens is not None:
            input_ids.copy_(input_tokens)  # device to device, queued after the staging copy it overwrites
        rows_t, o = staged[o:o + b].long(), o + b
        start_t, o = staged[o:o + b].long(), o + b
        qs_t, o = staged[o:o + b + 1], o + b + 1
        ctx_t, o = staged[o:o + b], o + b
        if u:
            upd_row, upd_col, upd_page = staged[o:o + u].long(), staged[o + u:o + 2 * u].long(), staged[o + 2 * u:o + 3 * u]
            self.table.index_put_((upd_row, upd_col), upd_page)
        table = self.table.index_select(0, rows_t)  # [B, max_blocks]
        qs_long = qs_t.long()
        seq = torch.repeat_interleave(torch.arange(b, device=self.device), qs_long[1:] - qs_long[:-1], output_size=t)
        positions = start_t[seq] + torch.arange(t, device=self.device) - qs_long[seq]
        slots = table[seq, positions // PAGE_SIZE].long() * PAGE_SIZE + positions % PAGE_SIZE
        meta = AttentionMetadata(
            positions=positions, slot_mapping=slots, query_start=query_start, context_lens=context_lens,
            block_tables=_TableRows(table, pages), kernels=kernels,
            device=DeviceMetadata(query_start=qs_t, context_lens=ctx_t, block_table=table,
                                  last_token_indices=qs_long[1:] - 1),
        )
        return input_ids, meta
