"""The pool board (replicas/pool_board.py) as a plain object: newest record per engine, long polls answered on a
change and not on a heartbeat, silent engines expired."""

from __future__ import annotations

import asyncio

from policy.pool import LoadRecord
from replicas.pool_board import PoolBoard


def _record(running: tuple[str, ...] = (), seq: int = 1, engine: str = "e") -> LoadRecord:
    return LoadRecord(engine_id=engine, lane="persistent", running=len(running), capacity=1, request_ids=running,
                      decoder_loaded=True, seq=seq)


def test_a_watch_returns_on_a_change_and_not_on_a_heartbeat():
    async def run():
        board = PoolBoard()
        version = await board.push(_record())
        watch = asyncio.ensure_future(board.watch(version, timeout_s=30))
        await board.push(_record(seq=2))  # heartbeat: same load
        await asyncio.sleep(0)
        assert not watch.done()
        await board.push(_record(("r1",), seq=3))
        new_version, records = await watch
        assert new_version == version + 1 and records == [_record(("r1",), seq=3)]
        await board.push(_record(seq=2))  # late: older than what the board holds
        assert (await board.snapshot())[1][0].request_ids == ("r1",)

    asyncio.run(run())


def test_an_engine_not_heard_from_is_dropped():
    async def run():
        board = PoolBoard(ttl_s=0.0)
        version = await board.push(_record(engine="gone"))
        await asyncio.sleep(0.01)
        new_version, records = await board.snapshot()
        assert records == [] and new_version > version

    asyncio.run(run())
