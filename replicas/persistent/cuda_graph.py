"""``cuda_graph`` persistent backend: each quantum size captured as one CUDA graph.

A quantum of ``q`` greedy steps (q = 1..8) is recorded once per size at bind
time over static buffers (:class:`QuantumBuffers`) and the lane's own KV
planes. Inside a quantum everything stays on the device: the model's
``decode_static`` step, argmax, the stop-id check, and the bookkeeping of how
many tokens count (steps after a stop still run — graphs cannot branch — but
are not counted, and their KV lands in pages already reserved for the
quantum). One host synchronization per quantum reads back the tokens and the
count; the lane queues the next quantum before it (:class:`~replicas.persistent.contract.PipelinedBackend`),
so the GPU does not wait for the host between quanta.

On a device without CUDA (or with ``use_graphs=False``) the same static body
runs eagerly, which is how CPU tests check it against the ``eager`` backend.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass

import torch

from policy import MAX_QUANTUM_TOKENS
from replicas.graph_capture import capture_graphs
from replicas.kernels.paged_attention import PAGE_SIZE
from replicas.persistent.checkpoint import check_checkpoint_dir
from replicas.persistent.contract import (
    PERSISTENT_BACKENDS,
    BackendLaunchError,
    CacheBinding,
    PipelinedBackend,
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
    """Static device tensors a captured quantum reads and writes: views of two int64 buffers, so that one
    host-to-device copy stages a launch and one device-to-host copy reads it back.

    ``state`` (``[3 + MAX_STOP_IDS + max_blocks]``, written by the host before a launch):

    - ``token``: ``[1]`` pending token, advanced each step;
    - ``position``: ``[1]`` its position (committed KV length), advanced each step;
    - ``alive``: ``[1]`` 1 until a stop id is sampled, then 0;
    - ``stop_ids``: ``[MAX_STOP_IDS]`` padded with -1;
    - ``block_table``: ``[max_blocks]`` page ids (padded with page 0).

    ``out`` (``[MAX_QUANTUM_TOKENS + 1]``, read back after a quantum): ``out_tokens`` (``[8]``, the token
    each step sampled) and ``count`` (``[1]``, tokens that count: up to and including the first stop).
    """

    state: torch.Tensor
    out: torch.Tensor

    STOPS = 3
    """Offset of ``stop_ids`` in ``state``: a following launch stages ``state[STOPS:]`` (the token, position
    and alive flag before it stay as the quantum before left them)."""

    TABLE = STOPS + MAX_STOP_IDS
    """Offset of ``block_table`` in ``state``."""

    @classmethod
    def allocate(cls, max_blocks: int, device: torch.device) -> QuantumBuffers:
        return cls(torch.zeros(cls.TABLE + max_blocks, dtype=torch.long, device=device),
                   torch.zeros(MAX_QUANTUM_TOKENS + 1, dtype=torch.long, device=device))

    @property
    def token(self) -> torch.Tensor:
        return self.state[0:1]

    @property
    def position(self) -> torch.Tensor:
        return self.state[1:2]

    @property
    def alive(self) -> torch.Tensor:
        return self.state[2:3]

    @property
    def stop_ids(self) -> torch.Tensor:
        return self.state[self.STOPS:self.TABLE]

    @property
    def block_table(self) -> torch.Tensor:
        return self.state[self.TABLE:]

    @property
    def out_tokens(self) -> torch.Tensor:
        return self.out[:MAX_QUANTUM_TOKENS]

    @property
    def count(self) -> torch.Tensor:
        return self.out[MAX_QUANTUM_TOKENS:]


def greedy_step_reference(logits: torch.Tensor, state: torch.Tensor, out: torch.Tensor, step: int,
                          max_stop: int) -> None:
    """One greedy step's epilogue in torch ops (what :func:`replicas.kernels.triton_greedy.greedy_step` does in
    one launch): ``out[step] = argmax(logits)``, the count (``out[-1]``, zeroed at step 0) ``+= alive``,
    ``alive = 0`` on a stop id, ``state[0] = token``, ``state[1] += 1``. Shapes as :class:`QuantumBuffers`."""
    q = out.numel() - 1
    nxt = logits.argmax(-1)  # [1]
    stops = QuantumBuffers.STOPS
    token, position, alive, stop_ids = state[0:1], state[1:2], state[2:3], state[stops:stops + max_stop]
    out[step:step + 1].copy_(nxt)
    if step == 0:
        out[q:].zero_()
    out[q:].add_(alive)
    alive.mul_((nxt.view(1, 1) != stop_ids.view(1, -1)).all(-1))
    token.copy_(nxt)
    position.add_(1)


@PERSISTENT_BACKENDS.register("cuda_graph")
class CudaGraphBackend(PipelinedBackend):
    """Greedy quanta replayed from CUDA graphs over the bound KV cache, pipelined (see
    :class:`~replicas.persistent.contract.PipelinedBackend`).

    A launch writes its inputs into one of two pinned host buffers, queues one
    asynchronous copy of them into :class:`QuantumBuffers` ``state`` (a
    following launch copies only the stop ids and block table: its token and
    position are the ones the quantum before left on the device), replays the
    quantum's graph, queues one asynchronous copy of ``out`` into a pinned
    host buffer and records an event. Collecting waits on that event. Two
    slots of each, so quantum k+1 can be queued while k is still running.

    Args:
        model: a model with ``decode_static(token, position, block_table, kv_planes) -> [1, vocab]``.
        device: the lane's device.
        max_model_len: context limit; sets the padded block-table length.
        use_graphs: capture graphs (default: when ``device`` is CUDA).
        fused_epilogue: on CUDA, each step's argmax, stop check and bookkeeping in one Triton launch
            (:func:`replicas.kernels.triton_greedy.greedy_step`) instead of the torch ops of
            :func:`greedy_step_reference` (the engine config's ``fused_greedy_epilogue``).

    Raises:
        UnsupportedConfigurationError: the model has no static decode step.
    """

    name = "cuda_graph"
    checks_stop_set_on_device = True
    auto_rank = 0

    @classmethod
    def why_not(cls, device, model) -> str | None:
        if torch.device(device).type != "cuda":
            return "needs a CUDA device"
        if not model.has_static_decode:
            return f"{type(model).__name__} has no static decode step"
        return None

    @classmethod
    def for_core(cls, core, checkpoint: str | None = None) -> CudaGraphBackend:
        """The lane's graphs for ``core``'s model and device (``fused_greedy_epilogue`` from its config); a
        checkpoint, when given, must pass :func:`~replicas.persistent.checkpoint.check_checkpoint_dir`.

        Raises:
            CheckpointError: bad checkpoint directory.
            UnsupportedConfigurationError: the model has no static decode step."""
        if checkpoint:
            check_checkpoint_dir(checkpoint)
        return cls(core.model, core.runner.device, core.config.max_model_len,
                   fused_epilogue=core.config.fused_greedy_epilogue)

    def __init__(self, model: torch.nn.Module, device: torch.device | str, max_model_len: int,
                 use_graphs: bool | None = None, fused_epilogue: bool = True):
        if not model.has_static_decode:
            raise UnsupportedConfigurationError(f"{type(model).__name__} has no static decode step for CUDA graphs")
        self.model = model
        self.device = torch.device(device)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self._step = model.decode_static
        self.max_blocks = -(-max_model_len // PAGE_SIZE)
        self.buffers = QuantumBuffers.allocate(self.max_blocks, self.device)
        pin = self.device.type == "cuda"
        self._staging = torch.zeros(self.MAX_IN_FLIGHT, self.buffers.state.numel(), dtype=torch.long, pin_memory=pin)
        self._readback = torch.zeros(self.MAX_IN_FLIGHT, self.buffers.out.numel(), dtype=torch.long, pin_memory=pin)
        self._stage_np = self._staging.numpy()  # element writes through numpy: far cheaper than torch indexing
        self._done = [torch.cuda.Event() if pin else None for _ in range(self.MAX_IN_FLIGHT)]
        self._in_flight: deque[tuple[int, QuantumRequest]] = deque()
        self._launches = 0
        self._can_follow = False  # the device state is a launched quantum's, not yet discarded
        self._fused_epilogue = None
        if fused_epilogue and self.device.type == "cuda":
            from replicas.kernels.triton_greedy import greedy_step

            self._fused_epilogue = greedy_step
        self.fused_epilogue = self._fused_epilogue is not None
        """Whether each step's epilogue is the one Triton launch (CUDA and ``fused_epilogue``)."""
        self._workspace: dict = {}
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
            if self._fused_epilogue:  # argmax, stop check and bookkeeping: one launch instead of eight
                self._fused_epilogue(logits, b.state, b.out, s, MAX_STOP_IDS, self._workspace)
            else:
                greedy_step_reference(logits, b.state, b.out, s, MAX_STOP_IDS)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """One graph per quantum size, sharing a memory pool, after a warm-up of padding steps."""
        self._graphs = capture_graphs({steps: functools.partial(self._body, steps)
                                       for steps in range(1, MAX_QUANTUM_TOKENS + 1)},
                                      self.device, warmup=self._padding_step, warmup_runs=3)

    def _padding_step(self) -> None:
        """One warm-up step as a padding row (position -1), as the standard lane's decode graphs warm up: the
        RoPE/KV-write and decode-attention kernels write and read nothing for it, so binding to a cache in use
        changes none of it (docs/exactness.md, "Binding a persistent backend"). The step's epilogue advances
        the position, so each step starts from -1 again."""
        self.buffers.position.fill_(-1)
        self._body(1)

    def _check(self, req: QuantumRequest) -> None:
        check_launchable(req, self._planes is not None)
        if len(req.stop_token_ids) > MAX_STOP_IDS:
            raise PrelaunchError(f"{len(req.stop_token_ids)} stop ids; the on-device check holds {MAX_STOP_IDS}",
                                 "unsupported_envelope")
        pages = req.full_block_map.numel()
        if pages > self.max_blocks:
            raise PrelaunchError(f"block map of {pages} pages exceeds the captured {self.max_blocks}",
                                 "max_sequence_length")
        if len(self._in_flight) >= self.MAX_IN_FLIGHT:
            raise PrelaunchError(f"{len(self._in_flight)} quanta already in flight", "queued_work")

    @torch.inference_mode()
    def launch_quantum(self, req: QuantumRequest, follows: bool = False) -> None:
        """Queue ``req`` (see :class:`~replicas.persistent.contract.PipelinedBackend`).

        Raises:
            PrelaunchError: cache unbound, invalid or cancelled request, more than :data:`MAX_STOP_IDS` stop
                ids, a block map longer than the captured one, or two quanta already in flight.
            BackendLaunchError: the copies or the graph replay failed.
        """
        self._check(req)
        if follows and not self._can_follow:
            raise PrelaunchError("a following quantum needs one launched before it", "unsupported_envelope")
        slot = self._launches % self.MAX_IN_FLIGHT
        b, stage = self.buffers, self._stage_np[slot]
        stop, pages = req.stop_token_ids, req.full_block_map.numel()
        stage[0], stage[1], stage[2] = req.pending_token, req.committed_kv_length, 1
        stage[b.STOPS:b.TABLE] = -1
        stage[b.STOPS:b.STOPS + len(stop)] = stop
        stage[b.TABLE:b.TABLE + pages] = req.full_block_map.cpu().numpy()
        stage[b.TABLE + pages:] = 0
        first = b.STOPS if follows else 0  # a follower keeps the token, position and alive flag on the device
        try:
            b.state[first:].copy_(self._staging[slot, first:], non_blocking=True)
            if self.use_graphs:
                self._graphs[req.max_tokens].replay()
            else:
                self._body(req.max_tokens)
            self._readback[slot].copy_(b.out, non_blocking=True)
            if self._done[slot] is not None:
                self._done[slot].record()
        except Exception as exc:  # noqa: BLE001 - after launch the cache may have changed: terminal
            self._can_follow = False
            if self.device.type == "cuda":
                try:  # whatever was queued finishes before the caller frees pages or reuses the slot
                    torch.cuda.current_stream(self.device).synchronize()
                except Exception:  # noqa: BLE001, S110 - the device itself failed: nothing left to wait for
                    pass
            raise BackendLaunchError(f"cuda_graph quantum failed: {exc}") from exc
        self._launches += 1
        self._can_follow = True
        self._in_flight.append((slot, req))

    def collect_quantum(self) -> QuantumResult:
        """The oldest launched quantum's result (one host synchronization).

        Raises:
            BackendLaunchError: nothing in flight, or the device reported an error.
        """
        if not self._in_flight:
            raise BackendLaunchError("no quantum in flight")
        slot, req = self._in_flight.popleft()
        try:
            if self._done[slot] is not None:
                self._done[slot].synchronize()
            result = self._readback[slot].tolist()
        except Exception as exc:  # noqa: BLE001
            raise BackendLaunchError(f"cuda_graph quantum failed: {exc}") from exc
        count = int(result[-1])
        emitted = result[:count]
        stop = req.stop_token_ids
        hit_stop = bool(stop) and bool(emitted) and emitted[-1] in stop
        committed = req.committed_kv_length + count
        finish = "eos" if hit_stop else (
            "max_sequence_length" if committed >= req.max_sequence_length else "max_tokens")
        return QuantumResult(finish, emitted, committed, emitted[-1] if emitted else req.pending_token, count)

    def discard_quanta(self) -> None:
        """Wait for the quanta in flight and drop their results (the next launch cannot follow them)."""
        self._can_follow = False
        while self._in_flight:
            slot, _ = self._in_flight.popleft()
            if self._done[slot] is not None:
                self._done[slot].synchronize()
