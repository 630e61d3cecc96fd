"""Health probes over real sockets: ICMP and ICMPv6, TCP, HTTP (over IPv4 and
IPv6) and the checker that runs them. HTTPS: test_health_tls.py.

Everything runs on loopback. Where a target must *not* answer, the test runs in a
fresh network namespace of its own thread (``new_netns``) with echo replies off
(``icmp_echo_ignore_all`` is per namespace), so nothing outside can answer and
nothing on the host changes. Timeouts are generous and only counts and order are
asserted, never speed.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import struct
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# Imported here, not when first used: pyroute2 defines socket.socket subclasses as it
# loads, which fails while a test has monkeypatched socket.socket.
from pyroute2 import IPRoute

from hpclb.config.probes import ProbeConfig
from hpclb.health import (
    HealthChecker,
    IcmpPinger,
    ProbeError,
    TcpConnector,
    Transition,
    http_get,
    open_icmp_socket,
)
from hpclb.health import icmp as icmp_mod
from hpclb.health import tcp as tcp_mod
from hpclb.health.http import build_request, host_header, parse_status
from hpclb.health.icmp import checksum, echo6_request, echo_request
from hpclb.host.netns import new_netns

from .probe_sockets import has_ipv6_loopback, syn_dropping_port

ROOT = os.geteuid() == 0
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
NO_DAMPING = {"enabled": False}
#: Long enough for a loaded 2-core machine, short enough for a quick suite.
WAIT = 10.0
#: A second IPv6 address on the fresh namespaces' lo (a ULA), and the flag that
#: makes it usable at once (no duplicate address detection).
OTHER6 = "fd00:1b::2"
IFA_F_NODAD = 0x02


def wait_until_usable(address: str) -> None:
    """Until a datagram to a new IPv6 address arrives: the kernel makes it usable
    from a work queue (even with no duplicate address detection), its local route
    last, and until then packets to it are dropped."""
    for _ in range(int(WAIT / 0.05)):
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.settimeout(0.05)
            try:
                s.bind((address, 0))
                s.sendto(b"?", s.getsockname())
                s.recv(1)
            except OSError:  # not bindable yet (EADDRNOTAVAIL), or lost (timeout)
                threading.Event().wait(0.01)
                continue
            return
    raise AssertionError(f"{address} never became usable")


def ipv6_only(f: F) -> F:
    """Tests on ::1: skipped, saying why, where the host has no IPv6 loopback."""
    return pytest.mark.skipif(not has_ipv6_loopback(),  # type: ignore[no-any-return]
                              reason="no IPv6 on loopback here (disable_ipv6?)")(f)


# --- helpers -----------------------------------------------------------------------


def root_only(f: F) -> F:
    """Raw sockets and namespaces: marked `root`, skipped (saying why) without it."""
    marked = pytest.mark.skipif(not ROOT, reason="needs root: raw sockets, namespaces")(f)
    return pytest.mark.root(marked)  # type: ignore[no-any-return]


def in_fresh_netns(main: Callable[[], Coroutine[Any, Any, T]], *, echo: bool = True,
                   ping_group: bool = False) -> T:
    """Run ``asyncio.run(main())`` in a thread inside a new network namespace with
    only ``lo`` up (127.0.0.1, ::1, and OTHER6 for a second IPv6 source);
    ``echo=False`` makes the kernel ignore echo requests there (IPv4 and IPv6),
    ``ping_group=True`` allows unprivileged ping sockets there (both families)."""
    out: dict[str, Any] = {}

    def thread() -> None:
        try:
            new_netns()
            with IPRoute() as ipr:
                lo = ipr.link_lookup(ifname="lo")[0]
                ipr.link("set", index=lo, state="up")
                ipr.addr("add", index=lo, address=OTHER6, prefixlen=128, flags=IFA_F_NODAD)
            wait_until_usable(OTHER6)
            # /proc/sys/net is the namespace of the thread that opens it.
            for knob in ("ipv4/icmp_echo_ignore_all", "ipv6/icmp/echo_ignore_all"):
                with open(f"/proc/sys/net/{knob}", "w") as f:
                    f.write("0" if echo else "1")
            if ping_group:
                with open("/proc/sys/net/ipv4/ping_group_range", "w") as f:
                    f.write("0 2147483647")
            out["value"] = asyncio.run(main())
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=thread, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "namespace thread hung"
    if "error" in out:
        raise out["error"]
    value: T = out["value"]
    return value


@contextmanager
def closed_port() -> Iterator[int]:
    """A loopback port that refuses connections: bound (so nobody else takes it)
    but not listening."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


async def wait_for(predicate: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(WAIT):
        while not predicate():
            await asyncio.sleep(0.02)


# --- ICMP --------------------------------------------------------------------------


def test_checksum_of_a_known_packet() -> None:
    # Echo request id 1 seq 1, no payload: 0x0800 + 0x0001 + 0x0001 -> ~0x0802.
    assert checksum(bytes([8, 0, 0, 0, 0, 1, 0, 1])) == 0xF7FD
    pkt = echo_request(0x1234, 7, b"abcdefg")  # odd length
    assert checksum(pkt + b"\0") == 0


@root_only
def test_icmp_loopback_answers_one_socket_many_targets() -> None:
    async def main() -> None:
        pinger = IcmpPinger()
        assert pinger.mode == "raw"
        targets = [f"127.3.{i // 200}.{1 + i % 200}" for i in range(300)]
        results = await asyncio.gather(*(pinger.ping(t, WAIT) for t in targets))
        assert all(r.ok for r in results), {r.reason for r in results}
        assert all(r.rtt_ms is not None and r.rtt_ms >= 0 for r in results)
        assert pinger.counters["sent"] == pinger.counters["replies"] == 300
        assert pinger.counters["timeouts"] == pinger.in_flight == 0
        pinger.close()

    asyncio.run(main())


@root_only
@pytest.mark.parametrize(("family", "here", "nowhere"), [
    (socket.AF_INET, "127.0.0.1", "192.0.2.1"),
    (socket.AF_INET6, "::1", "2001:db8::1"),
], ids=["icmp", "icmp6"])
def test_icmp_unanswered_times_out_and_unroutable_fails_at_once(
        family: int, here: str, nowhere: str) -> None:
    async def main() -> tuple[Any, ...]:
        pinger = IcmpPinger(family=family)
        silent = await pinger.ping(here, 0.3)  # echo ignored in this namespace
        unroutable = await pinger.ping(nowhere, WAIT)  # only lo: no route at all
        counters = dict(pinger.counters)
        pinger.close()
        return silent, unroutable, counters

    silent, unroutable, counters = in_fresh_netns(main, echo=False)
    assert (silent.ok, silent.rtt_ms, silent.reason) == (False, None, "timeout")
    assert not unroutable.ok and unroutable.reason.startswith("send:"), unroutable
    if family == socket.AF_INET6:
        assert not unroutable.local
    assert counters["timeouts"] == 1 and counters["send_errors"] == 1
    assert counters["replies"] == 0


def refuse_raw_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    """socket.socket refuses SOCK_RAW as an unprivileged user's would; the rest pass."""
    real_socket = socket.socket

    def no_raw(family: int = -1, type: int = -1, proto: int = -1, *a: Any) -> socket.socket:
        if type == socket.SOCK_RAW:
            raise PermissionError(1, "Operation not permitted")
        return real_socket(family, type, proto, *a)

    monkeypatch.setattr(socket, "socket", no_raw)


@root_only
def test_icmp_falls_back_to_a_ping_socket_when_raw_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_raw_sockets(monkeypatch)

    async def main() -> tuple[str, bool]:
        pinger = IcmpPinger()  # mode auto
        result = await pinger.ping("127.0.0.1", WAIT)
        pinger.close()
        return pinger.mode, result.ok

    assert in_fresh_netns(main, ping_group=True) == ("dgram", True)


def test_icmp_no_socket_at_all_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*a: Any, **k: Any) -> socket.socket:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(socket, "socket", refused)
    with pytest.raises(ProbeError, match=r"raw ICMP socket refused.*ping socket refused"):
        open_icmp_socket("auto")
    with pytest.raises(ValueError, match="not auto, raw or dgram"):
        open_icmp_socket("bogus")  # type: ignore[arg-type]


class Reflector:
    """A hand-made echo responder on a second raw socket: it sees our request and
    answers it correctly or in any broken way a test asks for."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        self.sock.setblocking(False)

    async def request(self, whole: bool = False) -> bytes:
        """The next echo request seen: its ICMP part, or the IP packet if ``whole``."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(WAIT):
            while True:
                data = await loop.sock_recv(self.sock, 2048)
                icmp = data[(data[0] & 0x0F) * 4:]
                if icmp[0] == icmp_mod.ECHO_REQUEST:
                    return data if whole else icmp

    def send(self, icmp: bytes, src: str = "127.0.0.1") -> None:
        """Send raw ICMP bytes to 127.0.0.1 from ``src`` (checksum not fixed)."""
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        s.bind((src, 0))
        s.sendto(icmp, ("127.0.0.1", 0))
        s.close()

    @staticmethod
    def reply(request: bytes, **changes: Any) -> bytes:
        body = echo_reply(request, 0, **changes)
        return body[:2] + struct.pack("!H", checksum(body)) + body[4:]


def echo_reply(request: bytes, rtype: int, *, ident_delta: int = 0, seq_delta: int = 0,
               flip_token: bool = False) -> bytes:
    """The echo reply of type rtype to an echo request (ICMP or ICMPv6), checksum 0,
    its identifier or sequence number off by a delta, or its token forged."""
    _, _, _, ident, seq = struct.unpack_from("!BBHHH", request)
    payload = bytearray(request[8:])
    if flip_token:
        payload[0] ^= 0xFF
    return struct.pack("!BBHHH", rtype, 0, 0, (ident + ident_delta) & 0xFFFF,
                       (seq + seq_delta) & 0xFFFF) + bytes(payload)


@root_only
def test_icmp_malformed_and_unexpected_replies_are_ignored_and_counted() -> None:
    async def main() -> dict[str, Any]:
        pinger = IcmpPinger()
        refl = Reflector()
        probe = pinger.ping("127.0.0.1", WAIT)
        req = await refl.request()
        # 4 bytes of ICMP: the kernel's ICMP_FILTER drops anything shorter than an
        # ICMP header before it reaches us (the fuzz test below covers it).
        refl.send(req[:4])
        refl.send(Reflector.reply(req, ident_delta=1))  # another pinger's -> foreign
        refl.send(Reflector.reply(req, seq_delta=1))  # no such probe -> unexpected
        refl.send(Reflector.reply(req, flip_token=True))  # forged -> unexpected
        refl.send(Reflector.reply(req), src="127.0.0.2")  # wrong source -> unexpected
        # Destination unreachable quoting 3 bytes instead of a header -> malformed.
        refl.send(bytes([3, 1, 0, 0, 0, 0, 0, 0]) + b"abc")
        refl.send(bytes([13, 0, 0, 0, 0, 0, 0, 0]))  # a timestamp request -> filtered out
        await asyncio.sleep(0.2)
        assert not probe.done(), "a bad reply passed for an answer"
        refl.send(Reflector.reply(req))  # the real thing
        good = await probe
        # A second probe times out; its reply arrives late and is ignored.
        late = pinger.ping("127.0.0.1", 0.2)
        req2 = await refl.request()
        timed_out = await late
        refl.send(Reflector.reply(req2))
        await asyncio.sleep(0.2)
        counters = dict(pinger.counters)
        pinger.close()
        refl.sock.close()
        return {"good": good, "late": timed_out, "counters": counters}

    out = in_fresh_netns(main, echo=False)
    assert out["good"].ok and out["good"].rtt_ms is not None
    assert out["late"].reason == "timeout"
    c = out["counters"]
    assert (c["malformed"], c["foreign"], c["unexpected"]) == (1, 1, 4)
    assert (c["replies"], c["timeouts"], c["sent"]) == (1, 1, 2)


@root_only
def test_icmp_unreachable_fails_the_probe_at_once() -> None:
    async def main() -> tuple[Any, dict[str, int]]:
        pinger = IcmpPinger()
        refl = Reflector()
        probe = pinger.ping("127.0.0.1", WAIT)
        req = await refl.request(whole=True)
        quote = req[:(req[0] & 0x0F) * 4 + 8]  # its IP header and 8 bytes of ICMP
        refl.send(bytes([3, 1, 0, 0, 0, 0, 0, 0]) + quote)  # host unreachable
        result = await probe
        counters = dict(pinger.counters)
        pinger.close()
        refl.sock.close()
        return result, counters

    result, counters = in_fresh_netns(main, echo=False)
    assert (result.ok, result.reason) == (False, "icmp unreachable (code 1)")
    assert counters["errors"] == 1 and counters["timeouts"] == 0


@root_only
@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=120), header=st.booleans())
def test_icmp_any_bytes_are_counted_once_never_raised(data: bytes, header: bool) -> None:
    async def main() -> None:
        pinger = IcmpPinger()
        pending = pinger.ping("127.0.0.1", WAIT)
        # Half the cases get a plausible IPv4+ICMP header so the fuzz reaches the
        # ICMP parsing, not only the IP header checks.
        packet = (bytes([0x45, 0, 0, 0, 0, 0, 0, 0, 64, 1, 0, 0, 127, 0, 0, 1,
                         127, 0, 0, 1]) + data) if header else data
        before = sum(pinger.counters[k] for k in ("malformed", "foreign", "unexpected",
                                                  "replies", "errors"))
        pinger.handle_packet(packet, "127.0.0.1", 0)
        after = sum(pinger.counters[k] for k in ("malformed", "foreign", "unexpected",
                                                 "replies", "errors"))
        assert after == before + 1
        await pending  # the real reply (or a match by chance) still resolves it
        pinger.close()

    asyncio.run(main())


class RefusingSocket(socket.socket):
    """A datagram socket whose sendto() fails with ``self.error`` (an errno)."""

    error = errno.ENOBUFS

    def sendto(self, *args: Any) -> int:
        if self.error == errno.EAGAIN:
            raise BlockingIOError(self.error, os.strerror(self.error))
        raise OSError(self.error, os.strerror(self.error))


def test_icmp_send_errors_of_our_own_are_unknown_no_route_is_a_failure() -> None:
    async def main() -> dict[int, Any]:
        sock = RefusingSocket(socket.AF_INET, socket.SOCK_DGRAM)
        pinger = IcmpPinger(sock)
        out = {}
        for err in (errno.ENOBUFS, errno.EAGAIN, errno.EPERM, errno.EACCES, errno.ENOMEM,
                    errno.ENETUNREACH, errno.EHOSTUNREACH):
            sock.error = err
            out[err] = await pinger.ping("127.0.0.1", 1.0)
        assert pinger.counters["send_errors"] == 7 and pinger.in_flight == 0
        pinger.close()
        assert (await pinger.ping("127.0.0.1", 1.0)).local  # closed: ours
        return out

    out = asyncio.run(main())
    for err, cause in ((errno.ENOBUFS, "enobufs"), (errno.EAGAIN, "eagain"),
                       (errno.EPERM, "eperm"), (errno.EACCES, "eacces"),
                       (errno.ENOMEM, "enomem")):
        r = out[err]
        assert (r.ok, r.local, r.cause) == (False, True, cause), r
        assert r.reason == f"send: {os.strerror(err)}"
    for err in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        r = out[err]
        assert (r.ok, r.local, r.reason) == (False, False, f"send: {os.strerror(err)}")


def test_ping_rejects_an_address_of_another_family() -> None:
    async def main() -> None:
        pinger = IcmpPinger(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        assert pinger.family == socket.AF_INET
        for bad in ("::1", "localhost", "1.2.3", "", "1.2.3.4 "):
            with pytest.raises(ValueError, match="not a dotted IPv4"):
                pinger.ping(bad, 1.0)
        pinger6 = IcmpPinger(socket.socket(socket.AF_INET6, socket.SOCK_DGRAM))
        assert pinger6.family == socket.AF_INET6
        for bad in ("127.0.0.1", "fe80::1%lo", "localhost", "::1::", ""):
            with pytest.raises(ValueError, match="not an IPv6 address"):
                pinger6.ping(bad, 1.0)
        assert pinger6.counters["sent"] == 0
        pinger6.close()
        for timeout in (0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="must be a positive number"):
                pinger.ping("127.0.0.1", timeout)
        assert pinger.in_flight == 0 and pinger.counters["sent"] == 0
        pinger.close()

    asyncio.run(main())


# --- ICMPv6 ------------------------------------------------------------------------


@root_only
@ipv6_only
def test_icmp6_loopback_answers_many_probes_on_one_socket() -> None:
    async def main() -> None:
        pinger = IcmpPinger(family=socket.AF_INET6)
        assert (pinger.mode, pinger.family) == ("raw", socket.AF_INET6)
        results = await asyncio.gather(*(pinger.ping("::1", WAIT) for _ in range(200)))
        assert all(r.ok for r in results), {r.reason for r in results}
        assert all(r.rtt_ms is not None and r.rtt_ms >= 0 for r in results)
        assert pinger.counters["sent"] == pinger.counters["replies"] == 200
        assert pinger.counters["timeouts"] == pinger.in_flight == 0
        pinger.close()

    asyncio.run(main())


@root_only
def test_icmp6_falls_back_to_a_ping_socket_when_raw_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_raw_sockets(monkeypatch)

    async def main() -> tuple[str, list[bool]]:
        pinger = IcmpPinger(family=socket.AF_INET6)  # mode auto
        results = await asyncio.gather(*(pinger.ping(a, WAIT) for a in ("::1", OTHER6)))
        pinger.close()
        return pinger.mode, [r.reason for r in results]

    assert in_fresh_netns(main, ping_group=True) == ("dgram", ["ok", "ok"])


def test_icmp6_no_socket_at_all_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*a: Any, **k: Any) -> socket.socket:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(socket, "socket", refused)
    with pytest.raises(ProbeError, match=r"ICMPv6: raw ICMPv6 socket refused.*"
                                         r"ping socket refused.*ping_group_range"):
        open_icmp_socket("auto", family=socket.AF_INET6)


def ipv6_header(payload_len: int, src: str = "::1", dst: str = "::1",
                next_header: int = socket.IPPROTO_ICMPV6) -> bytes:
    return (struct.pack("!IHBB", 6 << 28, payload_len, next_header, 64)
            + socket.inet_pton(socket.AF_INET6, src) + socket.inet_pton(socket.AF_INET6, dst))


class Reflector6:
    """Reflector for ICMPv6: a raw ICMPv6 socket sees our request (no IP header
    on ICMPv6 sockets) and answers as a test asks; the kernel fills in the
    checksum of what it sends."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
        self.sock.setblocking(False)

    async def request(self) -> bytes:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(WAIT):
            while True:
                data = await loop.sock_recv(self.sock, 2048)
                if data and data[0] == icmp_mod.ECHO6_REQUEST:
                    return data

    def send(self, icmp: bytes, src: str = "::1") -> None:
        s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
        s.bind((src, 0))
        s.sendto(icmp, ("::1", 0))
        s.close()

    @staticmethod
    def reply(request: bytes, **changes: Any) -> bytes:
        return echo_reply(request, icmp_mod.ECHO6_REPLY, **changes)


@root_only
def test_icmp6_malformed_and_unexpected_replies_are_ignored_and_counted() -> None:
    async def main() -> dict[str, Any]:
        pinger = IcmpPinger(family=socket.AF_INET6)
        refl = Reflector6()
        probe = pinger.ping("::1", WAIT)
        req = await refl.request()
        refl.send(Reflector6.reply(req, ident_delta=1))  # another pinger's -> foreign
        refl.send(Reflector6.reply(req, seq_delta=1))  # no such probe -> unexpected
        refl.send(Reflector6.reply(req, flip_token=True))  # forged -> unexpected
        refl.send(Reflector6.reply(req), src=OTHER6)  # wrong source -> unexpected
        # Destination unreachable quoting 3 bytes instead of a header -> malformed.
        refl.send(bytes([icmp_mod.DEST6_UNREACH, 3, 0, 0, 0, 0, 0, 0]) + b"abc")
        # An unreachable quoting a UDP packet: not ours -> unexpected.
        refl.send(bytes([icmp_mod.DEST6_UNREACH, 3, 0, 0, 0, 0, 0, 0])
                  + ipv6_header(8, next_header=socket.IPPROTO_UDP) + bytes(8))
        refl.send(bytes([135, 0, 0, 0, 0, 0, 0, 0]) + bytes(16))  # NS: filtered out
        await asyncio.sleep(0.2)
        assert not probe.done(), "a bad reply passed for an answer"
        refl.send(Reflector6.reply(req))  # the real thing
        good = await probe
        late = pinger.ping("::1", 0.2)
        req2 = await refl.request()
        timed_out = await late
        refl.send(Reflector6.reply(req2))  # after its deadline -> unexpected
        await asyncio.sleep(0.2)
        counters = dict(pinger.counters)
        pinger.close()
        refl.sock.close()
        return {"good": good, "late": timed_out, "counters": counters}

    out = in_fresh_netns(main, echo=False)
    assert out["good"].ok and out["good"].rtt_ms is not None
    assert out["late"].reason == "timeout"
    c = out["counters"]
    assert (c["malformed"], c["foreign"], c["unexpected"]) == (1, 1, 5), c
    assert (c["replies"], c["timeouts"], c["sent"]) == (1, 1, 2)


@root_only
def test_icmp6_unreachable_and_time_exceeded_fail_the_probe_at_once() -> None:
    async def main() -> tuple[list[Any], dict[str, int]]:
        pinger = IcmpPinger(family=socket.AF_INET6)
        refl = Reflector6()
        results = []
        for icmp_type, code in ((icmp_mod.DEST6_UNREACH, 3), (icmp_mod.TIME6_EXCEEDED, 0)):
            probe = pinger.ping(OTHER6, WAIT)
            req = await refl.request()
            # The error quotes our request: its IPv6 header, then the ICMPv6 part.
            quote = ipv6_header(len(req), dst=OTHER6) + req
            refl.send(bytes([icmp_type, code, 0, 0, 0, 0, 0, 0]) + quote)
            results.append(await probe)
        counters = dict(pinger.counters)
        pinger.close()
        refl.sock.close()
        return results, counters

    (unreach, exceeded), counters = in_fresh_netns(main, echo=False)
    assert (unreach.ok, unreach.reason) == (False, "icmp unreachable (code 3)")
    assert (exceeded.ok, exceeded.reason) == (False, "icmp ttl exceeded (code 0)")
    assert counters["errors"] == 2 and counters["timeouts"] == 0


@root_only
@ipv6_only
@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=120), quote=st.booleans())
def test_icmp6_any_bytes_are_counted_once_never_raised(data: bytes, quote: bool) -> None:
    async def main() -> None:
        pinger = IcmpPinger(family=socket.AF_INET6)
        pending = pinger.ping("::1", WAIT)
        # Half the cases are an unreachable quoting an IPv6 header of ours, so the
        # fuzz reaches the quote's parsing, not only the ICMPv6 header checks.
        packet = (bytes([icmp_mod.DEST6_UNREACH, 0, 0, 0, 0, 0, 0, 0])
                  + ipv6_header(len(data)) + data) if quote else data
        keys = ("malformed", "foreign", "unexpected", "replies", "errors")
        before = sum(pinger.counters[k] for k in keys)
        pinger.handle_packet(packet, "::1", 0)
        pinger.handle_packet(packet, "not an address", 0)  # -> malformed
        assert sum(pinger.counters[k] for k in keys) == before + 2
        await pending
        pinger.close()

    asyncio.run(main())


def test_echo6_request_leaves_the_checksum_to_the_kernel() -> None:
    pkt = echo6_request(0x1234, 7, b"abc")
    assert pkt == bytes([128, 0, 0, 0, 0x12, 0x34, 0, 7]) + b"abc"


@root_only
@ipv6_only
def test_checker_probes_both_families_with_one_pinger_each() -> None:
    async def main() -> dict[str, int]:
        checker = HealthChecker(lambda t: None)
        cfg = ProbeConfig(interval_s=0.1)
        checker.add("v4", "127.0.0.1", cfg)
        checker.add("v6", "::1", cfg)
        checker.add("v6b", "0:0::1", cfg)  # the same address, written otherwise
        assert checker.status("v6b").address == "::1"
        await wait_for(lambda: all(checker.rtt_ms(n) is not None for n in ("v4", "v6", "v6b")),
                       "an RTT for every backend")
        assert set(checker.pingers) == {socket.AF_INET, socket.AF_INET6}
        assert checker.pinger is checker.pingers[socket.AF_INET]
        stats = checker.stats()
        checker.close()
        return stats

    stats = asyncio.run(main())
    assert stats["icmp_replies"] >= 1 and stats["icmp6_replies"] >= 2
    assert stats["icmp6_timeouts"] == 0


@ipv6_only
def test_tcp_and_http_over_ipv6() -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: w.close(), "::1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = TcpConnector()
        assert (await conn.connect("::1", port, WAIT)).ok
        server.close()
        await server.wait_closed()
        assert (await conn.connect("::1", port, WAIT)).reason == "refused"
        conn.close()
        srv = await TinyHttp().start("::1")
        ok = await http_get("::1", srv.port, WAIT, path="/ping")
        assert ok.ok, ok
        assert f"\r\nHost: [::1]:{srv.port}\r\n" in srv.requests[-1].decode()
        checker = HealthChecker(lambda t: None)
        checker.add("web6", "::1", ProbeConfig(kind="http", port=srv.port, interval_s=0.1))
        checker.add("tcp6", "::1", ProbeConfig(kind="tcp", port=srv.port, interval_s=0.1))
        await wait_for(lambda: all(checker.status(n).probes >= 2 and checker.status(n).failed == 0
                                   for n in ("web6", "tcp6")), "IPv6 probes that succeed")
        checker.close()
        await srv.stop()

    asyncio.run(main())


# --- TCP ---------------------------------------------------------------------------


def test_tcp_listening_port_is_up_closed_port_is_down() -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = TcpConnector()
        with closed_port() as dead:
            up = await conn.connect("127.0.0.1", port, WAIT)
            down = await conn.connect("127.0.0.1", dead, WAIT)
        assert up.ok and up.rtt_ms is not None and up.reason == "ok"
        assert (down.ok, down.rtt_ms, down.reason) == (False, None, "refused")
        assert conn.in_flight == 0
        assert conn.counters["ok"] == 1 and conn.counters["failed"] == 1
        conn.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_tcp_syn_dropped_times_out() -> None:
    async def main(port: int) -> Any:
        conn = TcpConnector()
        result = await conn.connect("127.0.0.1", port, 0.3)
        conn.close()
        return result

    with syn_dropping_port() as port:
        result = asyncio.run(main(port))
    assert result.reason == "timeout" and not result.ok


def test_tcp_connect_errors_of_our_own_are_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    returned = [errno.EADDRNOTAVAIL]

    class Fails(socket.socket):
        def connect_ex(self, address: Any) -> int:
            return returned[0]

    async def main() -> dict[int, Any]:
        conn = TcpConnector()
        monkeypatch.setattr(tcp_mod.socket, "socket", Fails)
        out = {}
        for err in (errno.EADDRNOTAVAIL, errno.EPERM, errno.ENOBUFS, errno.ENETUNREACH):
            returned[0] = err
            out[err] = await conn.connect("127.0.0.1", 9, WAIT)
        monkeypatch.undo()
        assert conn.counters["local"] == 3 and conn.counters["failed"] == 1
        conn.close()
        assert (await conn.connect("127.0.0.1", 9, 1.0)).local  # closed: ours
        return out

    out = asyncio.run(main())
    for err, cause in ((errno.EADDRNOTAVAIL, "eaddrnotavail"), (errno.EPERM, "eperm"),
                       (errno.ENOBUFS, "enobufs")):
        r = out[err]
        assert (r.ok, r.local, r.cause) == (False, True, cause), r
        assert r.reason == f"connect: {os.strerror(err)}"
    assert (out[errno.ENETUNREACH].local, out[errno.ENETUNREACH].reason) == \
        (False, "network unreachable")


def test_tcp_many_targets_and_cancellation() -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: w.close(), "0.0.0.0", 0)
        port = server.sockets[0].getsockname()[1]
        conn = TcpConnector()
        results = await asyncio.gather(*(conn.connect(f"127.4.0.{i}", port, WAIT)
                                         for i in range(1, 101)))
        assert all(r.ok for r in results)
        abandoned = conn.connect("127.0.0.1", port, WAIT)
        abandoned.cancel()
        await asyncio.sleep(0.1)
        assert conn.in_flight == 0  # completed (or expired) and closed all the same
        with pytest.raises(ValueError, match="not an IP address"):
            conn.connect("localhost", port, 1.0)
        with pytest.raises(ValueError, match="must be a positive number"):
            conn.connect("127.0.0.1", port, float("nan"))
        conn.close()
        assert (await conn.connect("127.0.0.1", port, 1.0)).reason == "connector closed"
        server.close()
        await server.wait_closed()

    asyncio.run(main())


# --- HTTP --------------------------------------------------------------------------


class TinyHttp:
    """A one-line-answer HTTP server whose answer the test changes between probes."""

    def __init__(self) -> None:
        self.answer = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str = "127.0.0.1") -> TinyHttp:
        self.server = await asyncio.start_server(self._serve, host, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.requests.append(await reader.readuntil(b"\r\n\r\n"))
            if self.answer == b"silence":
                await asyncio.sleep(WAIT)
            else:
                writer.write(self.answer)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def test_http_status_decides_and_the_request_is_well_formed() -> None:
    async def main() -> None:
        srv = await TinyHttp().start()
        ok = await http_get("127.0.0.1", srv.port, WAIT, path="/health?x=1")
        assert ok.ok and ok.rtt_ms is not None
        req = srv.requests[-1].decode()
        assert req.startswith("GET /health?x=1 HTTP/1.1\r\n")
        assert f"\r\nHost: 127.0.0.1:{srv.port}\r\n" in req
        assert "\r\nConnection: close\r\n" in req
        cases = {
            b"HTTP/1.1 503 Service Unavailable\r\n\r\n": "http 503",
            b"HTTP/1.0 302 Found\r\n\r\n": "ok",
            b"HTTP/1.1 404\r\n\r\n": "http 404",
            b"SSH-2.0-OpenSSH\r\n": "http: malformed status line",
            b"": "http: connection closed before a status line",
            b"HTTP/1.1 200 " + b"x" * 5000 + b"\r\n": "http status line too long",
        }
        for answer, reason in cases.items():
            srv.answer = answer
            assert (await http_get("127.0.0.1", srv.port, WAIT)).reason == reason, answer
        srv.answer = b"HTTP/1.1 404 Not Found\r\n\r\n"
        only_404 = await http_get("127.0.0.1", srv.port, WAIT, host="example.org",
                                  accepts=lambda s: s == 404)
        assert only_404.ok and "\r\nHost: example.org\r\n" in srv.requests[-1].decode()
        srv.answer = b"silence"
        assert (await http_get("127.0.0.1", srv.port, 0.3)).reason == "timeout"
        with closed_port() as dead:
            assert (await http_get("127.0.0.1", dead, WAIT)).reason == "refused"
        await srv.stop()

    asyncio.run(main())


def test_http_request_cannot_smuggle_headers() -> None:
    assert build_request("/", "h").startswith(b"GET / HTTP/1.1\r\nHost: h\r\n")
    for path, host in (("/a b", "h"), ("/x\r\nX-Evil: 1", "h"), ("noslash", "h"),
                       ("/", "h\r\nX: y"), ("/", "")):
        with pytest.raises(ValueError):
            build_request(path, host)
    assert host_header("10.0.0.1", 80) == "10.0.0.1"
    assert host_header("fd00::1", 8080) == "[fd00::1]:8080"
    assert parse_status(b"HTTP/1.1 200 OK\r\n") == 200
    assert parse_status(b"HTTP/1.1 200\r\n") == 200
    assert parse_status(b"HTTP/1.1 2000 OK\r\n") is None
    assert parse_status(b"HTTP/2 200\r\n") is None


# --- the checker over real sockets ---------------------------------------------------


def test_checker_tcp_down_after_fall_up_after_rise_with_rtts() -> None:
    async def main() -> None:
        events: list[tuple[Transition, int, int]] = []
        cfg = ProbeConfig(kind="tcp", port=1, interval_s=0.2, rise=2, fall=3,
                          damping=NO_DAMPING)

        def on_transition(t: Transition) -> None:
            st_ = checker.status(t.backend)
            events.append((t, st_.successes, st_.failures))

        checker = HealthChecker(on_transition)
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        cfg = cfg.model_copy(update={"port": port})
        checker.add("n1", "127.0.0.1", cfg)
        assert checker.is_up("n1") and checker.rtt_ms("n1") is None  # initial: up
        await wait_for(lambda: checker.status("n1").probes >= 3, "three probes")
        assert checker.rtt_ms("n1") is not None and not events
        server.close()
        await server.wait_closed()
        await wait_for(lambda: bool(events), "the down transition")
        down, _, failures = events[0]
        assert (down.backend, down.up) == ("n1", False) and failures == 3
        assert down.reason == "3 consecutive failures (last: refused)"
        assert checker.rtt_ms("n1") is None and not checker.is_up("n1")
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        await wait_for(lambda: len(events) == 2, "the up transition")
        up, successes, _ = events[1]
        assert up.up and successes == 2 and up.reason == "2 consecutive successes"
        assert up.time >= down.time and up.monotonic > down.monotonic
        assert checker.rtts()["n1"] is not None
        assert checker.stats()["tcp_failed"] >= 3
        checker.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_checker_http_200_then_503_through_the_queue() -> None:
    async def main() -> None:
        srv = await TinyHttp().start()
        checker = HealthChecker()  # no callback: transitions go to the queue
        assert checker.transitions is not None
        checker.add("web", "127.0.0.1", ProbeConfig(
            kind="http", port=srv.port, path="/ping", interval_s=0.2, rise=1, fall=2,
            initial="down", damping=NO_DAMPING))
        async with asyncio.timeout(WAIT):
            first = await checker.transitions.get()
        assert first.up and first.reason == "1 consecutive successes"
        srv.answer = b"HTTP/1.1 503 Service Unavailable\r\n\r\n"
        async with asyncio.timeout(WAIT):
            second = await checker.transitions.get()
        assert not second.up and second.reason == "2 consecutive failures (last: http 503)"
        assert all(r.startswith(b"GET /ping HTTP/1.1\r\n") for r in srv.requests)
        checker.close()
        await srv.stop()

    asyncio.run(main())


@root_only
def test_checker_icmp_rtts_and_runtime_add_remove_update() -> None:
    async def main() -> None:
        seen: list[str] = []
        checker = HealthChecker(lambda t: None,
                                on_result=lambda o: seen.append(o.name))
        cfg = ProbeConfig(interval_s=0.1)
        for i in range(20):
            checker.add(f"n{i}", f"127.5.0.{i + 1}", cfg)
        await wait_for(lambda: all(checker.rtt_ms(f"n{i}") is not None for i in range(20)),
                       "an RTT for every backend")
        assert checker.stats()["icmp_replies"] >= 20
        checker.remove("n0")
        with pytest.raises(KeyError):
            checker.rtt_ms("n0")
        seen.clear()
        await wait_for(lambda: seen.count("n1") >= 3, "more probes")
        assert "n0" not in seen
        checker.update("n1", "127.5.1.1", cfg.model_copy(update={"interval_s": 0.2}))
        checker.add("late", "127.5.2.1", cfg)
        seen.clear()
        await wait_for(lambda: seen.count("late") >= 2 and seen.count("n1") >= 2,
                       "the updated and the added backend probed")
        assert checker.status("n1").address == "127.5.1.1"
        with pytest.raises(ValueError, match="already probed"):
            checker.add("late", "127.5.2.1", cfg)
        with pytest.raises(ValueError, match="not an IP address"):
            checker.add("named", "node1.cluster", cfg)
        with pytest.raises(ValueError, match="scoped"):
            checker.add("v6", "fe80::1%lo", cfg)
        checker.close()

    asyncio.run(main())


def test_checker_survives_broken_callbacks() -> None:
    async def main() -> None:
        def boom(*_: object) -> None:
            raise RuntimeError("consumer bug")

        checker = HealthChecker(boom, on_result=boom)
        with closed_port() as dead:
            checker.add("x", "127.0.0.1", ProbeConfig(kind="tcp", port=dead, interval_s=0.1,
                                                     fall=1, damping=NO_DAMPING))
            await wait_for(lambda: checker.status("x").probes >= 3, "probing to go on")
        assert not checker.is_up("x")
        assert checker.stats()["callback_errors"] >= 3
        checker.close()

    asyncio.run(main())


# --- namespaces --------------------------------------------------------------------


@root_only
def test_enter_netns_joins_another_threads_namespace() -> None:
    from hpclb.host.netns import enter_netns

    ready = threading.Event()
    done = threading.Event()
    seen: dict[str, Any] = {}

    def owner() -> None:
        new_netns()
        seen["tid"] = threading.get_native_id()
        seen["owner"] = os.stat("/proc/thread-self/ns/net").st_ino
        ready.set()
        done.wait(WAIT)

    def joiner() -> None:
        try:
            enter_netns(f"/proc/self/task/{seen['tid']}/ns/net")
            seen["joiner"] = os.stat("/proc/thread-self/ns/net").st_ino
        except OSError as exc:
            seen["error"] = exc

    a = threading.Thread(target=owner, daemon=True)
    a.start()
    assert ready.wait(WAIT)
    b = threading.Thread(target=joiner)
    b.start()
    b.join(WAIT)
    done.set()
    a.join(WAIT)
    assert "error" not in seen, seen.get("error")
    assert seen["joiner"] == seen["owner"] != os.stat("/proc/thread-self/ns/net").st_ino
    with pytest.raises(FileNotFoundError):
        enter_netns("hpclb-no-such-namespace")
