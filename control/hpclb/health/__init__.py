"""Health probes of the control plane.

``HealthChecker`` probes backends with ICMP echo (ICMPv6 for IPv6 backends; one
shared socket per family), TCP connect, or HTTP GET in clear or over TLS (HTTPS),
to IPv4 and IPv6 addresses alike, on a per-backend schedule (``ProbeScheduler``),
turns results into
up/down with rise/fall and flap damping (``HealthState``), reports transitions
and keeps each backend's last RTT, the network-latency input of :mod:`hpclb.balancing.weights`.
A probe spoiled on the appliance's own side (out of descriptors, a stalled loop,
...) ends *unknown* (``ProbeResult.local``): counted and alarmed, never a verdict.
The per-pool configuration model is :mod:`hpclb.config.probes`.
"""

from __future__ import annotations

from .checker import ALARM_HOLD_S, BackendStatus, HealthChecker
from .http import http_get, tls_context
from .icmp import IcmpPinger, open_icmp_socket
from .result import LOCAL_CAUSES, LOCAL_ERRNOS, TIMEOUT, ProbeError, ProbeResult, local_cause
from .rise_fall import Damper, HealthState, Transition
from .scheduler import LoopStalls, ProbeOutcome, ProbeScheduler, place_phases, stall_during
from .tcp import TcpConnector

__all__ = [
    "ALARM_HOLD_S",
    "LOCAL_CAUSES",
    "LOCAL_ERRNOS",
    "TIMEOUT",
    "BackendStatus",
    "Damper",
    "HealthChecker",
    "HealthState",
    "IcmpPinger",
    "LoopStalls",
    "ProbeError",
    "ProbeOutcome",
    "ProbeResult",
    "ProbeScheduler",
    "TcpConnector",
    "Transition",
    "http_get",
    "local_cause",
    "open_icmp_socket",
    "place_phases",
    "stall_during",
    "tls_context",
]
