"""Health probes of the control plane (issue 4, item 2).

``HealthChecker`` probes backends with ICMP echo (one shared socket), TCP connect
or HTTP GET on a per-backend schedule (``ProbeScheduler``), turns results into
up/down with rise/fall and flap damping (``HealthState``), reports transitions
and keeps each backend's last RTT, the network-latency input of ``weights.py``.
``ProbeConfig`` is the per-pool configuration model.
"""

from __future__ import annotations

from hpclb.netns import enter_netns, new_netns

from .checker import BackendStatus, HealthChecker
from .config import DampingConfig, ProbeConfig
from .health import Damper, HealthState, Transition
from .http import http_get
from .icmp import IcmpPinger, open_icmp_socket
from .result import TIMEOUT, ProbeError, ProbeResult
from .scheduler import ProbeOutcome, ProbeScheduler, place_phases
from .tcp import TcpConnector

__all__ = [
    "TIMEOUT",
    "BackendStatus",
    "Damper",
    "DampingConfig",
    "HealthChecker",
    "HealthState",
    "IcmpPinger",
    "ProbeConfig",
    "ProbeError",
    "ProbeOutcome",
    "ProbeResult",
    "ProbeScheduler",
    "TcpConnector",
    "Transition",
    "enter_netns",
    "http_get",
    "new_netns",
    "open_icmp_socket",
    "place_phases",
]
