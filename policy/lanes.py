"""Lane choice: persistent or standard, per mode, with the reason.

Source: docs/design.md "Two lanes and the router" and "The router's own reasons".
Pure: no torch, no ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from policy.reasons import Reason


class Mode(str, Enum):
    """Persistent-decoder mode of the app.

    ``off``: never load the persistent decoder; everything goes standard.
    ``auto``: load it if possible; route eligible requests to it.
    ``required``: like ``auto`` per request; differs only at startup, where the
    app refuses to start if the persistent decoder cannot load.
    """

    OFF = "off"
    AUTO = "auto"
    REQUIRED = "required"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | Mode) -> Mode:
        """Parse a mode name (case and surrounding spaces ignored).

        Raises:
            ValueError: if ``value`` is not one of off/auto/required.
        """
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ValueError(f"invalid mode {value!r}; valid values: {valid}") from None


class Lane(str, Enum):
    """Where a request is decoded."""

    PERSISTENT = "persistent"
    STANDARD = "standard"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LaneDecision:
    """The router's choice: ``lane``, and why not persistent (``None`` if persistent)."""

    lane: Lane
    reason: Reason | None


@dataclass(frozen=True)
class PersistentLaneStatus:
    """What the router knows about the persistent lane right now.

    Attributes:
        available: a persistent lane is deployed and reachable.
        healthy: its decoder has not been marked unhealthy.
        has_capacity: at least one persistent replica is free.
        envelope_supported: model/device/config is within the decoder's envelope.
    """

    available: bool
    healthy: bool
    has_capacity: bool
    envelope_supported: bool = True


def choose_lane(
    mode: Mode, admission_reason: Reason | None, status: PersistentLaneStatus
) -> LaneDecision:
    """Choose the lane for one request.

    ``off`` always goes standard with ``disabled``. ``auto`` and ``required``
    behave the same per request (``required`` only matters at startup, see
    ``requires_persistent_decoder``): the admission reason if any, then
    ``lane_unavailable``, ``unsupported_envelope``, ``decoder_unhealthy``,
    ``persistent_capacity``, in that order; otherwise persistent.

    Args:
        mode: the app's mode.
        admission_reason: result of ``check_admission`` for the request.
        status: the persistent lane's current status.

    Returns:
        A ``LaneDecision``; ``reason`` is ``None`` exactly when the lane is persistent.
    """
    if mode is Mode.OFF:
        return LaneDecision(Lane.STANDARD, Reason.DISABLED)
    reason = admission_reason
    if reason is None:
        if not status.available:
            reason = Reason.LANE_UNAVAILABLE
        elif not status.envelope_supported:
            reason = Reason.UNSUPPORTED_ENVELOPE
        elif not status.healthy:
            reason = Reason.DECODER_UNHEALTHY
        elif not status.has_capacity:
            reason = Reason.PERSISTENT_CAPACITY
    if reason is not None:
        return LaneDecision(Lane.STANDARD, reason)
    return LaneDecision(Lane.PERSISTENT, None)


def loads_persistent_decoder(mode: Mode) -> bool:
    """True if replicas should load the persistent decoder (``auto``, ``required``)."""
    return mode is not Mode.OFF


def requires_persistent_decoder(mode: Mode) -> bool:
    """True if the app must refuse to start when the decoder cannot load (``required``)."""
    return mode is Mode.REQUIRED
