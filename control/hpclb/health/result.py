"""What one probe says about one backend, whatever its kind.

A probe ends in one of three ways: success, failure (the target's doing:
refused, unreachable, silent, a bad HTTP status) or *unknown*: the probe could
not be made or judged for a reason on the appliance's own side (out of file
descriptors, buffers or memory, refused by our own firewall, a bug in our code,
an event loop too stalled to read the answer in time). A local failure is never
a backend failure: unknown results (``local=True``) are counted and raise an
alarm, but never move a backend's verdict.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

#: errno values that say something about the appliance, not the target, when a
#: probe's socket(), connect() or sendto() fails: resources of ours (descriptors,
#: buffers, memory, local ports, epoll watches), permission (our own firewall or
#: capabilities), a full send queue, or a call we got wrong. Target trouble
#: (ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, ETIMEDOUT, ECONNRESET) is not here.
_CAUSE_OF_ERRNO: dict[int, str] = {
    errno.EMFILE: "emfile",
    errno.ENFILE: "enfile",
    errno.ENOBUFS: "enobufs",
    errno.ENOMEM: "enomem",
    errno.EPERM: "eperm",
    errno.EACCES: "eacces",
    errno.EAGAIN: "eagain",  # == EWOULDBLOCK on Linux
    errno.EWOULDBLOCK: "eagain",
    errno.EADDRNOTAVAIL: "eaddrnotavail",  # no local port left
    errno.ENOSPC: "os_error",  # epoll's max_user_watches
    errno.EINTR: "os_error",
    errno.EBADF: "os_error",
    errno.EFAULT: "os_error",
    errno.EINVAL: "os_error",
    errno.EMSGSIZE: "os_error",
    errno.ENOTSOCK: "os_error",
    errno.EAFNOSUPPORT: "os_error",
    errno.EPROTONOSUPPORT: "os_error",
}

LOCAL_ERRNOS: frozenset[int] = frozenset(_CAUSE_OF_ERRNO)

#: Every cause an unknown result can have: a bounded set, so that per-cause
#: counters cannot grow with whatever text an error carries.
LOCAL_CAUSES: tuple[str, ...] = (
    "emfile", "enfile", "enobufs", "enomem", "eperm", "eacces", "eagain", "eaddrnotavail",
    "os_error",  # any other error of ours (socket() failing for another reason, ...)
    "loop_stall",  # a timeout taken while our event loop was not looking
    "probe_error",  # our probe code raised
    "closed",  # the prober was closed or the probe cancelled under it
    "other",
)


def local_cause(err: int | None) -> str | None:
    """The cause key when ``err`` (an errno) is the appliance's own trouble, else None."""
    return _CAUSE_OF_ERRNO.get(err) if err is not None else None


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The outcome of one probe.

    ``rtt_ms`` is the round trip the probe measured (ICMP: echo request to reply;
    TCP: connect() to established; HTTP: connect to status line received), None when
    the probe failed. ``reason`` is "ok" on success, else a short cause ("timeout",
    "refused", "http 503", "unreachable", ...) for logs and transition reasons.

    ``local`` marks an *unknown* result: ``ok`` is False but the backend is not to
    blame (see the module docstring); ``cause`` is then one of LOCAL_CAUSES, for
    counting. Success and failure leave them at False and "".
    """

    ok: bool
    rtt_ms: float | None
    reason: str
    local: bool = False
    cause: str = ""

    @staticmethod
    def success(rtt_ns: int) -> ProbeResult:
        return ProbeResult(True, rtt_ns / 1e6, "ok")

    @staticmethod
    def failure(reason: str) -> ProbeResult:
        return ProbeResult(False, None, reason)

    @staticmethod
    def local_error(reason: str, cause: str = "other") -> ProbeResult:
        """An unknown result: the probe failed on our side, for ``reason``."""
        return ProbeResult(False, None, reason, True,
                           cause if cause in LOCAL_CAUSES else "other")

    @staticmethod
    def os_error(where: str, exc: OSError, *, ours: bool = False) -> ProbeResult:
        """``exc``, raised by the call ``where`` ("socket", "send", ...), as a result:
        unknown when its errno is the appliance's trouble, or whatever it is when
        ``ours`` (creating our own socket says nothing about any target)."""
        reason = f"{where}: {exc.strerror or exc}"
        cause = local_cause(exc.errno) or ("os_error" if ours else None)
        if cause is None:
            return ProbeResult.failure(reason)
        return ProbeResult.local_error(reason, cause)


#: Shared instance: a timeout carries no data, and 10,000 probes a second time out
#: in bulk when a rack goes away.
TIMEOUT = ProbeResult(False, None, "timeout")


class ProbeError(Exception):
    """A probe cannot be set up at all (bad address, no ICMP socket, ...)."""
