"""Health probes of the control plane .

``HealthChecker`` probes backends with ICMP echo (one shared socket), TCP connect
or HTTP GET on a per-backend schedule (``ProbeScheduler``), turns results into
up/down with rise/fall and flap damping (``HealthState``), reports transitions
and keeps each backend's last RTT, the network-latency input of ``weights.py``.
A probe spoiled on the appliance's own side (out of descriptors, a stalled loop,
...) ends *unknown* (``ProbeResult.local``): counted and alarmed, never a verdict.
``ProbeConfig`` is the per-pool configuration model.
"""

from __future__ import annotations

from hpclb.config.probes import DampingConfig, ProbeConfig
from hpclb.host.netns import enter_netns, new_netns

from .checker import ALARM_HOLD_S, BackendStatus, HealthChecker
from .http import http_get
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
    "DampingConfig",
    "HealthChecker",
    "HealthState",
    "IcmpPinger",
    "LoopStalls",
    "ProbeConfig",
    "ProbeError",
    "ProbeOutcome",
    "ProbeResult",
    "ProbeScheduler",
    "TcpConnector",
    "Transition",
    "enter_netns",
    "http_get",
    "local_cause",
    "new_netns",
    "open_icmp_socket",
    "place_phases",
    "stall_during",
]
