"""``cuda_graph`` persistent backend: each quantum size captured as one CUDA graph.

A quantum of ``q`` greedy steps (q = 1..8) is recorded once per size at bind
time over static buffers (:class:`QuantumBuffers`) and the lane's own KV
planes. Inside a quantum everything stays on the device: the model's
``decode_static`` step, argmax, the stop-id check, and the bookkeeping of how
many tokens count (steps after a stop still run — graphs cannot branch — but
are not counted, and their KV lands in pages already reserved for the
quantum). One host synchronization per quantum reads back the tokens and the
count.

On a device without CUDA (or with ``use_graphs=False``) the same static body
runs eagerly, which is how CPU tests check it against the ``eager`` backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from policy import MAX_QUANTUM_TOKENS
from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.persistent.contract import (
    BackendLaunchError,
    CacheBinding,
    PersistentBackend,
    PrelaunchError,
    QuantumRequest,
    QuantumResult,
    UnsupportedConfigurationError,
    check_launchable,
)

MAX_STOP_IDS = 16
"""Stop ids the on-device check holds (a request with more is refused before launch)."""


@dataclass
class QuantumBuffers:
    """Static device tensors a captured quantum reads and writes.

    Attributes:
        token: ``[1]`` int64 pending token, advanced each step.
        position: ``[1]`` int64 its position (committed KV length), advanced each step.
        block_table: ``[max_blocks]`` int64 page ids (padded with page 0).
        stop_ids: ``[MAX_STOP_IDS]`` int64, padded with -1.
        out_tokens: ``[8]`` int64 tokens sampled by each step.
        count: ``[1]`` int64 tokens that count (up to and including the first stop).
        alive: ``[1]`` bool, no stop seen yet.
    """

    token: torch.Tensor
    position: torch.Tensor
    block_table: torch.Tensor
    stop_ids: torch.Tensor
    out_tokens: torch.Tensor
    count: torch.Tensor
    alive: torch.Tensor

    @classmethod
    def allocate(cls, max_blocks: int, device: torch.device) -> QuantumBuffers:
        def z(n, dtype=torch.long):
            return torch.zeros(n, dtype=dtype, device=device)

        return cls(z(1), z(1), z(max_blocks), torch.full((MAX_STOP_IDS,), -1, dtype=torch.long, device=device),
                   z(MAX_QUANTUM_TOKENS), z(1), torch.ones(1, dtype=torch.bool, device=device))


class CudaGraphBackend(PersistentBackend):
    """Greedy quanta replayed from CUDA graphs over the bound KV cache.

    Args:
        model: a model with ``decode_static(token, position, block_table, kv_planes) -> [1, vocab]``.
        device: the lane's device.
        max_model_len: context limit; sets the padded block-table length.
        use_graphs: capture graphs (default: when ``device`` is CUDA).
        compile_step: ``torch.compile`` the decode step before capture so
            Inductor fuses its elementwise work (default: when graphs are used and
            the model does not set ``compile_decode_step = False``);
            the compiled step is still replayed from our own graphs.

    Raises:
        UnsupportedConfigurationError: the model has no static decode step.
    """

    name = "cuda_graph"
    checks_stop_set_on_device = True

    def __init__(self, model: torch.nn.Module, device: torch.device | str, max_model_len: int,
                 use_graphs: bool | None = None, compile_step: bool | None = None):
        if not hasattr(model, "decode_static"):
            raise UnsupportedConfigurationError(f"{type(model).__name__} has no static decode step for CUDA graphs")
        self.model = model
        self.device = torch.device(device)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if compile_step is None:  # a model may declare that Inductor has nothing left to fuse
            compile_step = self.use_graphs and getattr(model, "compile_decode_step", True)
        self.compile_step = compile_step
        self._step = model.decode_static
        self.max_blocks = -(-max_model_len // PAGE_SIZE)
        self.buffers = QuantumBuffers.allocate(self.max_blocks, self.device)
        self._planes: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.kernel_launches_per_quantum: dict[int, int] = {}

    def bind_cache(self, binding: CacheBinding) -> None:
        self._planes = binding.typed_planes()
        if self.use_graphs:
            self._capture_all()

    @torch.inference_mode()
    def _body(self, steps: int) -> None:
        """``steps`` greedy decode steps on the static buffers (what each graph records)."""
        b = self.buffers
        for s in range(steps):
            logits = self._step(b.token, b.position, b.block_table, self._planes)
            nxt = logits.argmax(-1)  # [1]
            b.out_tokens[s:s + 1].copy_(nxt)
            b.count.add_(b.alive.long())
            b.alive.logical_and_((nxt.view(1, 1) != b.stop_ids.view(1, -1)).all(-1))
            b.token.copy_(nxt)
            b.position.add_(1)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        if self.compile_step:
            # not fullgraph: the Triton attention kernel is excluded from Inductor (a graph break costs
            # Python time only while capturing; replays run the recorded kernels)
            self._step = torch.compile(self.model.decode_static, dynamic=False)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm up (compile, allocator) outside capture; writes land in page 0
            for _ in range(3):
                self._body(1)
        torch.cuda.current_stream(self.device).wait_stream(side)
        for steps in range(1, MAX_QUANTUM_TOKENS + 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._body(steps)
            self._graphs[steps] = graph
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run_quantum(self, req: QuantumRequest) -> QuantumResult:
        check_launchable(req, self._planes is not None)
        stop = req.stop_set
        if len(stop) > MAX_STOP_IDS:
            raise PrelaunchError(f"{len(stop)} stop ids; the on-device check holds {MAX_STOP_IDS}", "unsupported_envelope")
        pages = req.full_block_map.numel()
        if pages > self.max_blocks:
            raise PrelaunchError(f"block map of {pages} pages exceeds the captured {self.max_blocks}", "max_sequence_length")
        b = self.buffers
        host = torch.zeros(3 + self.max_blocks + MAX_STOP_IDS, dtype=torch.long)
        host[0], host[1] = req.pending_token, req.committed_kv_length
        host[2] = 1  # alive
        host[3:3 + pages] = req.full_block_map.to(torch.long)
        host[3 + self.max_blocks:3 + self.max_blocks + MAX_STOP_IDS] = -1
        if stop:
            host[3 + self.max_blocks:3 + self.max_blocks + len(stop)] = torch.tensor(stop, dtype=torch.long)
        try:
            staged = host.to(self.device, non_blocking=False)
            b.token.copy_(staged[0:1])
            b.position.copy_(staged[1:2])
            b.alive.copy_(staged[2:3].bool())
            b.count.zero_()
            b.block_table.copy_(staged[3:3 + self.max_blocks])
            b.stop_ids.copy_(staged[3 + self.max_blocks:])
            if self.use_graphs:
                self._graphs[req.max_tokens].replay()
            else:
                self._body(req.max_tokens)
            result = torch.cat([b.out_tokens, b.count]).tolist()  # the quantum's one host sync
        except Exception as exc:  # noqa: BLE001 - after launch the cache may have changed: terminal
            raise BackendLaunchError(f"cuda_graph quantum failed: {exc}") from exc
        count = int(result[-1])
        emitted = [int(t) for t in result[:count]]
        hit_stop = bool(stop) and emitted and emitted[-1] in stop
        committed = req.committed_kv_length + count
        finish = "eos" if hit_stop else (
            "max_sequence_length" if committed >= req.max_sequence_length else "max_tokens")
        return QuantumResult(finish, emitted, committed, emitted[-1] if emitted else req.pending_token, count)
