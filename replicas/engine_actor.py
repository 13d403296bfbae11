"""The engine actor: owns one replica's engine and KV cache.

It is a plain class; ``deployments/`` makes it a Ray actor (placed in the
replica's placement-group bundle) so that this package never imports
``ray.serve``. Methods are async so a replica can stream from it:
``generate`` is an async generator of :mod:`replicas.messages` objects.

Compute runs off the event loop, in one engine thread per actor, whatever its lanes (vLLM v1
``EngineCore.step`` style). Each turn of its loop:

1. drain the inbox: typed messages :class:`Add` (a request for a lane) and :class:`Abort` (its caller
   went away), in arrival order;
2. one standard step (schedule → run → postprocess) if the standard lane is present and holds work;
3. persistent steps (:meth:`PersistentLane.step`: the request's prefill, or one quantum) if that lane is
   present and holds work: one, or, co-located with a standard step run this turn, up to
   ``EngineConfig.colocated_persistent_steps`` (the scheduling policy between the lanes);

and it sleeps while no lane holds work. Every item goes to its caller through one place
(:class:`_Sink`: the caller's queue, and the count of the request's open choices, which says which
item is its last); what a step produced crosses to the actor's event loop in one hand-over
(:class:`_Outbox`), not one per token. A standard or persistent actor is the same loop with one lane absent; co-located
(``lane="colocated"``, one replica per GPU for single-GPU users) just means both are present over
one engine core (one copy of the weights, one KV page pool), so the model never runs twice at once
on the device. Quanta are not pipelined there (the next quantum is launched after the current one
is read), so nothing of the persistent lane is in flight on the device while a standard step runs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from policy import Mode
from policy.pool import LoadRecord
from replicas.config import EngineConfig
from replicas.messages import GenerateRequest, GenerationChunk, GenerationError, Rejection
from replicas.persistent.checkpoint import CheckpointError
from replicas.persistent.contract import PersistentDecoderError
from replicas.persistent.faults import FaultInjection, with_faults
from replicas.pool_board import LoadPublisher
from replicas.stream_channel import Relayed, StreamSenders

if TYPE_CHECKING:  # the engine (torch) is imported in the actor's constructor: the Serve replica processes
    # that only create this actor (the lane wrappers) or read its stats (the ingress) never load torch
    from replicas.engine import LLMEngine
    from replicas.persistent.lane import PersistentLane

logger = logging.getLogger(__name__)

GAUGE_REFRESH_S = 5.0
"""Seconds between refreshes of the KV-page and decoder-health gauges (Ray expires gauges left unset)."""
Item = GenerationChunk | Rejection | GenerationError
LANES = ("standard", "persistent", "colocated")


class PersistentDecoderLoadError(RuntimeError):
    """Mode ``required`` and the persistent decoder could not be loaded."""


def _is_last(item: Item) -> bool:
    return not isinstance(item, GenerationChunk) or item.finish_reason is not None


def _placement_group_id() -> str | None:
    """Hex id of the placement group this actor runs in (None outside Ray or outside a group)."""
    try:
        import ray

        return ray.get_runtime_context().get_placement_group_id() if ray.is_initialized() else None
    except ImportError:
        return None


def _actor_name() -> str | None:
    """This actor's name (None outside Ray or for an unnamed actor)."""
    try:
        import ray

        return (ray.get_runtime_context().get_actor_name() or None) if ray.is_initialized() else None
    except ImportError:
        return None


def _node_id() -> str | None:
    """Hex id of the Ray node this actor runs on (None outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except ImportError:
        return None


def device_facts(device) -> dict:
    """Which accelerator this process sees and uses (read-only; ``stats()["accelerator"]``).

    Args:
        device: the engine's ``torch.device``.

    Returns:
        ``cuda_visible_devices`` (the ``CUDA_VISIBLE_DEVICES`` Ray set for this actor's GPU share, or
        None), ``gpu_ids`` (Ray's accelerator ids of this actor: physical GPU indices, strings), and on a
        CUDA device ``cuda_device`` (``torch.cuda.current_device()``: an index into the visible devices,
        so 0 in every single-GPU actor), ``cuda_device_name`` and ``cuda_device_uuid`` (the physical
        GPU's UUID, the same in every process that sees that GPU); those three are None on CPU.
    """
    gpu_ids = None
    try:
        import ray

        if ray.is_initialized():
            gpu_ids = [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
    except ImportError:
        pass
    out = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpu_ids": gpu_ids,
           "cuda_device": None, "cuda_device_name": None, "cuda_device_uuid": None}
    if device.type == "cuda":
        import torch

        index = torch.cuda.current_device() if device.index is None else device.index
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        out.update(cuda_device=index, cuda_device_name=props.name, cuda_device_uuid=None if uuid is None else str(uuid))
    return out


def _put_all(entries: list[tuple[asyncio.Queue, tuple]]) -> None:
    """Runs on the callers' event loop: put each posted ``(item, last)`` on its request's queue."""
    for out, posted in entries:
        out.put_nowait(posted)


class _Outbox:
    """One engine-loop turn's items, grouped by the event loop that reads them, handed over in one
    ``call_soon_threadsafe`` per loop and turn (every request of an actor is read on the actor's one event
    loop, so that is one cross-thread hand-over per step, whatever the batch size, instead of one per
    token: vLLM's engine core likewise sends one ``EngineCoreOutputs`` per step)."""

    def __init__(self):
        self._entries: dict[asyncio.AbstractEventLoop, list] = {}
        self.handovers = 0
        """Cross-thread hand-overs so far (``stats()["deliveries"]``)."""
        self.items = 0
        """Items handed over so far."""

    def add(self, loop: asyncio.AbstractEventLoop, out: asyncio.Queue, posted: tuple) -> bool:
        """Queue ``posted`` for ``out``; False if ``loop`` is closed (nobody listens: the item is dropped)."""
        if loop.is_closed():
            return False
        self._entries.setdefault(loop, []).append((out, posted))
        return True

    def flush(self) -> list[asyncio.AbstractEventLoop]:
        """Hand every queued item over; returns the loops that turned out closed (their items dropped)."""
        entries, self._entries = self._entries, {}
        gone = []
        for loop, batch in entries.items():
            # counted before the hand-over: a reader that got the items may read the counters at once
            self.handovers += 1
            self.items += len(batch)
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # loop closed meanwhile: nobody is listening any more
                self.handovers -= 1
                self.items -= len(batch)
                gone.append(loop)
        return gone


@dataclass
class _Sink:
    """Where one request's items go: the caller's event loop and queue. It counts the request's open choices
    (``n`` on the standard lane, 1 on the persistent one), the one place that decides which item is a
    request's last: the last choice's final chunk, or any error or rejection. Items are posted as
    ``(item, last)`` through the engine loop's :class:`_Outbox`."""

    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    lane: str
    open_choices: int

    def post(self, outbox: _Outbox, item: Item) -> tuple[bool, bool]:
        """Queue ``item`` in ``outbox``; returns (delivered, last). Not delivered: the caller's loop is gone."""
        last = False
        if _is_last(item):
            self.open_choices -= 1
            last = self.open_choices <= 0 or not isinstance(item, GenerationChunk)
        return outbox.add(self.loop, self.out, (item, last)), last


@dataclass(frozen=True)
class Add:
    """Inbox message: start ``request`` on ``lane`` (``standard`` or ``persistent``), its items to ``sink``."""

    request: GenerateRequest
    lane: str
    sink: _Sink
    cancel: threading.Event
    telemetry: object


@dataclass(frozen=True)
class Abort:
    """Inbox message: the caller of ``request_id`` on ``lane`` went away; drop the request, free its pages."""

    request_id: str
    lane: str


class EngineActor:
    """One replica's engine.

    Args:
        config: engine configuration.
        lane: ``"standard"``, ``"persistent"`` or ``"colocated"`` (both lanes over one engine core).
        mode: persistent-decoder mode (``off``/``auto``/``required``).
        backend: persistent backend name (``auto``, ``eager``).
        checkpoint: persistent-decoder checkpoint directory, or None.
        fault_injection: tests only: wrap the persistent backend so it fails on
            schedule (:class:`~replicas.persistent.faults.FaultInjection`); None in production.
        tracing: an ``ops.telemetry.tracing.TracingConfig`` for this process's spans (None: from ``OTEL_*``).
        load_board: name of the application's pool board (:mod:`replicas.pool_board`): the engine pushes its
            :class:`~policy.pool.LoadRecord` there when a persistent or spilled request starts or ends, and a
            heartbeat; None: it pushes nothing (:meth:`load` still answers).

    Telemetry (``ops.telemetry.engine_telemetry``, built here once and injected into the lanes): a
    ``generation`` span per request, child of the caller's span named by
    ``GenerateRequest.trace_context``; ``quantum`` spans; queue-time, quanta, KV-page and
    decoder-health metrics.

    Raises:
        PersistentDecoderLoadError: ``required`` mode and the decoder failed to load.
    """

    def __init__(self, config: EngineConfig, lane: str = "standard", mode: str = "auto",
                 backend: str = "auto", checkpoint: str | None = None,
                 fault_injection: FaultInjection | dict | None = None, tracing=None, load_board: str | None = None):
        from replicas.engine import LLMEngine
        from replicas.engine_core import EngineCore
        from replicas.persistent.factory import backend_takes_cached_pages

        if lane not in LANES:
            raise ValueError(f"lane must be one of {', '.join(LANES)}, got {lane!r}")
        self.lane_name = lane
        self.colocated = lane == "colocated"
        self.mode = Mode.parse(mode)
        if self.colocated:  # quanta one at a time: the engine thread runs a standard step between them
            config = config.model_copy(update={"pipeline_quanta": False})
        # the persistent lane shares prefix-cached pages where its backend takes them (not mk1: MK1's envelope
        # requires prefix caching off); co-located, the standard lane keeps the prefix cache either way (an
        # mk1 lane then just never looks pages up)
        prefix = config.enable_prefix_caching and (lane != "persistent" or backend_takes_cached_pages(backend))
        self.core = EngineCore.load(config, enable_prefix_caching=prefix)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox = _Outbox()  # engine thread only
        self._wakeup = threading.Event()
        self.persistent: PersistentLane | None = None
        self.engine: LLMEngine | None = None
        self._spilled_running = 0  # standard-lane requests the router spilled from the persistent lane
        if lane != "persistent":
            self.engine = LLMEngine(self.core, on_scheduled=self._scheduled)
            threading.Thread(target=self.core.grammars.warm, name="grammar-warmup", daemon=True).start()
        if lane != "standard":
            self.persistent = self._load_persistent(backend, checkpoint, fault_injection)
        from ops.telemetry.engine_telemetry import (
            build_engine_telemetry,  # start-up only, never per token
        )

        self._warmup = self._warm_up()
        backend_name = self.persistent.backend.name if self.persistent and self.persistent.backend else None
        self.settings = self._settings(backend_name)
        self.telemetry = {
            name: build_engine_telemetry(name, config.name, backend_name if name == "persistent" else None,
                                         tracing, self.settings)
            for name in (("standard", "persistent") if self.colocated else (lane,))
        }
        self.accelerator = device_facts(self.core.runner.device)
        self._requests: dict = {}  # request id -> RequestTelemetry, for the engine thread's queue-time hook
        self._senders = StreamSenders()  # direct output streams to the ingress processes (replicas.stream_channel)
        self._snapshot: dict = self._colocated_stats() if self.colocated else {}
        threading.Thread(target=self._engine_loop, name="engine-loop", daemon=True).start()
        self._publish_gauges()
        # persistent requests held, for the load records: a tuple replaced whole (the heartbeat thread reads it)
        self._persistent_ids: tuple[str, ...] = ()
        self._load_seq, self._started_at = itertools.count(1), time.time()
        self._engine_id = _actor_name() or f"engine-{os.getpid()}"
        self._publisher = LoadPublisher(load_board, self._load_record) if load_board else None
        if self._publisher is not None:
            self._publisher.start()  # on the board before the replica reports ready
        # Ray drops a gauge nobody set recently: refresh the page/health gauges while idle too
        threading.Thread(target=self._refresh_gauges, name="gauges", daemon=True).start()

    def _warm_up(self) -> dict | None:
        """``EngineConfig.warmup`` on a GPU: compile the prefill kernels (and, with a standard lane, capture
        every decode graph) before the first request; what it did, for ``settings``. None when off or on CPU."""
        from replicas.engine import LLMEngine

        if not self.core.config.warmup or self.core.runner.device.type != "cuda":
            return None
        # a throwaway engine over the same core (graphs, kernels and KV pool are the core's): the serving
        # engine's hooks and counters see no warm-up request
        done = LLMEngine(self.core).warm_up(capture_graphs=self.engine is not None)
        logger.info("warm-up: %s", done)
        return done

    def _load_persistent(self, backend: str, checkpoint: str | None, fault_injection) -> PersistentLane:
        """The persistent lane over this engine's core: its backend bound to the KV cache, or a lane
        that rejects every request (and reports why) when the backend cannot load or bind.

        Raises:
            PersistentDecoderLoadError: mode ``required`` and the backend failed to load or bind.
        """
        from replicas.persistent.factory import create_backend
        from replicas.persistent.lane import PersistentLane

        decoder, error = None, None
        try:
            decoder = create_backend(backend, self.core, checkpoint)
            if fault_injection is not None:
                decoder = with_faults(decoder, FaultInjection.model_validate(fault_injection))
        except (PersistentDecoderError, CheckpointError) as exc:
            if self.mode is Mode.REQUIRED:
                raise PersistentDecoderLoadError(
                    f"persistent-decoder=required, but the persistent decoder could not be loaded: {exc}"
                ) from exc
            logger.warning("persistent decoder unavailable (%s); requests will fall back", exc)
            error = f"{exc.reason}: {exc}"
        try:
            return PersistentLane(self.core, decoder, error)  # binds the KV cache
        except PersistentDecoderError as exc:
            if self.mode is Mode.REQUIRED:
                raise PersistentDecoderLoadError(
                    f"persistent-decoder=required, but binding the KV cache failed: {exc}"
                ) from exc
            logger.warning("persistent decoder could not bind the KV cache (%s); requests will fall back", exc)
            return PersistentLane(self.core, None, f"{exc.reason}: {exc}")

    async def ready(self) -> dict:
        """Static facts about this replica, once loaded."""
        return {
            "lane": self.lane_name, "model": self.core.config.name,
            "max_model_len": self.core.config.max_model_len, "device": str(self.core.runner.device),
            "placement_group_id": _placement_group_id(),
            **(await self.stats()),
        }

    def _settings(self, backend_name: str | None) -> dict:
        """What this engine resolved at load and runs with (``/debug/stats`` ``settings``, span attributes):
        the decode kernels and MoE backend (:meth:`EngineCore.describe_kernels`), the persistent backend and
        whether its quanta are pipelined and use the fused greedy epilogue."""
        cfg = self.core.config
        out = {"load_format": cfg.load_format, "dtype": str(cfg.resolved_dtype()).removeprefix("torch."),
               "device": str(cfg.resolved_device()), "prefix_caching": self.core.allocator.enable_prefix_caching,
               **self.core.describe_kernels(), "warmup": self._warmup}
        if self.persistent is not None:
            backend = self.persistent.backend
            out["persistent_backend"] = backend_name
            out["pipeline_quanta"] = self.persistent.pipeline_depth == 1
            out["fused_greedy_epilogue"] = bool(getattr(backend, "fused_epilogue", False))
            out["prefix_caching"] = self.persistent.prefix_caching
        if self.engine is not None:
            out["blocking_sync"] = self.engine.blocking_sync
            out["async_scheduling"] = self.engine.async_scheduling
        if self.colocated:
            out["colocated_persistent_steps"] = cfg.colocated_persistent_steps
        return out

    def _stats(self) -> dict:
        if self.colocated:
            return self._snapshot
        if self.persistent is not None:
            return self.persistent.stats()
        return {**self.engine.stats(), "spilled_running": self._spilled_running}

    def _colocated_stats(self) -> dict:
        """Co-located stats, taken in the engine thread between steps (so the lanes' pages add up):
        the shared pool's totals, and per lane its pages in use (``kv_pages_in_use``; standard: the
        distinct pages its requests hold; persistent: the rest of the pages in use)."""
        a = self.core.allocator
        standard, persistent = self.engine.stats(), self.persistent.stats()
        standard_pages = self.engine.pages_in_use()
        persistent_pages = a.num_used - standard_pages
        pool = ("lane", "kv_pages_total", "kv_pages_free", "kv_pages_cached")
        return {
            "lane": "colocated", "kv_pages_total": a.num_blocks, "kv_pages_free": a.num_free,
            "kv_pages_cached": a.num_cached, "running": standard["running"] + persistent["running"],
            "waiting": standard["waiting"], "decoder_healthy": persistent["decoder_healthy"],
            "unhealthy_reason": persistent["unhealthy_reason"], "backend": persistent["backend"],
            "quanta_run": persistent["quanta_run"], "spilled_running": self._spilled_running,
            "lanes": {
                "standard": {**{k: v for k, v in standard.items() if k not in pool}, "kv_pages_in_use": standard_pages},
                "persistent": {**{k: v for k, v in persistent.items() if k not in pool},
                               "kv_pages_in_use": persistent_pages},
            },
        }

    def _publish_gauges(self) -> None:
        stats = self._stats()
        if not self.colocated:
            self.telemetry[self.lane_name].gauges(stats)
            return
        for name, lane in stats["lanes"].items():  # each lane's pages in use, against the shared pool's free
            self.telemetry[name].gauges({**lane, "kv_pages_total": lane["kv_pages_in_use"] + stats["kv_pages_free"],
                                         "kv_pages_free": stats["kv_pages_free"],
                                         "decoder_healthy": stats["decoder_healthy"]})

    def _refresh_gauges(self, period_s: float = GAUGE_REFRESH_S) -> None:
        while True:
            time.sleep(period_s)
            try:
                self._publish_gauges()
            except Exception:  # noqa: BLE001 - telemetry must never take the engine down
                logger.debug("gauge refresh failed", exc_info=True)

    async def stats(self) -> dict:
        """KV page accounting and queue depth, the resolved settings, and where the engine runs (placement
        group, node, process id, the accelerator it sees: :func:`device_facts`; read by tests, the chaos runs
        and the debug endpoint)."""
        return {**self._stats(), "placement_group_id": _placement_group_id(), "settings": self.settings,
                "node_id": _node_id(), "pid": os.getpid(), "accelerator": self.accelerator,
                "direct_streams": self._senders.stats(),
                "deliveries": {"handovers": self._outbox.handovers, "items": self._outbox.items}}

    def _load_record(self) -> LoadRecord:
        """This engine's load now (:class:`~policy.pool.LoadRecord`; any thread)."""
        fields = {}
        if self.persistent is not None:
            lane, ids = self.persistent.stats(), self._persistent_ids
            fields.update(running=len(ids), capacity=1, request_ids=ids, decoder_loaded=lane["backend"] is not None,
                          decoder_healthy=lane["decoder_healthy"], unhealthy_reason=lane["unhealthy_reason"])
        if self.engine is not None:
            lane = self.engine.stats()
            fields.update(standard_running=lane["running"], standard_waiting=lane["waiting"])
        return LoadRecord(engine_id=self._engine_id, lane=self.lane_name, started_at=self._started_at,
                          seq=next(self._load_seq), updated_at=time.time(), spilled_running=self._spilled_running,
                          **fields)

    async def load(self) -> LoadRecord:
        """This engine's load record now (the replica's health check reads it)."""
        return self._load_record()

    def _hold(self, request_id: str, held: bool) -> bool:
        """Count ``request_id`` as a persistent request this engine holds (or not); True when that changed."""
        ids = self._persistent_ids
        if held == (request_id in ids):
            return False
        self._persistent_ids = (*ids, request_id) if held else tuple(i for i in ids if i != request_id)
        return True

    def _load_changed(self) -> None:
        if self._publisher is not None:
            self._publisher.publish()

    def _scheduled(self, request_id: str) -> None:
        request_telemetry = self._requests.get(request_id)
        if request_telemetry is not None:
            request_telemetry.scheduled()

    def _lane_for(self, lane: str | None) -> str:
        """The lane that serves a request here: this actor's own, or (co-located) the one asked for.

        Raises:
            ValueError: ``lane`` names a lane this actor does not run.
        """
        if not self.colocated:
            if lane not in (None, self.lane_name):
                raise ValueError(f"this engine runs the {self.lane_name} lane, not {lane!r}")
            return self.lane_name
        if lane not in (None, "standard", "persistent"):
            raise ValueError(f"lane must be standard or persistent, got {lane!r}")
        return lane or "standard"

    async def generate(self, request: GenerateRequest, lane: str | None = None) -> AsyncIterator[Item | Relayed]:
        """Stream the events of one request (see :mod:`replicas.messages`).

        With ``request.reply_to`` set and this actor's connection to that listener up, the events go
        over the direct stream instead (:mod:`replicas.stream_channel`: every event available at once
        in one frame, the last frame marked final) and this generator yields one :class:`Relayed`
        (how many events it sent) at the end. The first request to a new listener starts the connect
        and streams through Ray. A connection that breaks mid-request ends the request here with a
        :class:`GenerationError` (``stream_lost``) and stops its work.

        Args:
            request: the request.
            lane: co-located engines: ``"persistent"`` or ``"standard"`` (default); other engines serve
                their own lane (None or its name).

        Raises:
            ValueError: ``lane`` is not a lane of this engine.
        """
        target = self._lane_for(lane)
        out: asyncio.Queue = asyncio.Queue()
        done = False
        cancel = threading.Event()
        channel = self._senders.channel(request.reply_to) if request.reply_to is not None else None
        request_telemetry = self.telemetry[target].start(request)
        if target == "standard":
            self._requests[request.request_id] = request_telemetry
        sink = _Sink(asyncio.get_running_loop(), out, target, request.params.n if target == "standard" else 1)
        self._send(Add(request, target, sink, cancel, request_telemetry))
        spilled = request.spilled and target == "standard"
        self._spilled_running += spilled
        held = target == "persistent"  # counted in this engine's load record while it runs
        if held:
            self._hold(request.request_id, True)
        if held or spilled:
            self._load_changed()
        sent = 0

        def take(posted: tuple[Item, bool]) -> Item:
            nonlocal done
            item, done = posted
            request_telemetry.chunk(item)
            if done and held and self._hold(request.request_id, False):  # say so before the last item goes out
                self._load_changed()
            return item

        try:
            while not done:
                item = take(await out.get())
                if channel is None:
                    yield item
                    continue
                batch = [item]  # and whatever else is ready: one frame
                while not done and not out.empty():
                    batch.append(take(out.get_nowait()))
                try:
                    await channel.send(request.reply_to.key, batch, done)
                except ConnectionError as exc:
                    done = False  # the work stops in the finally below
                    yield GenerationError(request.request_id, f"the direct stream to the ingress broke ({exc})",
                                          target, "postlaunch", "stream_lost")
                    return
                sent += len(batch)
            if channel is not None:
                yield Relayed(request.reply_to.key, sent)
        finally:
            self._spilled_running -= spilled
            if (held and self._hold(request.request_id, False)) or spilled:
                self._load_changed()
            if not done:  # the caller went away: stop the work and free its pages
                cancel.set()
                self._send(Abort(request.request_id, target))
            self._requests.pop(request.request_id, None)
            request_telemetry.end()
            self._publish_gauges()

    def _send(self, message: Add | Abort) -> None:
        """Put ``message`` in the engine thread's inbox and wake it."""
        self._inbox.put(message)
        self._wakeup.set()

    def _engine_loop(self) -> None:
        """The engine thread, one loop for every lane: drain the inbox, run one standard step if the standard
        lane is present and holds work, then persistent steps if that lane is present and holds work (one; up
        to ``colocated_persistent_steps`` after a standard step); sleep while no lane holds work. What each
        of these produced is handed to the callers' event loop at once, in one hand-over (:class:`_Outbox`)."""
        sinks: dict[str, _Sink] = {}
        budget = self.core.config.colocated_persistent_steps
        while True:
            self._drain_inbox(sinks)
            self._flush(sinks)
            standard = self.engine is not None and self.engine.has_unfinished()
            if not standard and not (self.persistent is not None and self.persistent.has_unfinished()):
                if self.colocated:
                    self._snapshot = self._colocated_stats()
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            if standard:
                self._standard_step(sinks)
                self._flush(sinks)
            for _ in range(budget if standard else 1):
                if self.persistent is None or not self.persistent.has_unfinished():
                    break
                self._persistent_step(sinks)
                self._flush(sinks)
            if self.colocated:
                self._snapshot = self._colocated_stats()

    def _flush(self, sinks: dict[str, _Sink]) -> None:
        """Hand the items queued since the last flush to the callers' event loops; a request whose caller's
        loop turned out closed is dropped from its lane (pages back)."""
        for loop in self._outbox.flush():
            for rid in [rid for rid, sink in sinks.items() if sink.loop is loop]:
                self._drop(sinks.pop(rid), rid)

    def _drop(self, sink: _Sink, rid: str) -> None:
        """Stop ``rid`` on its lane: its caller is gone."""
        if sink.lane == "standard":
            self.engine.abort(rid)
        else:
            self.persistent.abort(rid)

    def _drain_inbox(self, sinks: dict[str, _Sink]) -> None:
        """Apply every message waiting in the inbox, in order: :class:`Add` starts a request on its lane (a
        refusal is delivered at once), :class:`Abort` drops one."""
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, Abort):
                sinks.pop(msg.request_id, None)
                if msg.lane == "standard":
                    self.engine.abort(msg.request_id)
                else:
                    self.persistent.abort(msg.request_id)
                continue
            rid = msg.request.request_id
            sinks[rid] = msg.sink
            if msg.lane == "standard":
                try:
                    self.engine.add_request(rid, msg.request.prompt_token_ids, msg.request.params)
                except ValueError as exc:
                    self._deliver(sinks, rid, GenerationError(rid, str(exc), "standard", "validation",
                                                              "invalid_request"))
            else:
                refused = self.persistent.add(msg.request, msg.cancel, msg.telemetry)
                if refused is not None:
                    self._deliver(sinks, rid, refused)

    def _deliver(self, sinks: dict[str, _Sink], rid: str, item: Item) -> None:
        """Queue ``item`` for the caller of ``rid`` (the one place items leave the engine thread; the loop hands
        them over after each step); forget the request after its last item, or drop it from its lane when its
        caller's loop is gone."""
        sink = sinks.get(rid)
        if sink is None:
            return
        delivered, last = sink.post(self._outbox, item)
        if not delivered:
            del sinks[rid]
            self._drop(sink, rid)
        elif last:
            del sinks[rid]

    def _standard_step(self, sinks: dict[str, _Sink]) -> None:
        """One standard step; an exception in it fails every request the standard lane holds (the replica
        keeps serving)."""
        try:
            chunks = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the batch's requests, keep the replica
            logger.exception("engine step failed")
            for rid in [rid for rid, sink in sinks.items() if sink.lane == "standard"]:
                self.engine.abort(rid)
                self._deliver(sinks, rid, GenerationError(rid, f"engine step failed: {exc}", "standard", "engine",
                                                          "engine_error"))
            return
        if self.colocated:  # before the chunks go out: a caller that saw its last chunk sees its pages back
            self._snapshot = self._colocated_stats()
        for chunk in chunks:
            self._deliver(sinks, chunk.request_id, chunk)

    def _persistent_step(self, sinks: dict[str, _Sink]) -> None:
        """One persistent step (the request's prefill or one quantum). The lane frees the pages of a request
        before returning its last item; an exception escaping the lane ends that request with
        ``engine_error`` (its pages freed), and the engine thread goes on."""
        rid = self.persistent.current_request_id
        try:
            items = self.persistent.step()
        except Exception as exc:  # noqa: BLE001 - never leave the caller waiting
            logger.exception("persistent lane failed")
            try:
                self.persistent.abort(rid)
            except Exception:  # noqa: BLE001
                logger.exception("freeing the failed persistent request failed")
            items = [GenerationError(rid, str(exc), "persistent", "engine", "engine_error")]
        if self.colocated and items and _is_last(items[-1]):
            self._snapshot = self._colocated_stats()  # its pages are back before the caller sees the end
        for item in items:
            self._deliver(sinks, rid, item)
