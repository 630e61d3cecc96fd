"""What the monitors' threads tell the controller, one type per kind.

Events cross from the probe and telemetry threads to the controller's loop
through one queue (``Monitors.events``); the loop dispatches on their type.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpclb.probes import Transition
from hpclb.telemetry import TelemetryMessage


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    """A backend's probe verdict changed (rise/fall, damping)."""

    transition: Transition


@dataclass(frozen=True, slots=True)
class TelemetryArrived:
    """An authenticated agent's message, stamped when the receiver took it:
    heartbeats are judged by these times, not by when the loop got to them."""

    msg: TelemetryMessage
    mono: float
    wall: float


Event = ProbeVerdict | TelemetryArrived
