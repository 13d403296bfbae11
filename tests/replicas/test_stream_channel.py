"""The direct output stream (``replicas.stream_channel``) over real loopback TCP sockets."""

from __future__ import annotations

import asyncio

import pytest

from replicas.messages import GenerationChunk, Rejection
from replicas.stream_channel import HELLO, ReplyTo, StreamListener, StreamSenders


async def _connected(senders: StreamSenders, reply_to: ReplyTo, timeout_s: float = 5.0):
    """The channel once its background connect is done (the first call only starts it)."""
    assert senders.channel(reply_to) is None  # never waits: the first dispatch goes through Ray
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (channel := senders.channel(reply_to)) is None:
        assert asyncio.get_running_loop().time() < deadline, "never connected"
        await asyncio.sleep(0.01)
    return channel


async def _two_dispatches():
    """A started listener with two open dispatches, and a sender connected to it."""
    listener = StreamListener("127.0.0.1")
    await listener.start()
    a, qa = listener.open()
    b, qb = listener.open()
    senders = StreamSenders()
    return listener, (a, qa), (b, qb), senders, await _connected(senders, a)


async def _send_until_refused(channel, key: str, tries: int) -> None:
    """Keep writing frames until the channel sees its connection closed (fails if it never does)."""
    with pytest.raises(ConnectionError):
        for _ in range(tries):
            await channel.send(key, [GenerationChunk("r")], False)
            await asyncio.sleep(0.02)


def test_frames_reach_their_dispatch_in_order_and_unknown_keys_are_dropped():
    async def run():
        listener, (a, qa), (b, qb), senders, channel = await _two_dispatches()
        assert senders.channel(b) is channel  # one connection per listener, shared by its dispatches
        await channel.send(a.key, [GenerationChunk("r1", [1, 2], "ab")], False)
        await channel.send(b.key, [Rejection("r2", "queued_work")], True)
        await channel.send("no-such-dispatch", [GenerationChunk("r3", [9])], True)
        await channel.send(a.key, [GenerationChunk("r1", [3], "c", finish_reason="length")], True)
        first, last = await asyncio.wait_for(qa.get(), 5), await asyncio.wait_for(qa.get(), 5)
        rejected = await asyncio.wait_for(qb.get(), 5)
        assert first[0][0].token_ids == [1, 2] and first[1] is False
        assert last[0][0].finish_reason == "length" and last[1] is True
        assert rejected[0][0].reason == "queued_work" and rejected[1] is True
        assert listener.stats()["frames"] == 4 and listener.stats()["connections"] == 1
        listener.close(a.key)
        listener.close(b.key)
        assert listener.stats()["open_dispatches"] == 0
        await listener.stop()

    asyncio.run(run())


def test_frames_sent_in_one_turn_of_the_loop_go_out_in_one_write_and_arrive_in_order():
    async def run():
        listener, (a, qa), (b, qb), senders, channel = await _two_dispatches()
        await asyncio.gather(  # three readers woken by one step each send their frame in the same turn
            channel.send(a.key, [GenerationChunk("r1", [1])], False),
            channel.send(b.key, [GenerationChunk("r2", [7])], False),
            channel.send(a.key, [GenerationChunk("r1", [2], finish_reason="length")], True),
        )
        assert (channel.frames, channel.writes) == (3, 1)
        first, second = await asyncio.wait_for(qa.get(), 5), await asyncio.wait_for(qa.get(), 5)
        other = await asyncio.wait_for(qb.get(), 5)
        assert [first[0][0].token_ids, second[0][0].token_ids, other[0][0].token_ids] == [[1], [2], [7]]
        assert (first[1], second[1], other[1]) == (False, True, False)
        await channel.send(a.key, [GenerationChunk("r1", [3])], False)  # a later turn: a write of its own
        assert senders.stats()["writes"] == 2 and senders.stats()["frames"] == 4
        await listener.stop()

    asyncio.run(run())


def test_a_connection_with_a_wrong_token_is_refused_before_any_frame_is_read():
    async def run():
        listener = StreamListener("127.0.0.1")
        await listener.start()
        reply_to, queue = listener.open()
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        writer.write(HELLO + b"0" * len(listener.token))
        writer.write(b"\x00\x00\x00\x05junk!")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the listener hung up
        assert listener.stats()["refused"] == 1 and listener.stats()["connections"] == 0
        assert queue.empty()
        # a sender with a forged token gets nowhere either
        senders = StreamSenders()
        forged = ReplyTo(reply_to.host, reply_to.port, "f" * len(listener.token), reply_to.key)
        senders.channel(forged)
        await asyncio.sleep(0.2)
        channel = senders.channel(forged)
        if channel is not None:  # connected before the refusal: its frames must not arrive
            await _send_until_refused(channel, reply_to.key, 50)
        await asyncio.sleep(0.1)
        assert queue.empty() and listener.stats()["refused"] >= 2
        await listener.stop()

    asyncio.run(run())


def test_a_sender_sees_the_listener_go_away_and_falls_back_to_ray():
    async def run():
        listener = StreamListener("127.0.0.1")
        await listener.start()
        reply_to, _ = listener.open()
        senders = StreamSenders()
        channel = await _connected(senders, reply_to)
        await listener.stop()
        # closing the server does not close accepted connections in every Python: close ours from the far side
        for task in asyncio.all_tasks():
            if "StreamListener._serve" in repr(task.get_coro()):
                task.cancel()
        await _send_until_refused(channel, reply_to.key, 100)
        assert senders.channel(reply_to) is None  # next dispatch: through Ray, reconnect attempted
        assert senders.stats()["connected"] == 0

    asyncio.run(run())
