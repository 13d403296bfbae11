"""Fault injection for the persistent backend: a configuration switch used only by tests.

Off unless ``persistent_fault_injection`` is set in the app config (it never is
by default). When set, the replica's backend is wrapped in
:class:`FaultInjectingBackend`, which fails every ``every_n``-th quantum of that
replica in one of the two ways the contract (docs/design.md "Errors")
distinguishes:

- ``prelaunch``: raise :class:`PrelaunchError` before calling the backend, so
  the KV cache is untouched and the lane falls back;
- ``after_launch``: run the real quantum (the cache has changed), then raise
  :class:`BackendLaunchError`: terminal for the request, decoder unhealthy.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from replicas.persistent.contract import (
    BackendLaunchError,
    CacheBinding,
    PersistentBackend,
    PipelinedBackend,
    PrelaunchError,
    QuantumRequest,
    QuantumResult,
)

INJECTED_REASON = "injected_fault"
"""``PrelaunchError.reason`` of an injected prelaunch failure."""


class FaultInjection(BaseModel):
    """Which quanta fail, and how (tests only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: Literal["prelaunch", "after_launch"] = Field(
        description="prelaunch: fail before launch (falls back); after_launch: fail after the quantum ran."
    )
    every_n: int = Field(1, ge=1, description="Fail the n-th, 2n-th, ... quantum run by this replica.")


class FaultInjectingBackend(PersistentBackend):
    """Wraps a real backend; fails the quanta chosen by ``spec``, runs the others unchanged.

    Args:
        inner: the real backend (already constructed, not yet bound).
        spec: the fault schedule.
    """

    def __init__(self, inner: PersistentBackend, spec: FaultInjection):
        self.inner = inner
        self.spec = spec
        self.name = inner.name
        self.checks_stop_set_on_device = inner.checks_stop_set_on_device
        self.takes_cached_pages = inner.takes_cached_pages
        self.quanta_seen = 0

    def bind_cache(self, binding: CacheBinding) -> None:
        self.inner.bind_cache(binding)

    def run_quantum(self, req: QuantumRequest) -> QuantumResult:
        """Run ``req`` on the inner backend, or fail it as scheduled.

        Raises:
            PrelaunchError: scheduled ``prelaunch`` fault (reason ``injected_fault``).
            BackendLaunchError: scheduled ``after_launch`` fault (the quantum did run).
        """
        self.quanta_seen += 1
        fail = self.quanta_seen % self.spec.every_n == 0
        if fail and self.spec.stage == "prelaunch":
            raise PrelaunchError(f"injected prelaunch fault (quantum {self.quanta_seen})", reason=INJECTED_REASON)
        result = self.inner.run_quantum(req)
        if fail:
            raise BackendLaunchError(f"injected fault after launch (quantum {self.quanta_seen})")
        return result


class FaultInjectingPipelinedBackend(FaultInjectingBackend, PipelinedBackend):
    """:class:`FaultInjectingBackend` for a :class:`PipelinedBackend` (so injecting faults keeps the lane's
    pipelined quanta): a scheduled ``prelaunch`` fault refuses the launch (a follower is then not queued,
    and the lane launches that quantum on its own later, counted as a new quantum); an ``after_launch``
    fault lets the quantum launch and fails when its result is collected."""

    def __init__(self, inner: PipelinedBackend, spec: FaultInjection):
        super().__init__(inner, spec)
        self._doomed: list[bool] = []  # per launched quantum, in launch order: fail at collection

    def launch_quantum(self, req: QuantumRequest, follows: bool = False) -> None:
        """Launch ``req`` on the inner backend, or refuse it as scheduled.

        Raises:
            PrelaunchError: scheduled ``prelaunch`` fault (reason ``injected_fault``).
        """
        self.quanta_seen += 1
        fail = self.quanta_seen % self.spec.every_n == 0
        if fail and self.spec.stage == "prelaunch":
            raise PrelaunchError(f"injected prelaunch fault (quantum {self.quanta_seen})", reason=INJECTED_REASON)
        self.inner.launch_quantum(req, follows)
        self._doomed.append(fail)

    def collect_quantum(self) -> QuantumResult:
        """The inner backend's result, or a scheduled ``after_launch`` failure (the quantum did run).

        Raises:
            BackendLaunchError: scheduled ``after_launch`` fault, or the inner backend's.
        """
        result = self.inner.collect_quantum()
        if self._doomed.pop(0):
            raise BackendLaunchError("injected fault after launch")
        return result

    def discard_quanta(self) -> None:
        self._doomed.clear()
        self.inner.discard_quanta()

    def run_quantum(self, req: QuantumRequest) -> QuantumResult:
        return PipelinedBackend.run_quantum(self, req)


def with_faults(inner: PersistentBackend, spec: FaultInjection) -> FaultInjectingBackend:
    """``inner`` wrapped for fault injection, keeping its pipelining if it has it."""
    if isinstance(inner, PipelinedBackend):
        return FaultInjectingPipelinedBackend(inner, spec)
    return FaultInjectingBackend(inner, spec)
