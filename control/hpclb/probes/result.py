"""What one probe says about one backend, whatever its kind."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The outcome of one probe.

    ``rtt_ms`` is the round trip the probe measured (ICMP: echo request to reply;
    TCP: connect() to established; HTTP: connect to status line received), None when
    the probe failed. ``reason`` is "ok" on success, else a short cause ("timeout",
    "refused", "http 503", "unreachable", ...) for logs and transition reasons.
    """

    ok: bool
    rtt_ms: float | None
    reason: str

    @staticmethod
    def success(rtt_ns: int) -> ProbeResult:
        return ProbeResult(True, rtt_ns / 1e6, "ok")

    @staticmethod
    def failure(reason: str) -> ProbeResult:
        return ProbeResult(False, None, reason)


#: Shared instance: a timeout carries no data, and 10,000 probes a second time out
#: in bulk when a rack goes away.
TIMEOUT = ProbeResult(False, None, "timeout")


class ProbeError(Exception):
    """A probe cannot be set up at all (bad address, no ICMP socket, ...)."""
