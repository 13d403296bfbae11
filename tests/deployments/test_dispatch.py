"""``deployments.dispatch.ended_by_error`` on plain async streams (no Ray cluster): how a Serve stream's end is
turned into items for the client."""

from __future__ import annotations

import asyncio
import logging

from ray.exceptions import RayActorError
from ray.serve.exceptions import RequestCancelledError

from deployments.dispatch import ended_by_error
from replicas.messages import GenerationChunk, GenerationError


def _items(stream) -> list:
    async def run():
        return [item async for item in ended_by_error(stream, "r", "persistent")]

    return asyncio.run(run())


async def _raising(exc: BaseException):
    yield GenerationChunk("r", [1])
    raise exc


def test_a_stream_its_reader_cancelled_just_ends_without_an_error_or_a_log(caplog):
    """Closing a dispatch (a stop string ended the request, or the client left) cancels its Serve stream, which
    then raises RequestCancelledError: that is no failure of the lane."""
    with caplog.at_level(logging.WARNING, logger="deployments.dispatch"):
        out = _items(_raising(RequestCancelledError("r")))
    assert [type(i) for i in out] == [GenerationChunk]
    assert not caplog.records


def test_a_replica_that_died_ends_the_stream_with_an_error_event():
    out = _items(_raising(RayActorError()))
    assert isinstance(out[-1], GenerationError) and out[-1].reason == "replica_died"


def test_anything_else_is_an_internal_error_event():
    out = _items(_raising(RuntimeError("boom")))
    assert isinstance(out[-1], GenerationError) and out[-1].reason == "internal_error"
