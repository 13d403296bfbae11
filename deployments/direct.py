"""``topology=direct``: one deployment whose replicas are both the HTTP ingress and a co-located replica.

:class:`DirectReplica` is a :class:`~deployments.replicas.ColocatedEngineReplica` (its own engine actor with both
lanes, in bundle 1 of its placement group) that also serves the OpenAI routes of
:class:`~deployments.ingress.OpenAIFrontend`, the same handlers, errors, request guard and ``/debug/stats`` as
:class:`~deployments.ingress.OpenAIIngress`. Its router is the same :class:`~deployments.router.Router` (lane choice,
``x-lane`` override, spill to the standard lane when the persistent lane is busy, fallback on a prelaunch
rejection), given a :class:`LocalHandle` to this very replica instead of Serve handles: a request goes from the
HTTP handler to the replica's ``generate``/``generate_persistent`` in the same process, then one actor call to
the engine. With ``direct_stream`` on, the engine still sends the output over its TCP connection to this process.

Cross-replica routing is Serve's here, not the router's: Serve's proxy (or HAProxy with
``RAY_SERVE_ENABLE_HA_PROXY=1``) picks the replica of each HTTP request, and that replica's router only chooses
between its own engine's two lanes. The router therefore keeps no view of the app's pool board
(``pool_view=False``): a busy persistent lane answers at once with a ``queued_work`` rejection, which is a spill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import AsyncIterator

from ray import serve
from ray.serve.exceptions import RequestCancelledError

from deployments.config import AppConfig
from deployments.ingress import OpenAIFrontend, openai_api
from deployments.replicas import ColocatedEngineReplica
from replicas.messages import GenerateRequest


class LocalHandle:
    """What the router needs of a Serve deployment handle, for an object in this process (no Serve hop).

    ``handle.options(...)`` is the handle itself; ``handle.name.remote(*args)`` calls ``replica.name``: an async
    generator method gives a :class:`LocalStream`, any other async method an :class:`asyncio.Task`. A
    :class:`~replicas.messages.GenerateRequest` argument goes without its ``caller`` (the replica would watch
    the caller's process; here that is its own, and its engine actor dies with it).

    Args:
        replica: the object whose methods are called (a :class:`DirectReplica`).
    """

    def __init__(self, replica):
        self._replica = replica

    def options(self, **_) -> LocalHandle:
        """This handle (Serve's per-call options, such as ``stream=True``, mean nothing in process)."""
        return self

    def __getattr__(self, name: str) -> _LocalMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return _LocalMethod(getattr(self._replica, name))


class _LocalMethod:
    """One method of a :class:`LocalHandle`'s object, called like a handle method (``.remote``)."""

    __slots__ = ("method",)

    def __init__(self, method):
        self.method = method

    def remote(self, *args, **kwargs):
        """Start the call on the running event loop: a :class:`LocalStream` for an async generator method, else a
        task (await it for the result)."""
        args = tuple(dataclasses.replace(a, caller=None) if isinstance(a, GenerateRequest) else a for a in args)
        if inspect.isasyncgenfunction(self.method):
            return LocalStream(self.method(*args, **kwargs))
        return asyncio.ensure_future(self.method(*args, **kwargs))


class _Raised:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


_END = object()


class LocalStream:
    """An async generator run at once in a task of its own and read like Serve's streaming response.

    Its items are buffered as they come (like a Serve stream's). :meth:`cancel` stops the generator (its
    ``finally`` runs: the replica cancels the engine's work); reading a cancelled stream raises Serve's
    :class:`~ray.serve.exceptions.RequestCancelledError`, as reading a cancelled Serve call does. An exception of
    the generator is raised to the reader after the items before it.
    """

    def __init__(self, items: AsyncIterator):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = False
        self._done = False
        self._task = asyncio.ensure_future(self._pump(items))

    async def _pump(self, items: AsyncIterator) -> None:
        try:
            async for item in items:
                self._queue.put_nowait(item)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            self._queue.put_nowait(_Raised(exc))
        finally:
            self._queue.put_nowait(_END)

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self):
        """The next item.

        Raises:
            StopAsyncIteration: the generator ended.
            RequestCancelledError: the stream was cancelled.
            Exception: what the generator raised.
        """
        if self._cancelled:
            raise RequestCancelledError()
        if self._done:
            raise StopAsyncIteration
        entry = await self._queue.get()
        if self._cancelled:
            raise RequestCancelledError()
        if entry is _END:
            self._done = True
            raise StopAsyncIteration
        if isinstance(entry, _Raised):
            self._done = True
            raise entry.exc
        return entry

    def cancel(self) -> None:
        """Stop the generator (unless it ended) and make the next read raise ``RequestCancelledError``; a reader
        waiting for an item is woken. Idempotent."""
        if self._cancelled or self._done:
            return
        self._cancelled = True
        self._task.cancel()
        self._queue.put_nowait(_END)


@serve.deployment(name="DirectReplica", max_ongoing_requests=65, health_check_period_s=5)
@serve.ingress(openai_api())
class DirectReplica(OpenAIFrontend, ColocatedEngineReplica):
    """A co-located replica (both lanes over one engine actor) that is also the app's HTTP ingress, routing each
    request to its own engine's lanes in process (``topology=direct``).

    Args:
        config: the app's configuration.
        engine_num_cpus: CPUs of the engine actor's bundle.
        engine_num_gpus: GPUs of the engine actor.

    Raises:
        Exception: the engine failed to load (the replica fails to start with the engine's message).
    """

    def __init__(self, config: AppConfig, engine_num_cpus: float, engine_num_gpus: float):
        ColocatedEngineReplica.__init__(self, config, engine_num_cpus, engine_num_gpus)
        local = LocalHandle(self)
        self._start_frontend(config, local, local, pool_view=False)
