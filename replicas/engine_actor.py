"""The engine actor: owns one replica's engine and KV cache.

It is a plain class; ``deployments/`` makes it a Ray actor (placed in the
replica's placement-group bundle) so that this package never imports
``ray.serve``. Methods are async so a replica can stream from it:
``generate`` is an async generator of :mod:`replicas.messages` objects.

Compute runs off the event loop: the standard lane in one engine thread that
loops schedule → run → postprocess while work exists; the persistent lane in a
worker thread per request (one at a time).

Co-located (``lane="colocated"``, one replica per GPU for single-GPU users): one engine core (one
copy of the weights, one KV page pool) serves both lanes, and the one engine thread runs them in
turn: a standard step, then one step of the persistent request (its prefill, or one quantum),
then a standard step again... so the model never runs twice at once on the device. Quanta are
not pipelined there (the next quantum is launched after the current one is read), so nothing of
the persistent lane is in flight on the device while a standard step runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator

from policy import Mode
from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.engine_core import EngineCore
from replicas.messages import GenerateRequest, GenerationChunk, GenerationError, Rejection
from replicas.persistent.checkpoint import CheckpointError
from replicas.persistent.contract import PersistentDecoderError
from replicas.persistent.factory import backend_takes_cached_pages, create_backend
from replicas.persistent.faults import FaultInjection, with_faults
from replicas.persistent.lane import PersistentLane
from replicas.stream_channel import Relayed, StreamSenders

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


def _post(loop: asyncio.AbstractEventLoop, out: asyncio.Queue, item: Item) -> bool:
    """Hand ``item`` to the caller's event loop; False if that loop is gone (the output is dropped)."""
    try:
        loop.call_soon_threadsafe(out.put_nowait, item)
        return True
    except RuntimeError:  # loop closed: nobody is listening any more
        return False


class EngineActor:
    """One replica's engine.

    Args:
        config: engine configuration.
        lane: ``"standard"`` or ``"persistent"``.
        mode: persistent-decoder mode (``off``/``auto``/``required``).
        backend: persistent backend name (``auto``, ``eager``).
        checkpoint: persistent-decoder checkpoint directory, or None.
        fault_injection: tests only: wrap the persistent backend so it fails on
            schedule (:class:`~replicas.persistent.faults.FaultInjection`); None in production.
        tracing: an ``ops.telemetry.tracing.TracingConfig`` for this process's spans (None: from ``OTEL_*``).

    Telemetry (``ops.telemetry.engine_telemetry``, built here once and injected into the lanes): a
    ``generation`` span per request, child of the caller's span named by
    ``GenerateRequest.trace_context``; ``quantum`` spans; queue-time, quanta, KV-page and
    decoder-health metrics.

    Raises:
        PersistentDecoderLoadError: ``required`` mode and the decoder failed to load.
    """

    def __init__(self, config: EngineConfig, lane: str = "standard", mode: str = "auto",
                 backend: str = "auto", checkpoint: str | None = None,
                 fault_injection: FaultInjection | dict | None = None, tracing=None):
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
        if self.engine is not None:
            threading.Thread(target=self._engine_loop, name="engine-loop", daemon=True).start()
        self._publish_gauges()
        # Ray drops a gauge nobody set recently: refresh the page/health gauges while idle too
        threading.Thread(target=self._refresh_gauges, name="gauges", daemon=True).start()

    def _warm_up(self) -> dict | None:
        """``EngineConfig.warmup`` on a GPU: compile the prefill kernels (and, with a standard lane, capture
        every decode graph) before the first request; what it did, for ``settings``. None when off or on CPU."""
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
        from replicas.persistent.contract import PipelinedBackend

        cfg = self.core.config
        out = {"load_format": cfg.load_format, "dtype": str(cfg.resolved_dtype()).removeprefix("torch."),
               "device": str(cfg.resolved_device()), "prefix_caching": self.core.allocator.enable_prefix_caching,
               **self.core.describe_kernels(), "warmup": self._warmup}
        if self.persistent is not None:
            backend = self.persistent.backend
            out["persistent_backend"] = backend_name
            out["pipeline_quanta"] = bool(cfg.pipeline_quanta and isinstance(backend, PipelinedBackend))
            out["fused_greedy_epilogue"] = bool(getattr(backend, "fused_epilogue", False))
            out["prefix_caching"] = self.persistent.prefix_caching
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
                "direct_streams": self._senders.stats()}

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
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        done = False
        cancel = threading.Event()
        channel = self._senders.channel(request.reply_to) if request.reply_to is not None else None
        request_telemetry = self.telemetry[target].start(request)
        if target == "persistent" and not self.colocated:
            threading.Thread(target=self._persistent_worker, args=(request, cancel, loop, out, request_telemetry), daemon=True).start()
        elif target == "persistent":
            self._inbox.put(("persistent", (request, cancel, request_telemetry), loop, out))
            self._wakeup.set()
        else:
            self._requests[request.request_id] = request_telemetry
            self._inbox.put(("add", request, loop, out))
            self._wakeup.set()
        spilled = request.spilled and target == "standard"
        self._spilled_running += spilled
        open_choices = request.params.n if target == "standard" else 1
        sent = 0

        def take(item: Item) -> None:
            nonlocal open_choices, done
            request_telemetry.chunk(item)
            if _is_last(item):
                open_choices -= 1
                done = open_choices == 0 or not isinstance(item, GenerationChunk)

        try:
            while not done:
                item = await out.get()
                take(item)
                if channel is None:
                    yield item
                    continue
                batch = [item]  # and whatever else is ready: one frame
                while not done and not out.empty():
                    batch.append(out.get_nowait())
                    take(batch[-1])
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
            if not done:  # the caller went away: stop the work and free its pages
                cancel.set()
                if target == "standard":
                    self._inbox.put(("abort", request.request_id, None, None))
                    self._wakeup.set()
            self._requests.pop(request.request_id, None)
            request_telemetry.end()
            self._publish_gauges()

    def _persistent_worker(self, request, cancel, loop, out, request_telemetry=None) -> None:
        try:
            items = self.persistent.generate(request, cancel, request_telemetry)
            for item in items:
                if _is_last(item):
                    for _ in items:  # run the lane's cleanup first: the pages are back when the caller sees the end
                        pass
                if not _post(loop, out, item):
                    cancel.set()
            self._publish_gauges()  # pages are back in the pool now
        except Exception as exc:  # noqa: BLE001 - never leave the caller waiting
            logger.exception("persistent lane failed")
            _post(loop, out, GenerationError(request.request_id, str(exc), "persistent", "engine", "engine_error"))

    def _engine_loop(self) -> None:
        """The engine thread: drain the inbox, run one standard step, then (co-located) advance each
        persistent request by one step (prefill or quantum); sleep while there is no work."""
        sinks: dict[str, tuple] = {}
        open_choices: dict[str, int] = {}
        jobs: list[list] = []  # co-located persistent requests: [items iterator, request id, loop, out, cancel]

        def deliver(rid: str, item: Item) -> None:
            loop, out = sinks[rid]
            if not _post(loop, out, item):  # the caller's loop is gone: drop the request
                self.engine.abort(rid)
                del sinks[rid]
            elif _is_last(item):
                open_choices[rid] = open_choices.get(rid, 1) - 1
                if open_choices[rid] <= 0 or not isinstance(item, GenerationChunk):
                    del sinks[rid]
                    open_choices.pop(rid, None)

        while True:
            while True:
                try:
                    op, arg, loop, out = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if op == "add":
                    sinks[arg.request_id] = (loop, out)
                    open_choices[arg.request_id] = arg.params.n
                    try:
                        self.engine.add_request(arg.request_id, arg.prompt_token_ids, arg.params)
                    except ValueError as exc:
                        deliver(arg.request_id, GenerationError(arg.request_id, str(exc), "standard", "validation", "invalid_request"))
                elif op == "abort":
                    self.engine.abort(arg)
                    sinks.pop(arg, None)
                    open_choices.pop(arg, None)
                elif op == "persistent":
                    request, cancel, request_telemetry = arg
                    jobs.append([self.persistent.generate(request, cancel, request_telemetry), request.request_id, loop, out, cancel])
            if not self.engine.has_unfinished() and not jobs:
                if self.colocated:
                    self._snapshot = self._colocated_stats()
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            if self.engine.has_unfinished():
                self._standard_step(sinks, deliver)
            for job in list(jobs):
                if self._advance(job):
                    jobs.remove(job)
            if self.colocated:
                self._snapshot = self._colocated_stats()

    def _standard_step(self, sinks: dict, deliver) -> None:
        try:
            chunks = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the batch's requests, keep the replica
            logger.exception("engine step failed")
            for rid in list(sinks):
                self.engine.abort(rid)
                deliver(rid, GenerationError(rid, f"engine step failed: {exc}", "standard", "engine", "engine_error"))
            return
        if self.colocated:  # before the chunks go out: a caller that saw its last chunk sees its pages back
            self._snapshot = self._colocated_stats()
        for chunk in chunks:
            if chunk.request_id in sinks:
                deliver(chunk.request_id, chunk)

    def _advance(self, job: list) -> bool:
        """Run a co-located persistent request up to its next item (its prefill or one quantum) and hand the
        item over; True once the request is over (its pages are back in the pool then)."""
        items, rid, loop, out, cancel = job
        try:
            item = next(items)
        except StopIteration:
            return True
        except Exception as exc:  # noqa: BLE001 - never leave the caller waiting
            logger.exception("persistent lane failed")
            _post(loop, out, GenerationError(rid, str(exc), "persistent", "engine", "engine_error"))
            return True
        last = _is_last(item)
        if last:
            for _ in items:  # run the lane's cleanup (pages freed) now, in this thread, before the caller sees the end
                pass
            self._snapshot = self._colocated_stats()
        if not _post(loop, out, item):
            cancel.set()
        return last
