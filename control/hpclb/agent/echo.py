"""The agent's network latency to the appliances of a fleet, as ``ping -c 4`` would say.

With a fleet (``hpclb-agent run --connect`` repeated), the weights' network term
must be a figure every appliance sees alike, so the agent measures it and sends
it in the message (``extra["fleet_rtt_ms"]``) instead of each appliance using
its own probe's round trip. Each round sends :data:`COUNT` ICMP echoes to every
endpoint's host at once and takes each host's average round trip (what ``ping
-c 4`` prints as ``avg``); the figure sent is the mean over the hosts that
answered, None when none did (the appliances then score the worst latency).

Sockets: an unprivileged ICMP datagram socket (``SOCK_DGRAM``/``IPPROTO_ICMP``,
allowed to the groups of ``net.ipv4.ping_group_range``, which also covers
ICMPv6), else a raw socket when the agent may open one (root or
CAP_NET_RAW); neither: one log line and no figure. IPv4 and IPv6.

A round is bounded in time (``budget_s``, well under the heartbeat interval):
echoes are sent :data:`SPACING_S` apart and the round ends at the deadline
whatever came back; names are resolved once per round, and a name that does
not resolve is skipped. No hpclb.health import: the agent shares nothing with
the appliance but the telemetry message (import-linter contract).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import selectors
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("hpclb.agent")

COUNT = 4  # echoes per host and round, as `ping -c 4`
SPACING_S = 0.01  # between a host's echoes (ping's default is 1 s: too slow here)
PAYLOAD = b"hpclb-agent-echo"  # 16 bytes, like ping's timestamp + pattern
_ECHO_REQUEST = {socket.AF_INET: 8, socket.AF_INET6: 128}
_ECHO_REPLY = {socket.AF_INET: 0, socket.AF_INET6: 129}
_PROTO = {socket.AF_INET: socket.IPPROTO_ICMP, socket.AF_INET6: socket.IPPROTO_ICMPV6}


def checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of ``data``."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def echo_request(family: int, ident: int, seq: int) -> bytes:
    """An ICMP / ICMPv6 echo request. The checksum is filled in for ICMP (a raw
    socket sends it as is); the kernel computes ICMPv6's, and a datagram
    socket replaces the identifier with its own."""
    head = struct.pack("!BBHHH", _ECHO_REQUEST[family], 0, 0, ident, seq)
    if family == socket.AF_INET:
        head = struct.pack("!BBHHH", _ECHO_REQUEST[family], 0,
                           checksum(head + PAYLOAD), ident, seq)
    return head + PAYLOAD


def parse_reply(family: int, raw: bool, data: bytes) -> tuple[int, int] | None:
    """(identifier, sequence) of an echo reply, None for anything else. A raw
    IPv4 socket hands the IP header too (its length in the first byte)."""
    if raw and family == socket.AF_INET:
        if not data:
            return None
        data = data[(data[0] & 0x0F) * 4:]
    if len(data) < 8:
        return None
    kind, code, _, ident, seq = struct.unpack("!BBHHH", data[:8])
    if kind != _ECHO_REPLY[family] or code != 0:
        return None
    return ident, seq


@dataclass
class _Target:
    host: str
    family: int
    address: tuple[object, ...]
    sock: socket.socket
    raw: bool
    sent: dict[int, float] = field(default_factory=dict)  # seq -> send time
    rtts: list[float] = field(default_factory=list)  # seconds


class EchoMeter:
    """Measures the round trip to ``hosts`` (names or addresses; an IPv6 one
    with or without brackets); :meth:`measure` once per heartbeat."""

    def __init__(self, hosts: Sequence[str], count: int = COUNT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hosts = [h[1:-1] if h.startswith("[") else h for h in hosts]
        self.count = count
        self._clock = clock
        self._seq = itertools.count(int.from_bytes(os.urandom(2), "big"))
        self._ident = os.getpid() & 0xFFFF
        self._refused: set[int] = set()  # families whose sockets were refused (logged)
        self.last: dict[str, float | None] = {}  # host -> its last average, ms

    def _open(self, family: int) -> tuple[socket.socket, bool] | None:
        """A datagram ICMP socket, else a raw one, else None (logged once)."""
        errors = []
        for kind, raw in ((socket.SOCK_DGRAM, False), (socket.SOCK_RAW, True)):
            try:
                return socket.socket(family, kind, _PROTO[family]), raw
            except OSError as err:
                errors.append(f"{'raw' if raw else 'datagram'}: "
                              f"{err.strerror or errno.errorcode.get(err.errno or 0, err)}")
        if family not in self._refused:
            self._refused.add(family)
            v = "ICMP" if family == socket.AF_INET else "ICMPv6"
            log.warning("cannot open an %s socket (%s): no fleet_rtt_ms in the telemetry; "
                        "allow this agent's group in net.ipv4.ping_group_range or give it "
                        "CAP_NET_RAW", v, "; ".join(errors))
        return None

    def _targets(self) -> list[_Target]:
        out = []
        for host in self.hosts:
            try:
                info = socket.getaddrinfo(host, None, type=socket.SOCK_RAW,
                                          proto=socket.IPPROTO_ICMP)
            except (OSError, UnicodeError) as err:
                log.debug("%s does not resolve: %s", host, err)
                continue
            family, _, _, _, address = info[0]
            if family not in _PROTO:
                continue
            opened = self._open(family)
            if opened is None:
                continue
            sock, raw = opened
            sock.setblocking(False)
            out.append(_Target(host, family, (address[0], 0, *address[2:]), sock, raw))
        return out

    def measure(self, budget_s: float) -> float | None:
        """One round, at most ``budget_s`` long: each host's average round trip
        (ms) in :attr:`last`; returns their mean over the hosts that answered,
        None when none did."""
        targets = self._targets()
        self.last = {h: None for h in self.hosts}
        if not targets:
            return None
        start = self._clock()
        deadline = start + budget_s
        sel = selectors.DefaultSelector()
        try:
            for t in targets:
                sel.register(t.sock, selectors.EVENT_READ, t)
            for i in range(self.count):
                send_at = start + i * SPACING_S
                self._receive(sel, min(send_at, deadline))
                if self._clock() >= deadline:
                    break
                for t in targets:
                    seq = next(self._seq) & 0xFFFF
                    try:
                        t.sock.sendto(echo_request(t.family, self._ident, seq), t.address)
                    except OSError as err:  # unreachable: no answer from this one
                        log.debug("echo to %s: %s", t.host, err)
                        continue
                    t.sent[seq] = self._clock()
            if any(t.sent for t in targets):
                self._receive(sel, deadline, targets)
        finally:
            sel.close()
            for t in targets:
                t.sock.close()
        averages = []
        for t in targets:
            if t.rtts:
                avg = 1000.0 * sum(t.rtts) / len(t.rtts)
                self.last[t.host] = avg
                averages.append(avg)
        return sum(averages) / len(averages) if averages else None

    def _receive(self, sel: selectors.BaseSelector, until: float,
                 targets: Sequence[_Target] = ()) -> None:
        """Take replies until ``until`` (at least one poll), or until each of
        ``targets`` has its answers."""
        while True:
            wait = max(until - self._clock(), 0.0)
            for key, _ in sel.select(wait):
                t: _Target = key.data
                for _ in range(64):  # bounded: what is queued now
                    try:
                        data, peer = t.sock.recvfrom(2048)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        break
                    got = parse_reply(t.family, t.raw, data)
                    # A raw socket sees every echo reply of the host: ours are
                    # those with our identifier from this target.
                    if got is None or (t.raw and (got[0] != self._ident
                                                  or peer[0] != t.address[0])):
                        continue
                    sent = t.sent.pop(got[1], None)
                    if sent is not None:
                        t.rtts.append(self._clock() - sent)
            if self._clock() >= until or (targets and not any(t.sent for t in targets)):
                return
