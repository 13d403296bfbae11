"""The pool model: one typed load record per engine, and what the router, autoscaling and health read from it.

Pure (no torch, no ray). The engines produce :class:`LoadRecord` s (``replicas.engine_actor``: one on every
change of the requests they run, and a heartbeat), the app's pool board collects them
(``replicas.pool_board``) and pushes them to every router; :class:`PoolModel` is the one reading of them:

* the router: :meth:`PoolModel.free_replicas` (persistent replicas free now, across ingress replicas);
* autoscaling: :meth:`PoolModel.eligible_demand` (the persistent pool's custom metric);
* health: :attr:`LoadRecord.decoder_failed` and :attr:`LoadRecord.standard_idle` (a replica's own engine).

Decision and numbers: docs/decisions/0026-routing-on-pushed-load-records.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Iterable
from dataclasses import dataclass

PERSISTENT_LANES = ("persistent", "colocated")
"""Engine lanes that hold a persistent lane (a co-located engine holds both)."""


@dataclass(frozen=True)
class LoadRecord:
    """One engine's load, as the engine measured it.

    Attributes:
        engine_id: the engine actor's name (stable across Ray's in-place restarts of that actor).
        lane: the engine's lane: ``persistent``, ``standard`` or ``colocated``.
        running: persistent requests the engine holds now (its persistent lane; 0 on a standard engine).
        capacity: persistent requests it can hold at once (1 with a persistent lane, else 0).
        request_ids: ids of those persistent requests (so a router tells its own from other routers').
        decoder_loaded: a persistent decoder backend is loaded (False: every persistent request is rejected).
        decoder_healthy: the persistent decoder was not marked unhealthy (a launch failure marks it).
        unhealthy_reason: why it was marked unhealthy, or None.
        standard_running: standard-lane requests being decoded (0 without a standard lane).
        standard_waiting: standard-lane requests waiting to be scheduled.
        spilled_running: standard-lane requests the routers spilled from the persistent lane for capacity.
        started_at: wall-clock seconds when this engine process started (a restarted engine starts anew).
        seq: the engine's record counter since ``started_at`` (orders records: a late one never wins).
        updated_at: wall-clock seconds when the engine took this record.
    """

    engine_id: str
    lane: str
    running: int = 0
    capacity: int = 0
    request_ids: tuple[str, ...] = ()
    decoder_loaded: bool = False
    decoder_healthy: bool = True
    unhealthy_reason: str | None = None
    standard_running: int = 0
    standard_waiting: int = 0
    spilled_running: int = 0
    started_at: float = 0.0
    seq: int = 0
    updated_at: float = 0.0

    @property
    def order(self) -> tuple[float, int]:
        """``(started_at, seq)``: of two records of one engine, the larger is the newer."""
        return self.started_at, self.seq

    @property
    def has_persistent_lane(self) -> bool:
        return self.lane in PERSISTENT_LANES

    @property
    def decoder_failed(self) -> bool:
        """A loaded persistent decoder was marked unhealthy (the replica's health check fails on it)."""
        return self.decoder_loaded and not self.decoder_healthy

    @property
    def standard_idle(self) -> bool:
        """No standard-lane request running or waiting."""
        return self.standard_running + self.standard_waiting == 0

    def same_load(self, other: LoadRecord | None) -> bool:
        """Equal in everything but ``seq`` and ``updated_at`` (a heartbeat that changes nothing)."""
        if other is None:
            return False
        return dataclasses.replace(self, seq=0, updated_at=0.0) == dataclasses.replace(other, seq=0, updated_at=0.0)


class PoolModel:
    """The records of one application's engines, newest per engine, and the readings of them.

    ``known`` is False until a first set of records was applied (the router then treats the pool as unknown,
    not empty).
    """

    def __init__(self, records: Iterable[LoadRecord] = ()):
        self.records: dict[str, LoadRecord] = {}
        self.known = False
        records = list(records)
        if records:
            self.replace(records)

    def replace(self, records: Iterable[LoadRecord]) -> None:
        """Take ``records`` as the whole pool (the board's current set: engines missing from it are gone)."""
        self.records = {r.engine_id: r for r in records}
        self.known = True

    def update(self, record: LoadRecord) -> bool:
        """Take one engine's ``record`` unless a newer one of that engine is held; True when taken."""
        held = self.records.get(record.engine_id)
        if held is not None and held.order > record.order:
            return False
        self.records[record.engine_id] = record
        return True

    def lane(self, lane: str) -> list[LoadRecord]:
        """Records of the engines of ``lane``, by engine id."""
        return [self.records[k] for k in sorted(self.records) if self.records[k].lane == lane]

    def persistent_replicas(self, lane: str) -> int:
        """Engines of ``lane`` whose persistent decoder is healthy (those the router may send to)."""
        return sum(r.capacity for r in self.lane(lane) if r.decoder_healthy)

    def free_replicas(self, lane: str, own_running: int, own_ids: Container[str] = ()) -> int:
        """Persistent slots of ``lane`` free now.

        Args:
            lane: ``persistent`` (or ``colocated`` in co-located mode).
            own_running: this router's persistent requests running or being dispatched (it knows them at once;
                the records may not show them yet).
            own_ids: ids of this router's persistent requests, running or ended: records listing them are
                not counted as other routers' (this router counts its running ones in ``own_running``, and
                knows its ended ones ended even when a record still lists them).

        Returns:
            healthy slots − other routers' requests on healthy engines − ``own_running`` (may be negative
            when the view lags).
        """
        healthy = [r for r in self.lane(lane) if r.decoder_healthy]
        others = sum(min(r.capacity, sum(1 for rid in r.request_ids if rid not in own_ids)) for r in healthy)
        return sum(r.capacity for r in healthy) - others - own_running

    def others_running(self, lane: str, own_ids: Container[str] = ()) -> int:
        """Persistent requests of other routers that the healthy engines of ``lane`` report running."""
        return sum(1 for r in self.lane(lane) if r.decoder_healthy for rid in r.request_ids if rid not in own_ids)

    def eligible_demand(self) -> float:
        """Eligible requests now: persistent requests running plus requests spilled to the standard lane for
        persistent capacity, over every engine (the persistent pool's autoscaling metric)."""
        return float(sum(r.running for r in self.records.values() if r.has_persistent_lane)
                     + sum(r.spilled_running for r in self.records.values()))

    def snapshot(self, lane: str) -> list[dict]:
        """``lane``'s records as dicts (``/debug/stats``)."""
        return [dataclasses.asdict(r) for r in self.lane(lane)]
