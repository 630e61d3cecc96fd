"""ICMP echo for any number of targets over one socket.

One raw ICMP socket (the appliance runs as root) serves every target; when raw
sockets are refused, an unprivileged ping socket (``SOCK_DGRAM``/``IPPROTO_ICMP``,
allowed by ``net.ipv4.ping_group_range``) does the same job. Replies are matched to
probes by (identifier, sequence) and by an 8-byte token echoed in the payload, so
a late reply to a recycled sequence number, another program's ping, or a forged
reply without the token cannot pass for an answer. Anything that does not parse
or does not match is dropped and counted (:attr:`IcmpPinger.counters`), never
raised.

IPv4 only for now, like the data planes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from .deadlines import Deadlines, check_timeout
from .result import TIMEOUT, ProbeError, ProbeResult

ECHO_REPLY = 0
DEST_UNREACH = 3
ECHO_REQUEST = 8
TIME_EXCEEDED = 11

# <linux/icmp.h>: a raw ICMP socket's type filter, a bitmask of types to *drop*.
SOL_RAW = 255
ICMP_FILTER = 1

_HDR = struct.Struct("!BBHHH")  # type, code, checksum, identifier, sequence
_TOKEN = struct.Struct("!4sI")  # per-pinger secret, per-probe counter
_SEQ_SPACE = 1 << 16
_MIN_IP_HDR = 20
_RECV_BATCH = 256  # replies read per wake-up before letting other callbacks run

Mode = Literal["auto", "raw", "dgram"]

#: Every counter an IcmpPinger keeps (all present in `counters`, zeros too).
COUNTERS: tuple[str, ...] = (
    "sent",  # echo requests handed to the kernel
    "replies",  # matched echo replies
    "timeouts",  # probes that got no answer in time
    "errors",  # probes answered by ICMP unreachable / time exceeded
    "send_errors",  # sendto() refused (no route: a failure; buffer full, ...: unknown)
    "malformed",  # too short, not IPv4, not ICMP, bad header length
    "foreign",  # echo replies with another pinger's identifier
    "unexpected",  # ours in form, but no live probe matches (late, wrong token or source)
    "recv_errors",  # recvfrom() failed
)


def checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of ``data``."""
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def echo_request(ident: int, seq: int, payload: bytes) -> bytes:
    """An ICMP echo request with its checksum filled in."""
    unsummed = _HDR.pack(ECHO_REQUEST, 0, 0, ident, seq) + payload
    return _HDR.pack(ECHO_REQUEST, 0, checksum(unsummed), ident, seq) + payload


def open_icmp_socket(mode: Mode = "auto", rcvbuf: int = 4 << 20) -> socket.socket:
    """A non-blocking ICMP socket: raw if allowed (and asked), else a ping socket.

    ``rcvbuf`` is asked for so that a burst of replies from thousands of targets is
    not dropped by the kernel while the event loop is busy; the kernel caps it at
    ``net.core.rmem_max``.
    """
    errors: list[str] = []
    if mode in ("auto", "raw"):
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        except PermissionError as exc:
            errors.append(f"raw ICMP socket refused ({exc.strerror}; needs CAP_NET_RAW)")
        else:
            # Let through only what can answer a probe: a raw socket otherwise also
            # sees every echo request, ours included on loopback, doubling the work.
            wanted = (1 << ECHO_REPLY) | (1 << DEST_UNREACH) | (1 << TIME_EXCEEDED)
            sock.setsockopt(SOL_RAW, ICMP_FILTER, struct.pack("I", ~wanted & 0xFFFFFFFF))
            return _prepare(sock, rcvbuf)
    if mode in ("auto", "dgram"):
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
        except PermissionError as exc:
            errors.append(f"ping socket refused ({exc.strerror}; the group is not in "
                          "net.ipv4.ping_group_range)")
        else:
            return _prepare(sock, rcvbuf)
    if mode not in ("auto", "raw", "dgram"):
        raise ValueError(f"ICMP socket mode {mode!r} is not auto, raw or dgram")
    raise ProbeError("cannot probe with ICMP: " + "; ".join(errors))


def _prepare(sock: socket.socket, rcvbuf: int) -> socket.socket:
    sock.setblocking(False)
    with contextlib.suppress(OSError):  # a smaller buffer still works
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    return sock


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[ProbeResult]
    dst: bytes  # packed IPv4 address: the only source a reply may come from
    token: bytes
    sent_ns: int
    probe_no: int  # tells a recycled sequence number's probes apart at expiry


class IcmpPinger:
    """Sends echo requests and resolves each probe's future with its result.

    Create it inside the event loop that will use it. It owns its socket (given or
    opened with ``mode``) and closes it in :meth:`close`.
    """

    def __init__(self, sock: socket.socket | None = None, *, mode: Mode = "auto") -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock if sock is not None else open_icmp_socket(mode)
        self._sock.setblocking(False)
        #: "raw" or "dgram": what the kernel gave us.
        self.mode: str = "raw" if self._sock.type == socket.SOCK_RAW else "dgram"
        # A ping socket's identifier is chosen by the kernel (its "port") and the
        # kernel only hands us our own replies; a raw socket sees everyone's, so
        # pick an identifier unlikely to be another pinger's.
        self._ident = int.from_bytes(os.urandom(2), "big")
        self._secret = os.urandom(4)
        self._seq = int.from_bytes(os.urandom(2), "big")
        self._probe_no = 0
        self._pending: dict[int, _Pending] = {}
        self._deadlines = Deadlines(self._loop, self._expire)
        self.counters: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._closed = False
        self._loop.add_reader(self._sock.fileno(), self._on_readable)

    # -- sending --

    def ping(self, address: str, timeout: float) -> asyncio.Future[ProbeResult]:
        """Send one echo request to ``address`` (dotted IPv4); the future resolves
        with the result within ``timeout`` seconds. Cancelling it abandons the probe.
        """
        try:
            dst = socket.inet_pton(socket.AF_INET, address)
        except (OSError, TypeError):
            raise ValueError(f"{address!r} is not a dotted IPv4 address") from None
        check_timeout(timeout)
        fut: asyncio.Future[ProbeResult] = self._loop.create_future()
        if self._closed:
            fut.set_result(ProbeResult.local_error("pinger closed", "closed"))
            return fut
        seq = self._next_seq()
        if seq is None:  # 65536 probes in flight on our socket: our limit, not theirs
            fut.set_result(ProbeResult.local_error("icmp sequence space full"))
            return fut
        self._probe_no = (self._probe_no + 1) & 0xFFFFFFFF
        token = _TOKEN.pack(self._secret, self._probe_no)
        packet = echo_request(self._ident, seq, token + bytes(8))
        sent_ns = time.monotonic_ns()
        try:
            self._sock.sendto(packet, (address, 0))
        except OSError as exc:
            # Never queued, so a stalled socket cannot grow a backlog. A full send
            # buffer (EAGAIN), ENOBUFS, our own firewall (EPERM) say nothing about
            # the target: unknown; no route to it is the target's failure.
            self.counters["send_errors"] += 1
            fut.set_result(ProbeResult.os_error("send", exc))
            return fut
        self.counters["sent"] += 1
        self._pending[seq] = _Pending(fut, dst, token, sent_ns, self._probe_no)
        self._deadlines.add(timeout, seq, self._probe_no)
        return fut

    def _next_seq(self) -> int | None:
        # A sequence number is reused only once its probe is over, so at most 65536
        # probes can be in flight on one pinger (10,000 targets need < 10,000).
        for _ in range(_SEQ_SPACE):
            self._seq = (self._seq + 1) & 0xFFFF
            if self._seq not in self._pending:
                return self._seq
        return None

    def _expire(self, seq: int, probe_no: int) -> None:
        entry = self._pending.get(seq)
        if entry is None or entry.probe_no != probe_no:
            return  # answered (or failed) in time
        del self._pending[seq]
        if not entry.future.done():  # else cancelled by its owner
            self.counters["timeouts"] += 1
            entry.future.set_result(TIMEOUT)

    # -- receiving --

    def _on_readable(self) -> None:
        for _ in range(_RECV_BATCH):
            try:
                data, addr = self._sock.recvfrom(2048)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # E.g. a queued ICMP error on a ping socket: nothing to match it to.
                self.counters["recv_errors"] += 1
                return
            self.handle_packet(data, addr[0], time.monotonic_ns())

    def handle_packet(self, data: bytes, src: str, recv_ns: int) -> None:
        """Match one received datagram (IP header included on a raw socket) to a
        probe. Public so that tests can feed it malformed input directly."""
        if self.mode == "raw":
            # A raw socket hands over the IP header too: check it before trusting
            # its length field.
            if len(data) < _MIN_IP_HDR or data[0] >> 4 != 4 \
                    or data[9] != socket.IPPROTO_ICMP or data[0] & 0x0F < 5:
                self.counters["malformed"] += 1
                return
            off = (data[0] & 0x0F) * 4
            src_packed = data[12:16]
        else:
            off = 0
            try:
                src_packed = socket.inet_pton(socket.AF_INET, src)
            except (OSError, TypeError):
                self.counters["malformed"] += 1
                return
        if len(data) < off + _HDR.size:
            self.counters["malformed"] += 1
            return
        icmp_type, code, _, ident, seq = _HDR.unpack_from(data, off)
        if icmp_type == ECHO_REPLY:
            self._on_reply(data, off, src_packed, ident, seq, recv_ns)
        elif icmp_type in (DEST_UNREACH, TIME_EXCEEDED):
            self._on_error(data, off + _HDR.size, icmp_type, code)
        else:
            self.counters["unexpected"] += 1

    def _on_reply(self, data: bytes, off: int, src: bytes, ident: int, seq: int,
                  recv_ns: int) -> None:
        if self.mode == "raw" and ident != self._ident:
            self.counters["foreign"] += 1
            return
        entry = self._pending.get(seq)
        start = off + _HDR.size
        if entry is None or entry.dst != src \
                or data[start:start + len(entry.token)] != entry.token:
            self.counters["unexpected"] += 1
            return
        del self._pending[seq]
        if entry.future.done():  # cancelled by its owner
            self.counters["unexpected"] += 1
            return
        self.counters["replies"] += 1
        entry.future.set_result(ProbeResult.success(recv_ns - entry.sent_ns))

    def _on_error(self, data: bytes, inner: int, icmp_type: int, code: int) -> None:
        # The error quotes our request: its IP header, then at least 8 bytes of ICMP.
        if len(data) < inner + _MIN_IP_HDR or data[inner] >> 4 != 4 or data[inner] & 0x0F < 5:
            self.counters["malformed"] += 1
            return
        inner_icmp = inner + (data[inner] & 0x0F) * 4
        if data[inner + 9] != socket.IPPROTO_ICMP or len(data) < inner_icmp + _HDR.size:
            self.counters["unexpected"] += 1
            return
        q_type, _, _, q_ident, q_seq = _HDR.unpack_from(data, inner_icmp)
        entry = self._pending.get(q_seq)
        if q_type != ECHO_REQUEST or q_ident != self._ident or entry is None \
                or entry.dst != data[inner + 16:inner + 20] or entry.future.done():
            self.counters["unexpected"] += 1
            return
        del self._pending[q_seq]
        self.counters["errors"] += 1
        what = "unreachable" if icmp_type == DEST_UNREACH else "ttl exceeded"
        entry.future.set_result(ProbeResult.failure(f"icmp {what} (code {code})"))

    # -- life cycle --

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Stop: pending probes end unknown ("pinger closed"), the socket is closed."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._sock.fileno())
        self._deadlines.close()
        closed = ProbeResult.local_error("pinger closed", "closed")
        for entry in self._pending.values():
            if not entry.future.done():
                entry.future.set_result(closed)
        self._pending.clear()
        self._sock.close()
