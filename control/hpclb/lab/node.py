"""Programs that run inside the lab's network namespaces.

``server``  a backend: answers every TCP connection with its name (one line on accept,
            then one line per line received, so a long-lived connection keeps
            reporting which backend holds it) and, with ``--udp``, every UDP datagram
            on the same port with its name.
``client``  opens N short TCP connections (or sends N UDP datagrams, each from a new
            socket) to a VIP, reads the name, closes, and prints counts per backend.
``stream``  one long-lived TCP connection sending a line every X ms for T seconds,
            recording which backend answered each line.
``streams`` N long-lived TCP connections in one process (one asyncio loop: N
            processes would swamp a small host), each as ``stream`` does, with a
            report per stream (its source port, the backends that answered it,
            how many lines were answered, its first error, its last answer).

Everything is asyncio with a timeout on every await and an overall deadline: a lab test
must fail with a JSON report, never hang. The client programs print exactly one JSON
object on stdout; the server prints ``ready`` once it listens (the lab waits for it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import selectors
import signal
import socket
import struct
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

Num = TypeVar("Num", int, float)

READY_LINE = "ready"
MAX_LINE = 4096  # a backend answers lines, not payloads: bound what it buffers
MAX_CONNECTIONS = 1_000_000
MAX_CONCURRENCY = 10_000
MAX_STREAMS = 5000  # ``streams``: connections of one process (file descriptors)
UDP_PORT_RETRIES = 20


# --------------------------------------------------------------------------- server


IP_PKTINFO = 8  # Linux <netinet/in.h>; the socket module does not export it
_PKTINFO = struct.Struct("=I4s4s")  # struct in_pktinfo: ifindex, spec_dst, addr
_PKTINFO6 = struct.Struct("=16sI")  # struct in6_pktinfo: addr, ifindex


def family_of(address: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 address text, AF_INET otherwise."""
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def any_address(address: str) -> str:
    """The wildcard of ``address``'s family (a client's local bind)."""
    return "::" if ":" in address else "0.0.0.0"


UDP_BUFFER_BYTES = 4 << 20


def deep_buffers(sock: socket.socket) -> None:
    """Socket buffers deep enough to ride out the scheduling stalls of a busy 2-core host.

    The lab's hosts share the CPUs with the appliance and whatever a fault test
    floods it with; a default 208 KiB receive buffer holds ~90 small datagrams,
    which a 100 ms stall of the server overflows. Such a loss would be the
    simulated host's, not the balancer's. As root (the lab) the FORCE options pass
    net.core.rmem_max; otherwise the request is capped at it.
    """
    for force, plain in ((getattr(socket, "SO_RCVBUFFORCE", 33), socket.SO_RCVBUF),
                         (getattr(socket, "SO_SNDBUFFORCE", 32), socket.SO_SNDBUF)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, UDP_BUFFER_BYTES)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, plain, UDP_BUFFER_BYTES)


class UdpNameServer:
    """Answers every datagram with the backend's name, *from the address it was sent to*.

    A socket bound to 0.0.0.0 would answer from the route's source address, the
    backend's own 198.18.0.x; in DSR the client sent to the VIP and drops anything else.
    IP_PKTINFO gives the destination of each datagram and sets the source of the answer;
    an IPv6 server (``bind`` "::", IPv6 only) does the same with IPV6_PKTINFO.
    """

    def __init__(self, name: bytes, bind: str, port: int) -> None:
        self.name = name
        self.v6 = family_of(bind) == socket.AF_INET6
        self.sock = socket.socket(family_of(bind), socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deep_buffers(self.sock)
        if self.v6:
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)
        else:
            self.sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        self.sock.setblocking(False)
        self.sock.bind((bind, port))

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self.sock.fileno(), self._on_readable)

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self.sock.fileno())
        self.sock.close()

    def _on_readable(self) -> None:
        for _ in range(64):  # bounded batch: other connections get their turn
            try:
                _, ancdata, _, addr = self.sock.recvmsg(MAX_LINE, socket.CMSG_SPACE(20))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue  # e.g. an ICMP error queued on the socket
            self._answer(ancdata, addr)

    def _answer(self, ancdata: list[tuple[int, int, bytes]], addr: tuple[str, int]) -> None:
        cmsgs = []
        for level, kind, data in ancdata:
            if level == socket.IPPROTO_IP and kind == IP_PKTINFO and len(data) >= 12:
                _, _, dst = _PKTINFO.unpack_from(data)
                cmsgs = [(socket.IPPROTO_IP, IP_PKTINFO, _PKTINFO.pack(0, dst, bytes(4)))]
            elif (level == socket.IPPROTO_IPV6 and kind == socket.IPV6_PKTINFO
                  and len(data) >= _PKTINFO6.size):
                dst6, _ = _PKTINFO6.unpack_from(data)
                cmsgs = [(socket.IPPROTO_IPV6, socket.IPV6_PKTINFO, _PKTINFO6.pack(dst6, 0))]
        with contextlib.suppress(OSError):  # a full socket buffer drops, as UDP does
            self.sock.sendmsg([self.name], cmsgs, 0, addr)


def _tcp_handler(name: bytes, idle_timeout: float) -> Callable[
    [asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]
]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(name)
            await writer.drain()
            # Keep answering: a "stream" client uses this to see that its flow stays on
            # the same backend while the control plane changes weights.
            while True:
                line = await asyncio.wait_for(reader.readline(), idle_timeout)
                if not line:
                    break
                writer.write(name)
                await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass  # a client that goes away or misbehaves only loses its connection
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    return handle


async def serve(name: str, port: int, udp: bool, bind: str, idle_timeout: float,
                bind6: str | None = None) -> None:
    """Answer on ``bind`` (IPv4) and, with ``bind6``, on that IPv6 address too."""
    reply = (name + "\n").encode()
    # reuse_address: a restarted backend must rebind at once despite TIME_WAIT.
    binds = [bind, *([bind6] if bind6 else [])]
    servers = [await asyncio.start_server(
        _tcp_handler(reply, idle_timeout), b, port, reuse_address=True, limit=MAX_LINE,
        backlog=1024, family=family_of(b),
    ) for b in binds]
    loop = asyncio.get_running_loop()
    udp_servers = [UdpNameServer(reply, b, port) for b in binds] if udp else []
    for udp_server in udp_servers:
        udp_server.start(loop)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(READY_LINE, flush=True)
    try:
        await stop.wait()
    finally:
        for server in servers:
            server.close()
        for udp_server in udp_servers:
            udp_server.close(loop)


# --------------------------------------------------------------------------- client


@dataclass
class ClientResult:
    """What the client prints: counts per backend name and what went wrong."""

    connections: int
    counts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    source_ports: set[int] = field(default_factory=set)
    placements: dict[int, str] = field(default_factory=dict)  # source port -> backend
    elapsed_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        failures = sum(self.errors.values())
        return {
            "connections": self.connections,
            "ok": sum(self.counts.values()),
            "failures": failures,
            "counts": dict(sorted(self.counts.items())),
            "errors": dict(sorted(self.errors.items())),
            "distinct_source_ports": len(self.source_ports),
            "placements": {str(p): n for p, n in sorted(self.placements.items())},
            "elapsed_s": round(self.elapsed_s, 3),
        }


def _error_name(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"oserror_{exc.errno}"
    return type(exc).__name__


async def _one_tcp(vip: str, port: int, timeout: float, used: set[int],
                   sport: int | None = None) -> tuple[str, int]:
    """One short connection: connect, read the name, close. Returns (name, source port).

    ``used`` is not consulted: the client closes first, so TIME_WAIT keeps every port
    it used out of the kernel's choice for this run (fresh port each connection).
    ``sport`` binds an explicit source port instead (a reproducible set of flows).
    """
    local = (any_address(vip), sport) if sport is not None else None
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(vip, port, local_addr=local), timeout)
    try:
        sport = writer.get_extra_info("sockname")[1]
        line = await asyncio.wait_for(reader.readline(), timeout)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await asyncio.wait_for(writer.wait_closed(), timeout)
    name = line.decode(errors="replace").strip()
    if not name:
        raise ConnectionResetError("closed without a name")
    return name, sport


class _UdpOnce(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if not self.answer.done():
            self.answer.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.answer.done():
            self.answer.set_exception(exc)


async def _fresh_udp_endpoint(
    vip: str, port: int, used: set[int],
) -> tuple[asyncio.DatagramTransport, _UdpOnce, int]:
    """A connected UDP socket whose source port this run has not used yet.

    Unlike TCP (TIME_WAIT holds a closed connection's port), a closed UDP socket's port
    is free at once and the kernel may hand it out again: that would be the same flow,
    not a new one. Retry a bounded number of times; past ~28k datagrams ports repeat.
    """
    loop = asyncio.get_running_loop()
    for _ in range(UDP_PORT_RETRIES):
        transport, proto = await loop.create_datagram_endpoint(
            _UdpOnce, remote_addr=(vip, port), family=family_of(vip),
        )
        sport = transport.get_extra_info("sockname")[1]
        if sport not in used:
            break
        transport.close()
    used.add(sport)
    return transport, proto, sport


async def _one_udp(vip: str, port: int, timeout: float, used: set[int]) -> tuple[str, int]:
    """One datagram from a fresh socket and source port (a fresh flow)."""
    transport, proto, sport = await _fresh_udp_endpoint(vip, port, used)
    try:
        transport.sendto(b"who\n")
        data = await asyncio.wait_for(proto.answer, timeout)
    finally:
        transport.close()
    return data.decode(errors="replace").strip(), sport


async def run_client(
    vip: str, port: int, connections: int, concurrency: int, timeout: float,
    deadline: float, udp: bool, sport_first: int | None = None,
) -> ClientResult:
    result = ClientResult(connections=connections)
    one = _one_udp if udp else _one_tcp
    sem = asyncio.Semaphore(concurrency)
    used: set[int] = set()
    start = time.monotonic()

    async def attempt(i: int) -> None:
        async with sem:
            try:
                if sport_first is not None and not udp:
                    name, sport = await _one_tcp(vip, port, timeout, used, sport_first + i)
                else:
                    name, sport = await one(vip, port, timeout, used)
            except Exception as exc:  # every failure is a counted outcome, not a crash
                result.errors[_error_name(exc)] += 1
                return
            result.counts[name] += 1
            result.source_ports.add(sport)
            result.placements[sport] = name

    tasks = [asyncio.create_task(attempt(i)) for i in range(connections)]
    _, pending = await asyncio.wait(tasks, timeout=deadline)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    # Attempts cut off by the overall deadline are failures too, so counts always add up.
    missing = connections - sum(result.counts.values()) - sum(result.errors.values())
    if missing:
        result.errors["deadline"] = missing
    result.elapsed_s = time.monotonic() - start
    return result


# --------------------------------------------------------------------------- stream


@dataclass
class StreamResult:
    """Which backend answered each line of one long-lived connection."""

    greeting: str = ""
    names: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "greeting": self.greeting,
            "names": self.names,
            "distinct": sorted(set(self.names)),
            "errors": self.errors,
            "elapsed_s": round(self.elapsed_s, 3),
        }


async def _converse(vip: str, port: int, interval: float, end: float, timeout: float,
                    on_greeting: Callable[[bytes, int], None],
                    on_answer: Callable[[str], None],
                    local: tuple[str, int] | None = None) -> None:
    """One connection (from ``local`` when given): the backend's greeting to
    ``on_greeting`` (with the local port), then a line per ``interval`` until
    ``end`` (monotonic), each answer to ``on_answer``; every step has its own
    timeout, and the first error ends it (a broken flow): ``stream`` and each
    connection of ``streams``."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(vip, port, local_addr=local), timeout)
    try:
        greeting = await asyncio.wait_for(reader.readline(), timeout)
        on_greeting(greeting, int(writer.get_extra_info("sockname")[1]))
        seq = 0
        while time.monotonic() < end:
            writer.write(f"line {seq}\n".encode())
            await asyncio.wait_for(writer.drain(), timeout)
            line = await asyncio.wait_for(reader.readline(), timeout)
            if not line:
                raise ConnectionResetError("closed by peer")
            on_answer(line.decode(errors="replace").strip())
            seq += 1
            await asyncio.sleep(min(interval, max(0.0, end - time.monotonic())))
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), timeout)


async def run_stream(
    vip: str, port: int, interval: float, duration: float, timeout: float,
) -> StreamResult:
    out = StreamResult()
    start = time.monotonic()
    # Every step has its own timeout; the outer bound is a safety net so that the
    # program always ends with a report, keeping whatever lines it recorded.
    limit = duration + 4 * timeout + 5

    def greeted(greeting: bytes, _port: int) -> None:
        out.greeting = greeting.decode().strip()

    try:
        await asyncio.wait_for(_converse(vip, port, interval, start + duration, timeout,
                                         greeted, out.names.append), limit)
    except Exception as exc:  # reported in the JSON: the test decides what it means
        out.errors.append(f"{_error_name(exc)}: {exc}" if str(exc) else _error_name(exc))
    out.elapsed_s = time.monotonic() - start
    return out


# --------------------------------------------------------------------------- streams


@dataclass
class StreamsEntry:
    """One connection of ``streams``: what its report line says."""

    index: int
    port: int = 0
    backends: list[str] = field(default_factory=list)  # in the order first seen
    answered: int = 0
    error: str | None = None
    opened: float | None = None  # epoch seconds: the greeting read
    last_answer: float | None = None  # epoch seconds

    def saw(self, name: str) -> None:
        if name not in self.backends:
            self.backends.append(name)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "port": self.port, "backends": self.backends,
                "answered": self.answered, "error": self.error, "opened": self.opened,
                "last_answer": self.last_answer}


async def _streams_one(entry: StreamsEntry, vip: str, port: int, interval: float,
                       end: float, timeout: float, sport: int | None,
                       opened: asyncio.Event | None) -> None:
    """One connection of ``streams``: a greeting is required (it names the
    first backend), then a line per interval until ``end`` (monotonic)."""

    def greeted(greeting: bytes, local_port: int) -> None:
        entry.port = local_port
        if not greeting:
            raise ConnectionResetError("closed without a name")
        entry.saw(greeting.decode(errors="replace").strip())
        entry.opened = time.time()
        if opened is not None:
            opened.set()

    def answered(name: str) -> None:
        entry.saw(name)
        entry.answered += 1
        entry.last_answer = time.time()

    local = (any_address(vip), sport) if sport is not None else None
    await _converse(vip, port, interval, end, timeout, greeted, answered, local)


async def run_streams(vip: str, port: int, count: int, interval: float, duration: float,
                      timeout: float, open_over: float, sport_first: int | None = None,
                      ready_file: str | None = None) -> dict[str, Any]:
    """``count`` long-lived connections, opened evenly over ``open_over`` seconds,
    each sending a line every ``interval`` until ``duration`` after the start.
    ``ready_file``: written (JSON: opened, failed) once every connection was
    opened or failed, so that a test injects its fault on established flows."""
    start = time.monotonic()
    end = start + duration
    entries = [StreamsEntry(i) for i in range(count)]
    events = [asyncio.Event() for _ in range(count)]

    async def one(entry: StreamsEntry, event: asyncio.Event) -> None:
        await asyncio.sleep(open_over * entry.index / count)
        sport = sport_first + entry.index if sport_first is not None else None
        limit = max(0.0, end - time.monotonic()) + 4 * timeout + 5
        try:
            await asyncio.wait_for(_streams_one(entry, vip, port, interval, end, timeout,
                                                sport, event), limit)
        except Exception as exc:  # reported per stream: the test decides what it means
            entry.error = f"{_error_name(exc)}: {exc}" if str(exc) else _error_name(exc)
        finally:
            event.set()  # opened or failed: either way no longer pending

    async def announce_ready() -> None:
        await asyncio.gather(*(e.wait() for e in events))
        if ready_file is not None:
            opened = sum(1 for e in entries if e.opened is not None)
            with open(ready_file, "w") as f:
                json.dump({"opened": opened, "failed": count - opened, "time": time.time()}, f)

    ready = asyncio.create_task(announce_ready())
    await asyncio.gather(*(one(e, ev) for e, ev in zip(entries, events, strict=True)))
    await ready
    broken = [e for e in entries if e.error is not None]
    return {"count": count, "opened": sum(1 for e in entries if e.opened is not None),
            "broken": len(broken), "changed_backend": sum(1 for e in entries
                                                          if len(e.backends) > 1),
            "elapsed_s": round(time.monotonic() - start, 3),
            "streams": [e.to_json() for e in entries]}


# --------------------------------------------------------------------------- CLI


def _positive(kind: Callable[[str], Num], upper: float) -> Callable[[str], Num]:
    def parse(text: str) -> Num:
        value = kind(text)
        if not 0 < value <= upper:
            raise argparse.ArgumentTypeError(f"must be in (0, {upper}]")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpclb.lab.node", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("server", help="backend: answer with the backend's name")
    s.add_argument("--name", required=True)
    s.add_argument("--port", type=_positive(int, 65535), default=8080)
    s.add_argument("--bind", default="0.0.0.0", help="0.0.0.0 answers on the VIP too")
    s.add_argument("--bind6", default=None,
                   help="also answer on this IPv6 address (\"::\": every one, the VIPs too)")
    s.add_argument("--udp", action="store_true", help="also answer UDP on the same port")
    s.add_argument("--idle-timeout", type=_positive(float, 86400), default=600.0)

    c = sub.add_parser("client", help="N short connections, counts per backend")
    c.add_argument("--vip", required=True)
    c.add_argument("--port", type=_positive(int, 65535), default=8080)
    c.add_argument("--connections", type=_positive(int, MAX_CONNECTIONS), default=1000)
    c.add_argument("--concurrency", type=_positive(int, MAX_CONCURRENCY), default=50)
    c.add_argument("--udp", action="store_true", help="datagrams instead of connections")
    c.add_argument("--timeout", type=_positive(float, 600), default=2.0,
                   help="per connection step (connect, read)")
    c.add_argument("--deadline", type=_positive(float, 3600), default=120.0,
                   help="overall limit; unfinished attempts count as failures")
    c.add_argument("--sport-first", type=_positive(int, 65535), default=None,
                   help="TCP: connection i binds source port SPORT_FIRST+i (reproducible flows)")
    c.add_argument("--json", action="store_true", help="JSON on one line (default: indented)")

    u = sub.add_parser("udpflows", help="one datagram from each of a range of source ports")
    u.add_argument("--vip", required=True)
    u.add_argument("--port", type=_positive(int, 65535), default=8080)
    u.add_argument("--sports", required=True, help="FIRST-LAST source ports (at most 5000)")
    u.add_argument("--timeout", type=_positive(float, 60), default=1.0)
    u.add_argument("--json", action="store_true")

    us = sub.add_parser("udpstream", help="a steady UDP stream over fixed flows, every "
                        "datagram counted: sent, answered, and by which backend")
    us.add_argument("--vip", required=True)
    us.add_argument("--port", type=_positive(int, 65535), default=8080)
    us.add_argument("--sports", required=True, help="FIRST-LAST source ports (at most 1000)")
    us.add_argument("--pps", type=_positive(float, 100_000), default=2000.0)
    us.add_argument("--duration", type=_positive(float, 3600), default=5.0)
    us.add_argument("--linger", type=_positive(float, 60), default=1.0,
                    help="how long to wait for the last answers")
    us.add_argument("--json", action="store_true")

    st = sub.add_parser("stream", help="one long-lived connection, one line per interval")
    st.add_argument("--vip", required=True)
    st.add_argument("--port", type=_positive(int, 65535), default=8080)
    st.add_argument("--interval-ms", type=_positive(float, 60_000), default=100.0)
    st.add_argument("--duration", type=_positive(float, 3600), default=5.0)
    st.add_argument("--timeout", type=_positive(float, 600), default=2.0)
    st.add_argument("--json", action="store_true")

    ms = sub.add_parser("streams", help="N long-lived connections in one process, a "
                        "report per connection")
    ms.add_argument("--vip", required=True)
    ms.add_argument("--port", type=_positive(int, 65535), default=8080)
    ms.add_argument("--count", type=_positive(int, MAX_STREAMS), default=200)
    ms.add_argument("--interval-ms", type=_positive(float, 60_000), default=1000.0)
    ms.add_argument("--duration", type=_positive(float, 3600), default=10.0)
    ms.add_argument("--timeout", type=_positive(float, 600), default=10.0,
                    help="per step (connect, each answer): what a stream rides out")
    ms.add_argument("--open-over", type=float, default=1.0,
                    help="seconds over which the connections are opened, evenly")
    ms.add_argument("--sport-first", type=_positive(int, 65535), default=None,
                    help="connection i binds source port SPORT_FIRST+i")
    ms.add_argument("--ready-file", default=None,
                    help="written once every connection was opened or failed")
    ms.add_argument("--json", action="store_true")
    return p


# --------------------------------------------------------------------------- udp flows


def run_udp_flows(vip: str, port: int, sports: range, timeout: float) -> dict[str, Any]:
    """One datagram from each given source port: the same flows every run.

    Re-running with the same ports re-sends the same 5-tuples, which is how the
    lab watches which flows move when a backend goes down and which do not.
    """
    flows: dict[str, str] = {}
    errors: Counter[str] = Counter()
    for sport in sports:
        with socket.socket(family_of(vip), socket.SOCK_DGRAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.settimeout(timeout)
            try:
                sock.bind((any_address(vip), sport))
                sock.connect((vip, port))
                sock.send(b"who\n")
                flows[str(sport)] = sock.recv(256).decode(errors="replace").strip()
            except OSError as exc:
                errors[_error_name(exc)] += 1
    return {"flows": flows, "errors": dict(errors)}


def run_udp_stream(vip: str, port: int, sports: range, pps: float, duration: float,
                   linger: float) -> dict[str, Any]:
    """Datagrams at ``pps`` over the flows of ``sports`` (round robin) for
    ``duration``; each backend answers with its name (DSR, straight back).

    Reports how many were sent and answered, and per flow every backend that
    answered it: a flow with two names was moved, a missing answer was lost.
    """
    socks: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    for sport in sports:
        sock = socket.socket(family_of(vip), socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deep_buffers(sock)
        sock.bind((any_address(vip), sport))
        sock.connect((vip, port))
        sock.setblocking(False)
        socks[sport] = sock
        sel.register(sock, selectors.EVENT_READ, sport)
    names: dict[int, Counter[str]] = {sport: Counter() for sport in sports}
    sent = answered = 0
    errors: Counter[str] = Counter()

    def receive(wait: float) -> None:
        nonlocal answered
        for key, _ in sel.select(wait):
            for _ in range(64):
                try:
                    data = key.fileobj.recv(256)  # type: ignore[union-attr]
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    errors[_error_name(exc)] += 1
                    break
                names[key.data][data.decode(errors="replace").strip()] += 1
                answered += 1

    start = time.monotonic()
    order = list(sports)
    try:
        while (now := time.monotonic()) - start < duration:
            due = int((now - start) * pps) + 1
            while sent < due:
                try:
                    socks[order[sent % len(order)]].send(b"who\n")
                except OSError as exc:
                    errors[_error_name(exc)] += 1
                sent += 1
            receive(min(0.001, 1 / pps))
        end = time.monotonic() + linger
        while answered < sent and (left := end - time.monotonic()) > 0:
            receive(left)
    finally:
        for sock in socks.values():
            sock.close()
    return {"sent": sent, "answered": answered, "errors": dict(errors),
            "flows": {str(p): dict(c) for p, c in names.items()}}


def _print(obj: dict[str, Any], compact: bool) -> None:
    print(json.dumps(obj) if compact else json.dumps(obj, indent=2), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "server":
        asyncio.run(serve(args.name, args.port, args.udp, args.bind, args.idle_timeout,
                          args.bind6))
        return 0
    if args.cmd == "client":
        if args.sport_first is not None and args.sport_first + args.connections > 65536:
            raise SystemExit("--sport-first + --connections runs past port 65535")
        res = asyncio.run(run_client(args.vip, args.port, args.connections, args.concurrency,
                                     args.timeout, args.deadline, args.udp, args.sport_first))
        _print(res.to_json(), args.json)
        return 0 if res.to_json()["failures"] == 0 else 1
    if args.cmd == "udpflows":
        first, _, last = args.sports.partition("-")
        sports = range(int(first), int(last or first) + 1)
        if not 0 < len(sports) <= 5000 or sports.stop > 65536:
            raise SystemExit("--sports: FIRST-LAST within 1..65535, at most 5000 ports")
        report = run_udp_flows(args.vip, args.port, sports, args.timeout)
        _print(report, args.json)
        return 0
    if args.cmd == "udpstream":
        first, _, last = args.sports.partition("-")
        sports = range(int(first), int(last or first) + 1)
        if not 0 < len(sports) <= 1000 or sports.stop > 65536:
            raise SystemExit("--sports: FIRST-LAST within 1..65535, at most 1000 ports")
        _print(run_udp_stream(args.vip, args.port, sports, args.pps, args.duration,
                              args.linger), args.json)
        return 0
    if args.cmd == "streams":
        if not 0 <= args.open_over <= args.duration:
            raise SystemExit("--open-over must be within 0..--duration")
        if args.sport_first is not None and args.sport_first + args.count > 65536:
            raise SystemExit("--sport-first + --count runs past port 65535")
        report = asyncio.run(run_streams(args.vip, args.port, args.count,
                                         args.interval_ms / 1000, args.duration, args.timeout,
                                         args.open_over, args.sport_first, args.ready_file))
        _print(report, args.json)
        return 0 if report["broken"] == 0 else 1
    out = asyncio.run(run_stream(args.vip, args.port, args.interval_ms / 1000, args.duration,
                                 args.timeout))
    _print(out.to_json(), args.json)
    return 0 if not out.errors else 1


if __name__ == "__main__":
    sys.exit(main())
