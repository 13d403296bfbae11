"""The persistent-decode contract every backend implements (docs/design.md "Persistent decode contract").

The shapes and rules follow AMD aiter's ``aiter.MK1`` persistent decoder
(squashed commit 4b492bb), which is the production target; our ``eager`` and
``cuda_graph`` backends implement the same contract so the lane code is one.

Token bookkeeping across a quantum: ``pending_token`` is the last sampled token
whose KV is *not* yet in the cache; a quantum of ``k`` steps feeds it, writes
its KV at position ``committed_kv_length``, samples the next token, and so on.
Hence ``new committed == old committed + len(emitted)`` and
``new pending == emitted[-1]``.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from replicas.kernels.page import PAGE_SIZE
from replicas.persistent.checkpoint import CheckpointError  # noqa: F401 - re-exported, part of the error family
from replicas.registry import Registry

if TYPE_CHECKING:  # torch is imported where it runs: the app config reads PERSISTENT_BACKENDS without it
    import torch


class PersistentDecoderError(RuntimeError):
    """Base of the persistent decoder's errors."""

    reason = "persistent_decoder_error"


class PrelaunchError(PersistentDecoderError):
    """Raised before any native launch: nothing in the KV cache changed, so the request may fall back."""

    def __init__(self, message: str, reason: str = "unsupported_envelope"):
        super().__init__(message)
        self.reason = reason


class BackendLaunchError(PersistentDecoderError):
    """Raised during or after a launch: cache state may have changed; terminal for the request."""

    reason = "backend_launch_error"


class InvalidQuantumResultError(BackendLaunchError):
    """A quantum returned a result that breaks the contract (see :func:`validate_result`)."""

    reason = "invalid_quantum_result"


class UnsupportedConfigurationError(PersistentDecoderError):
    """The decoder cannot run this model/device/config at all."""

    reason = "unsupported_envelope"


class NativeBinaryError(PersistentDecoderError):
    """The native library could not be loaded."""

    reason = "native_binary_unavailable"


@dataclass(frozen=True)
class CacheBinding:
    """The engine's own KV cache as the decoder sees it (no second cache).

    Attributes:
        key_planes / value_planes: per layer, a contiguous 1-D ``uint8`` view of
            that layer's K (V) plane ``[num_blocks, PAGE_SIZE, KVH, D]``.
        block_counts: per layer, pages in the plane.
        block_strides: per layer, bytes per page (GPT-OSS bf16: 16,384).
        pools: per layer, the page pool id (one pool: all 0).
        page_shape: ``(PAGE_SIZE, KVH, D)``; dtype: the cache's element dtype.
    """

    key_planes: tuple[torch.Tensor, ...]
    value_planes: tuple[torch.Tensor, ...]
    block_counts: tuple[int, ...]
    block_strides: tuple[int, ...]
    pools: tuple[int, ...]
    page_shape: tuple[int, int, int]
    dtype: torch.dtype

    @classmethod
    def from_kv_tensor(cls, kv: torch.Tensor) -> CacheBinding:
        """Bind ``kv`` ``[2, L, num_blocks, PAGE_SIZE, KVH, D]`` (must be contiguous).

        Raises:
            UnsupportedConfigurationError: non-contiguous cache or a page size other than 16.
        """
        import torch

        if not kv.is_contiguous():
            raise UnsupportedConfigurationError("the KV cache tensor must be contiguous to bind")
        if kv.dim() != 6 or kv.shape[0] != 2 or kv.shape[3] != PAGE_SIZE:
            raise UnsupportedConfigurationError(f"unexpected KV cache shape {tuple(kv.shape)}")
        layers, blocks = kv.shape[1], kv.shape[2]
        stride = PAGE_SIZE * kv.shape[4] * kv.shape[5] * kv.element_size()
        return cls(
            key_planes=tuple(kv[0, i].reshape(-1).view(torch.uint8) for i in range(layers)),
            value_planes=tuple(kv[1, i].reshape(-1).view(torch.uint8) for i in range(layers)),
            block_counts=(blocks,) * layers,
            block_strides=(stride,) * layers,
            pools=(0,) * layers,
            page_shape=(PAGE_SIZE, kv.shape[4], kv.shape[5]),
            dtype=kv.dtype,
        )

    def typed_planes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(key_plane, value_plane)`` re-viewed as ``[num_blocks, *page_shape]`` of ``dtype``.

        These share storage with the engine's cache: writes land in it.
        """
        out = []
        for k, v, n in zip(self.key_planes, self.value_planes, self.block_counts, strict=True):
            out.append((k.view(self.dtype).view(n, *self.page_shape), v.view(self.dtype).view(n, *self.page_shape)))
        return out


@dataclass
class QuantumRequest:
    """One launch: up to ``max_tokens`` greedy steps for one sequence.

    Attributes:
        pending_token: last sampled token; its KV is not yet written.
        committed_kv_length: tokens whose KV is in the cache.
        max_sequence_length: the context limit.
        max_tokens: this quantum's size (1..8).
        full_block_map: contiguous 1-D int32 physical page ids covering at
            least ``committed_kv_length + max_tokens`` positions.
        rope_cosine / rope_sine: ``[len, 64]`` bf16 tables with the first 32
            columns filled (MK1 only; None for our backends).
        sliding_block_map: optional int32 page ids for sliding-window layers.
        cancellation_flag: set it to stop the quantum early (between steps).
        stop_token_ids: every id that ends generation
            (:func:`replicas.stops.stop_token_set`: the request's stop ids and, unless it
            ignores EOS, the model's EOS ids); empty: the quantum never stops early. Our
            backends check the whole set on device; MK1's kernel checks one id (the
            adapter maps the set to MK1's ``eos_token_id``/``ignore_eos``), so with more
            than one it may run past a stop id: the lane checks every emitted token on
            the host and cuts the output at the first stop (``replicas.stops.accept_tokens``).
    """

    pending_token: int
    committed_kv_length: int
    max_sequence_length: int
    max_tokens: int
    full_block_map: torch.Tensor
    rope_cosine: torch.Tensor | None = None
    rope_sine: torch.Tensor | None = None
    sliding_block_map: torch.Tensor | None = None
    cancellation_flag: threading.Event | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class QuantumResult:
    """What one launch produced.

    Attributes:
        finish_reason: ``"eos"`` (a stop id was emitted), ``"max_tokens"`` (the
            quantum ran its size), ``"max_sequence_length"`` or ``"cancelled"``.
        emitted_tokens: the tokens sampled, in order (1..max_tokens).
        committed_kv_length: the new committed length.
        pending_token: ``emitted_tokens[-1]``.
        completed_epochs: steps run.
    """

    finish_reason: str
    emitted_tokens: list[int] = field(default_factory=list)
    committed_kv_length: int = 0
    pending_token: int = -1
    completed_epochs: int = 0


def check_launchable(req: QuantumRequest, cache_bound: bool) -> None:
    """Every backend's checks before a launch: a bound cache, a valid request, not cancelled.

    Raises:
        PrelaunchError: nothing has run, the request may fall back.
    """
    if not cache_bound:
        raise PrelaunchError("no KV cache bound", "unsupported_envelope")
    validate_request(req)
    if req.cancellation_flag is not None and req.cancellation_flag.is_set():
        raise PrelaunchError("cancelled before launch", "cancelled")


def validate_request(req: QuantumRequest) -> None:
    """Check a request before launch. Raises :class:`PrelaunchError` (nothing has run yet)."""
    if not 1 <= req.max_tokens:
        raise PrelaunchError(f"max_tokens must be >= 1, got {req.max_tokens}", "no_output_remaining")
    if req.committed_kv_length + req.max_tokens > req.max_sequence_length:
        raise PrelaunchError("quantum would pass max_sequence_length", "max_sequence_length")
    import torch

    bm = req.full_block_map
    if bm.dtype != torch.int32 or bm.dim() != 1 or not bm.is_contiguous():
        raise PrelaunchError("full_block_map must be a contiguous 1-D int32 tensor", "unsupported_envelope")
    if bm.numel() * PAGE_SIZE < req.committed_kv_length + req.max_tokens:
        raise PrelaunchError(
            f"full_block_map has {bm.numel()} pages; the quantum needs "
            f"{req.committed_kv_length + req.max_tokens} positions", "unsupported_envelope",
        )


def validate_result(req: QuantumRequest, res: QuantumResult) -> None:
    """The caller's check of every result (docs/design.md "QuantumResult and its validation").

    Raises:
        InvalidQuantumResultError: ``1 <= len(emitted) <= max_tokens``,
            ``committed == old + len(emitted)`` or ``pending == emitted[-1]`` fails.
    """
    n = len(res.emitted_tokens)
    if not 1 <= n <= req.max_tokens:
        raise InvalidQuantumResultError(f"quantum emitted {n} tokens, expected 1..{req.max_tokens}")
    if res.committed_kv_length != req.committed_kv_length + n:
        raise InvalidQuantumResultError(
            f"committed_kv_length {res.committed_kv_length} != {req.committed_kv_length} + {n}"
        )
    if res.pending_token != res.emitted_tokens[-1]:
        raise InvalidQuantumResultError(
            f"pending_token {res.pending_token} != last emitted {res.emitted_tokens[-1]}"
        )


class PersistentBackend(abc.ABC):
    """A persistent decoder bound to one replica's KV cache.

    Life cycle: construct (may raise :class:`UnsupportedConfigurationError`,
    :class:`CheckpointError`, :class:`NativeBinaryError`) → :meth:`bind_cache`
    → :meth:`run_quantum` per quantum.

    A backend registers itself in its own file with ``@PERSISTENT_BACKENDS.register(name)``; the app config's
    ``persistent_backend`` choices, the CLI's and :func:`~replicas.persistent.factory.create_backend` read the
    registry. Its capabilities are class attributes, read before it is built (the replica makes its page
    allocator with or without a prefix cache from :attr:`takes_cached_pages` before the backend exists).
    """

    name: str = "abstract"
    checks_stop_set_on_device: bool = True
    """True when every stop id is checked inside the quantum (not only one EOS id)."""
    takes_cached_pages: bool = True
    """True when a request may start from KV pages an earlier request computed (the lane's prefix cache:
    the first pages of ``full_block_map`` are then shared, read-only pages); False keeps prefix caching off
    for the lane (MK1's envelope requires it off)."""
    auto_rank: ClassVar[int | None] = None
    """Where ``persistent_backend=auto`` tries this backend (lowest first, the first whose :meth:`why_not` is
    None); None: only when asked for by name."""

    @classmethod
    def why_not(cls, device: torch.device, model) -> str | None:
        """Why ``auto`` does not pick this backend for ``model`` on ``device`` (None: it may). A backend named
        explicitly is built anyway: its constructor raises if it cannot run."""
        return None

    @classmethod
    def for_core(cls, core, checkpoint: str | None = None) -> PersistentBackend:
        """Build (not yet bound) this backend for a replica's :class:`~replicas.engine.EngineCore`.

        Raises:
            UnsupportedConfigurationError, CheckpointError, NativeBinaryError: as the backend's constructor.
        """
        raise NotImplementedError

    @abc.abstractmethod
    def bind_cache(self, binding: CacheBinding) -> None:
        """Bind the engine's KV planes. Raises :class:`UnsupportedConfigurationError`."""

    @abc.abstractmethod
    def run_quantum(self, req: QuantumRequest) -> QuantumResult:
        """Run one quantum.

        Raises:
            PrelaunchError: rejected before launch (cache untouched).
            BackendLaunchError: failed after launch (cache may have changed).
        """


PERSISTENT_BACKENDS: Registry[type[PersistentBackend]] = Registry(
    "persistent backend", PersistentBackend,
    modules=("replicas.persistent.eager", "replicas.persistent.cuda_graph", "replicas.persistent.mk1"))
"""The persistent backends by name, in registration order: each module listed registers its backend when
imported (on the registry's first lookup); a new backend is its own file plus its module here."""


class PipelinedBackend(PersistentBackend):
    """A backend that can queue the next quantum on the device before the host reads the current one.

    Batch-one decode with one host synchronization per quantum leaves the GPU idle
    while the host reads a quantum's tokens, streams them and prepares the next
    launch. Like vLLM's asynchronous scheduling, the lane
    instead launches quantum k+1 right behind quantum k, *before* collecting
    k: k+1 *follows* k, i.e. it starts from the token and position k leaves on
    the device, and counts nothing if k emitted a stop id. The caller predicts
    k+1's request as if k emits all its tokens (``committed_kv_length`` =
    k's + k's ``max_tokens``; its ``pending_token`` is unknown at launch and
    ignored by the backend) and discards k+1 when k ends the request.

    Life cycle: :meth:`launch_quantum` (``follows=False`` for the first quantum
    and after every collected result that did not have a follower), at most
    :data:`MAX_IN_FLIGHT` launched and not yet collected, :meth:`collect_quantum`
    in launch order, :meth:`discard_quanta` before the request's pages are freed.
    :meth:`run_quantum` is one launch and its collection.
    """

    MAX_IN_FLIGHT = 2

    @abc.abstractmethod
    def launch_quantum(self, req: QuantumRequest, follows: bool = False) -> None:
        """Queue ``req`` on the device and return without waiting for it.

        Args:
            req: the quantum; with ``follows`` its ``pending_token`` is ignored (the device's is used).
            follows: continue from the quantum launched just before (still in flight or collected).

        Raises:
            PrelaunchError: rejected before launch (nothing queued, cache untouched).
            BackendLaunchError: the launch failed (cache may have changed).
        """

    @abc.abstractmethod
    def collect_quantum(self) -> QuantumResult:
        """Wait for the oldest launched quantum and return its result (a follower of a quantum that emitted a
        stop id returns no tokens; the caller discards it instead).

        Raises:
            BackendLaunchError: it failed, or nothing is in flight.
        """

    @abc.abstractmethod
    def discard_quanta(self) -> None:
        """Wait for every launched quantum to finish and drop their results (their KV writes land in pages the
        caller reserved for them; call this before freeing those pages)."""

    def run_quantum(self, req: QuantumRequest) -> QuantumResult:
        """One quantum: :meth:`launch_quantum` (not following) then :meth:`collect_quantum`."""
        self.launch_quantum(req)
        return self.collect_quantum()
