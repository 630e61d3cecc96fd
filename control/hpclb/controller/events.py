"""What the monitors' threads tell the controller, one type per kind.

Each event is defined where it is produced (``ProbeVerdict`` by the probe
thread, ``TelemetryArrived`` here, by the monitors' receiver callback), so no
floor imports the one above it.

Events cross from the probe and telemetry threads to the controller's loop
through one queue (``Monitors.events``); the loop dispatches on their type.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpclb.health.thread import ProbeVerdict
from hpclb.telemetry.message import TelemetryMessage


@dataclass(frozen=True, slots=True)
class TelemetryArrived:
    """An authenticated agent's message, stamped when the receiver took it:
    heartbeats are judged by these times, not by when the loop got to them."""

    msg: TelemetryMessage
    mono: float
    wall: float


Event = ProbeVerdict | TelemetryArrived

__all__ = ["Event", "ProbeVerdict", "TelemetryArrived"]
