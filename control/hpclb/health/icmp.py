"""ICMP and ICMPv6 echo for any number of targets over one socket per family.

One raw ICMP socket (the appliance runs as root) serves every target of its
family; when raw sockets are refused, an unprivileged ping socket
(``SOCK_DGRAM``/``IPPROTO_ICMP`` or ``IPPROTO_ICMPV6``, allowed for both families
by ``net.ipv4.ping_group_range``) does the same job. Replies are matched to
probes by (identifier, sequence) and by an 8-byte token echoed in the payload, so
a late reply to a recycled sequence number, another program's ping, or a forged
reply without the token cannot pass for an answer. Anything that does not parse
or does not match is dropped and counted (:attr:`IcmpPinger.counters`), never
raised.

The two families differ only in their wire details (:class:`_Proto`): ICMPv6 has
its own type numbers, the kernel computes its checksum (it covers a pseudo-header
we do not see) and a raw ICMPv6 socket hands over no IP header; an error quotes
the IPv6 header of our request instead of the IPv4 one. An :class:`IcmpPinger`
serves one family; the health checker keeps one per family it needs.
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

# ICMPv6 (RFC 4443): its own numbers.
ECHO6_REQUEST = 128
ECHO6_REPLY = 129
DEST6_UNREACH = 1
TIME6_EXCEEDED = 3

# <linux/icmp.h>: a raw ICMP socket's type filter, a bitmask of types to *drop*.
SOL_RAW = 255
ICMP_FILTER = 1
# <netinet/icmp6.h>: ICMP6_FILTER at level IPPROTO_ICMPV6, 256 bits (8 u32 in host
# order), a set bit *blocks* that type.
ICMP6_FILTER = 1
_IPV6_HDR = 40

_HDR = struct.Struct("!BBHHH")  # type, code, checksum, identifier, sequence
_TOKEN = struct.Struct("!4sI")  # per-pinger secret, per-probe counter
_SEQ_SPACE = 1 << 16
_MIN_IP_HDR = 20
_RECV_BATCH = 256  # replies read per wake-up before letting other callbacks run

Mode = Literal["auto", "raw", "dgram"]


@dataclass(frozen=True, slots=True)
class _Proto:
    """What differs between ICMP and ICMPv6 for a pinger."""

    family: socket.AddressFamily
    proto: int  # IPPROTO_ICMP / IPPROTO_ICMPV6
    echo_request: int
    echo_reply: int
    unreach: int
    time_exceeded: int
    what: str  # in error messages: "a dotted IPv4 address", "an IPv6 address"


_V4 = _Proto(socket.AF_INET, socket.IPPROTO_ICMP, ECHO_REQUEST, ECHO_REPLY, DEST_UNREACH,
             TIME_EXCEEDED, "a dotted IPv4 address")
_V6 = _Proto(socket.AF_INET6, socket.IPPROTO_ICMPV6, ECHO6_REQUEST, ECHO6_REPLY,
             DEST6_UNREACH, TIME6_EXCEEDED, "an IPv6 address")


def _proto(family: int) -> _Proto:
    if family == socket.AF_INET:
        return _V4
    if family == socket.AF_INET6:
        return _V6
    raise ValueError(f"ICMP needs an AF_INET or AF_INET6 socket, not family {family}")


#: Every counter an IcmpPinger keeps (all present in `counters`, zeros too).
#: "malformed" covers, on an IPv4 raw socket, a bad IP header; the kernel has
#: checked the IPv6 header before an ICMPv6 socket sees anything.
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


def echo6_request(ident: int, seq: int, payload: bytes) -> bytes:
    """An ICMPv6 echo request, checksum left 0: the kernel fills it in on every
    ICMPv6 socket (RFC 3542; it covers the IPv6 pseudo-header, addresses the
    kernel picks)."""
    return _HDR.pack(ECHO6_REQUEST, 0, 0, ident, seq) + payload


def _filter(proto: _Proto) -> tuple[int, int, bytes]:
    """(level, option, value) of the raw socket's type filter that lets through
    only what can answer a probe: a raw socket otherwise also sees every echo
    request, ours included on loopback, doubling the work."""
    wanted = (proto.echo_reply, proto.unreach, proto.time_exceeded)
    if proto is _V4:
        bits = sum(1 << t for t in wanted)
        return SOL_RAW, ICMP_FILTER, struct.pack("I", ~bits & 0xFFFFFFFF)
    words = [0xFFFFFFFF] * 8  # block everything...
    for t in wanted:  # ...but these
        words[t >> 5] &= ~(1 << (t & 31)) & 0xFFFFFFFF
    return socket.IPPROTO_ICMPV6, ICMP6_FILTER, struct.pack("8I", *words)


def open_icmp_socket(mode: Mode = "auto", rcvbuf: int = 4 << 20,
                     family: socket.AddressFamily = socket.AF_INET) -> socket.socket:
    """A non-blocking ICMP (``AF_INET``) or ICMPv6 (``AF_INET6``) socket: raw if
    allowed (and asked), else a ping socket.

    ``rcvbuf`` is asked for so that a burst of replies from thousands of targets is
    not dropped by the kernel while the event loop is busy; the kernel caps it at
    ``net.core.rmem_max``.
    """
    proto = _proto(family)
    name = "ICMP" if proto is _V4 else "ICMPv6"
    errors: list[str] = []
    if mode in ("auto", "raw"):
        try:
            sock = socket.socket(family, socket.SOCK_RAW, proto.proto)
        except PermissionError as exc:
            errors.append(f"raw {name} socket refused ({exc.strerror}; needs CAP_NET_RAW)")
        else:
            sock.setsockopt(*_filter(proto))
            return _prepare(sock, rcvbuf)
    if mode in ("auto", "dgram"):
        try:
            sock = socket.socket(family, socket.SOCK_DGRAM, proto.proto)
        except PermissionError as exc:
            # One sysctl for both families (the kernel's ping sockets share it).
            errors.append(f"ping socket refused ({exc.strerror}; the group is not in "
                          "net.ipv4.ping_group_range)")
        else:
            return _prepare(sock, rcvbuf)
    if mode not in ("auto", "raw", "dgram"):
        raise ValueError(f"ICMP socket mode {mode!r} is not auto, raw or dgram")
    raise ProbeError(f"cannot probe with {name}: " + "; ".join(errors))


def _prepare(sock: socket.socket, rcvbuf: int) -> socket.socket:
    sock.setblocking(False)
    with contextlib.suppress(OSError):  # a smaller buffer still works
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    return sock


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[ProbeResult]
    dst: bytes  # packed address: the only source a reply may come from
    token: bytes
    sent_ns: int
    probe_no: int  # tells a recycled sequence number's probes apart at expiry


class IcmpPinger:
    """Sends echo requests and resolves each probe's future with its result.

    Create it inside the event loop that will use it. It owns its socket (given, of
    the family it then serves, or opened with ``mode`` for ``family``) and closes
    it in :meth:`close`.
    """

    def __init__(self, sock: socket.socket | None = None, *, mode: Mode = "auto",
                 family: socket.AddressFamily = socket.AF_INET) -> None:
        self._loop = asyncio.get_running_loop()
        self._proto = _proto(sock.family if sock is not None else family)
        #: AF_INET or AF_INET6: the addresses this pinger probes.
        self.family = self._proto.family
        self._sock = sock if sock is not None else open_icmp_socket(mode, family=self.family)
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
        """Send one echo request to ``address`` (an IP literal of the pinger's
        family, no scope); the future resolves with the result within ``timeout``
        seconds. Cancelling it abandons the probe.
        """
        proto = self._proto
        try:
            dst = socket.inet_pton(proto.family, address)
        except (OSError, TypeError):
            raise ValueError(f"{address!r} is not {proto.what}") from None
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
        payload = token + bytes(8)
        packet = (echo_request(self._ident, seq, payload) if proto is _V4
                  else echo6_request(self._ident, seq, payload))
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
        """Match one received datagram (IP header included on a raw IPv4 socket) to
        a probe. Public so that tests can feed it malformed input directly."""
        proto = self._proto
        if proto is _V6:
            # No IP header on any ICMPv6 socket; the source comes from recvfrom
            # (a link-local one with its "%scope", which is no part of the address).
            off = 0
            try:
                src_packed = socket.inet_pton(socket.AF_INET6, src.partition("%")[0])
            except (OSError, TypeError, AttributeError):
                self.counters["malformed"] += 1
                return
        elif self.mode == "raw":
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
        if icmp_type == proto.echo_reply:
            self._on_reply(data, off, src_packed, ident, seq, recv_ns)
        elif icmp_type in (proto.unreach, proto.time_exceeded):
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

    def _quote(self, data: bytes, inner: int) -> tuple[int, bytes] | None:
        """(offset of the quoted ICMP header, quoted destination) of the request an
        error quotes, None when the quote is no IP header of ours (counted)."""
        if self._proto is _V6:
            # The fixed IPv6 header, then our echo request: we never send extension
            # headers, so a quote with any is not of ours.
            if len(data) < inner + _IPV6_HDR or data[inner] >> 4 != 6:
                self.counters["malformed"] += 1
                return None
            inner_icmp, next_header = inner + _IPV6_HDR, data[inner + 6]
            dst = data[inner + 24:inner + 40]
        else:
            if len(data) < inner + _MIN_IP_HDR or data[inner] >> 4 != 4 \
                    or data[inner] & 0x0F < 5:
                self.counters["malformed"] += 1
                return None
            inner_icmp, next_header = inner + (data[inner] & 0x0F) * 4, data[inner + 9]
            dst = data[inner + 16:inner + 20]
        if next_header != self._proto.proto or len(data) < inner_icmp + _HDR.size:
            self.counters["unexpected"] += 1
            return None
        return inner_icmp, dst

    def _on_error(self, data: bytes, inner: int, icmp_type: int, code: int) -> None:
        # The error quotes our request: its IP header, then at least 8 bytes of ICMP.
        quote = self._quote(data, inner)
        if quote is None:
            return
        inner_icmp, dst = quote
        q_type, _, _, q_ident, q_seq = _HDR.unpack_from(data, inner_icmp)
        entry = self._pending.get(q_seq)
        if q_type != self._proto.echo_request or q_ident != self._ident or entry is None \
                or entry.dst != dst or entry.future.done():
            self.counters["unexpected"] += 1
            return
        del self._pending[q_seq]
        self.counters["errors"] += 1
        what = "unreachable" if icmp_type == self._proto.unreach else "ttl exceeded"
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
