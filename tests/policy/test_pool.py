"""The pool model (policy/pool.py): one record per engine, newest wins, and the three readings of it."""

from __future__ import annotations

from policy.pool import LoadRecord, PoolModel


def _persistent(engine: str, *running: str, healthy: bool = True, seq: int = 1, started: float = 1.0) -> LoadRecord:
    return LoadRecord(engine_id=engine, lane="persistent", running=len(running), capacity=1, request_ids=running,
                      decoder_loaded=True, decoder_healthy=healthy, seq=seq, started_at=started)


def test_free_replicas_counts_healthy_engines_less_others_and_own_requests():
    pool = PoolModel([_persistent("a"), _persistent("b", "theirs"), _persistent("c", healthy=False)])
    assert pool.persistent_replicas("persistent") == 2
    assert pool.free_replicas("persistent", own_running=0) == 1
    assert pool.free_replicas("persistent", own_running=1) == 0  # ours, not on a record yet, still counts


def test_a_record_listing_our_own_request_is_not_counted_twice():
    pool = PoolModel([_persistent("a", "mine"), _persistent("b")])
    assert pool.free_replicas("persistent", own_running=1, own_ids={"mine"}) == 1
    # ours ended, a record still lists it: the replica is free
    assert pool.free_replicas("persistent", own_running=0, own_ids={"mine"}) == 2
    assert pool.others_running("persistent", {"mine"}) == 0
    assert pool.others_running("persistent") == 1


def test_an_older_record_of_an_engine_never_replaces_a_newer_one():
    pool = PoolModel([_persistent("a", "r1", seq=5)])
    assert not pool.update(_persistent("a", seq=4))
    assert pool.free_replicas("persistent", 0) == 0
    assert pool.update(_persistent("a", seq=6))
    assert pool.free_replicas("persistent", 0) == 1
    assert pool.update(_persistent("a", "r2", seq=1, started=2.0))  # restarted engine: a later start wins


def test_eligible_demand_is_persistent_running_plus_spilled():
    standard = LoadRecord(engine_id="s", lane="standard", spilled_running=3, standard_running=5)
    pool = PoolModel([_persistent("a", "r1"), _persistent("b"), standard])
    assert pool.eligible_demand() == 4.0
    assert pool.free_replicas("standard", 0) == 0  # a standard engine holds no persistent slot


def test_health_readings():
    failed = LoadRecord(engine_id="a", lane="colocated", capacity=1, decoder_loaded=True, decoder_healthy=False,
                        standard_running=1)
    assert failed.decoder_failed and not failed.standard_idle
    no_decoder = LoadRecord(engine_id="b", lane="persistent", capacity=1, decoder_loaded=False, decoder_healthy=False)
    assert not no_decoder.decoder_failed  # never loaded: its requests fall back, the replica stays


def test_a_heartbeat_is_the_same_load():
    a = _persistent("a", "r1", seq=1)
    assert a.same_load(_persistent("a", "r1", seq=9))
    assert not a.same_load(_persistent("a", seq=9))
    assert not PoolModel().known
