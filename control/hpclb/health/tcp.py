"""TCP connect probe: up when the three-way handshake completes.

Not built on ``asyncio.open_connection``: a connect check needs no transport, no
stream reader, no protocol callbacks, and at 10,000 probes a second that
machinery, plus registering and unregistering each socket with the event loop,
is most of the cost (perf/probe_scale.py measures it). Instead one
:class:`TcpConnector` keeps its own epoll set, registered with the event loop
once: a probe is a non-blocking ``connect()`` and one ``epoll_ctl``; completions
are collected in batches; closing a socket removes it from the set. Sockets are
closed with an RST (SO_LINGER 0), as HAProxy does for its checks, so that neither
end keeps a TIME_WAIT per probe.
"""

from __future__ import annotations

import asyncio
import errno
import os
import select
import socket
import struct
import time
from collections import Counter

from .deadlines import Deadlines, check_timeout
from .result import TIMEOUT, ProbeResult, local_cause

_LINGER_RST = struct.pack("ii", 1, 0)
_EVENTS = select.EPOLLOUT | select.EPOLLERR | select.EPOLLHUP
_BATCH = 1024

_REASONS = {
    errno.ECONNREFUSED: "refused",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ENETUNREACH: "network unreachable",
    errno.ETIMEDOUT: "timeout",
    errno.ECONNRESET: "reset",
}

#: Every counter a TcpConnector keeps ("local": probes that ended unknown, for a
#: reason of ours; "socket_errors": those of them that could not get a socket).
COUNTERS: tuple[str, ...] = ("connects", "ok", "failed", "timeouts", "local",
                             "socket_errors")


def _reason(err: int) -> str:
    return _REASONS.get(err) or os.strerror(err)


def _result_of(err: int) -> ProbeResult:
    """A failed connect's result: unknown when the errno is about us (no local
    port, no buffers, our own firewall's EPERM), else the target's failure."""
    cause = local_cause(err)
    if cause is not None:
        return ProbeResult.local_error(f"connect: {os.strerror(err)}", cause)
    return ProbeResult.failure(_reason(err))


def socket_family(address: str) -> socket.AddressFamily:
    """AF_INET or AF_INET6 for an IP literal; ValueError for anything else (a probe
    never resolves names: DNS on the probe path would stall every probe)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, address)
        except (OSError, TypeError):
            continue
        return family
    raise ValueError(f"{address!r} is not an IP address")


class _Connect:
    """One connect in flight."""

    __slots__ = ("future", "serial", "sock", "start_ns")

    def __init__(self, sock: socket.socket, future: asyncio.Future[ProbeResult],
                 serial: int) -> None:
        self.sock = sock
        self.future = future
        self.serial = serial  # tells apart connects that reuse a file descriptor
        self.start_ns = time.monotonic_ns()


class TcpConnector:
    """TCP connect probes for any number of targets. Create it inside the event loop."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._epoll = select.epoll()
        self._conns: dict[int, _Connect] = {}  # by file descriptor
        self._deadlines = Deadlines(self._loop, self._expire)
        self._serial = 0
        self.counters: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._closed = False
        self._loop.add_reader(self._epoll.fileno(), self._on_ready)

    def connect(self, address: str, port: int, timeout: float,
                family: socket.AddressFamily | None = None) -> asyncio.Future[ProbeResult]:
        """Connect to ``address:port`` (an IP literal; pass ``family`` to skip working
        it out). The future resolves with ok + handshake RTT, or the failure
        ("refused", "timeout", ...), within ``timeout`` seconds. Cancelling it
        abandons the probe; its socket is closed by the deadline at the latest."""
        check_timeout(timeout)
        fut: asyncio.Future[ProbeResult] = self._loop.create_future()
        if self._closed:
            fut.set_result(ProbeResult.local_error("connector closed", "closed"))
            return fut
        try:
            sock = socket.socket(family or socket_family(address), socket.SOCK_STREAM)
        except OSError as exc:  # out of file descriptors, typically: ours, never theirs
            self.counters["socket_errors"] += 1
            self.counters["local"] += 1
            fut.set_result(ProbeResult.os_error("socket", exc, ours=True))
            return fut
        sock.setblocking(False)
        self._serial += 1
        conn = _Connect(sock, fut, self._serial)
        self.counters["connects"] += 1
        err = sock.connect_ex((address, port))
        if err == errno.EINPROGRESS:
            fd = sock.fileno()
            try:
                self._epoll.register(fd, _EVENTS)
            except OSError as exc:  # ENOMEM, ENOSPC (max_user_watches): ours
                self._finish(conn, ProbeResult.os_error("epoll", exc, ours=True))
                return fut
            self._conns[fd] = conn
            self._deadlines.add(timeout, fd, conn.serial)
        elif err == 0:
            self._finish(conn, ProbeResult.success(time.monotonic_ns() - conn.start_ns))
        else:
            self._finish(conn, _result_of(err))
        return fut

    def _on_ready(self) -> None:
        try:
            events = self._epoll.poll(0, _BATCH)
        except OSError:
            return
        now_ns = time.monotonic_ns()
        for fd, _ in events:
            conn = self._conns.pop(fd, None)
            if conn is None:
                continue
            err = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            self._finish(conn, ProbeResult.success(now_ns - conn.start_ns) if err == 0
                         else _result_of(err))

    def _expire(self, fd: int, serial: int) -> None:
        conn = self._conns.get(fd)
        if conn is not None and conn.serial == serial:
            del self._conns[fd]
            self._finish(conn, TIMEOUT)

    def _finish(self, conn: _Connect, result: ProbeResult) -> None:
        sock = conn.sock
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
        except OSError:
            pass  # closing without RST is fine, only less tidy
        sock.close()  # also takes it out of the epoll set
        if result.ok:
            self.counters["ok"] += 1
        elif result.local:
            self.counters["local"] += 1
        elif result is TIMEOUT:
            self.counters["timeouts"] += 1
        else:
            self.counters["failed"] += 1
        if not conn.future.done():
            conn.future.set_result(result)

    @property
    def in_flight(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        """Stop: connects in flight end unknown ("connector closed")."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._epoll.fileno())
        self._deadlines.close()
        closed = ProbeResult.local_error("connector closed", "closed")
        for conn in self._conns.values():
            conn.sock.close()
            if not conn.future.done():
                conn.future.set_result(closed)
        self._conns.clear()
        self._epoll.close()
