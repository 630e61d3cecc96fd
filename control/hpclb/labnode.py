"""Programs that run inside the lab's network namespaces.

``server``  a backend: answers every TCP connection with its name (one line on accept,
            then one line per line received, so a long-lived connection keeps
            reporting which backend holds it) and, with ``--udp``, every UDP datagram
            on the same port with its name.
``client``  opens N short TCP connections (or sends N UDP datagrams, each from a new
            socket) to a VIP, reads the name, closes, and prints counts per backend.
``stream``  one long-lived TCP connection sending a line every X ms for T seconds,
            recording which backend answered each line.

Everything is asyncio with a timeout on every await and an overall deadline: a lab test
must fail with a JSON report, never hang. The client programs print exactly one JSON
object on stdout; the server prints ``ready`` once it listens (the lab waits for it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
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


# --------------------------------------------------------------------------- server


class _UdpEcho(asyncio.DatagramProtocol):
    """Answers every datagram with the backend's name."""

    def __init__(self, name: bytes) -> None:
        self.name = name
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.DatagramTransport)
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.transport is not None:
            self.transport.sendto(self.name, addr)


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


async def serve(name: str, port: int, udp: bool, bind: str, idle_timeout: float) -> None:
    reply = (name + "\n").encode()
    # reuse_address: a restarted backend must rebind at once despite TIME_WAIT.
    server = await asyncio.start_server(
        _tcp_handler(reply, idle_timeout), bind, port, reuse_address=True, limit=MAX_LINE,
        backlog=1024,
    )
    transport = None
    if udp:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _UdpEcho(reply), local_addr=(bind, port), reuse_port=False,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(READY_LINE, flush=True)
    try:
        await stop.wait()
    finally:
        server.close()
        if transport is not None:
            transport.close()


# --------------------------------------------------------------------------- client


@dataclass
class ClientResult:
    """What the client prints: counts per backend name and what went wrong."""

    connections: int
    counts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    source_ports: set[int] = field(default_factory=set)
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


async def _one_tcp(vip: str, port: int, timeout: float) -> tuple[str, int]:
    """One short connection: connect, read the name, close. Returns (name, source port)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(vip, port), timeout)
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


async def _one_udp(vip: str, port: int, timeout: float) -> tuple[str, int]:
    """One datagram from a fresh socket (so a fresh source port, a fresh flow)."""
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(
        _UdpOnce, remote_addr=(vip, port), family=socket.AF_INET,
    )
    try:
        sport = transport.get_extra_info("sockname")[1]
        transport.sendto(b"who\n")
        data = await asyncio.wait_for(proto.answer, timeout)
    finally:
        transport.close()
    return data.decode(errors="replace").strip(), sport


async def run_client(
    vip: str, port: int, connections: int, concurrency: int, timeout: float,
    deadline: float, udp: bool,
) -> ClientResult:
    result = ClientResult(connections=connections)
    one = _one_udp if udp else _one_tcp
    sem = asyncio.Semaphore(concurrency)
    start = time.monotonic()

    async def attempt() -> None:
        async with sem:
            try:
                name, sport = await one(vip, port, timeout)
            except Exception as exc:  # every failure is a counted outcome, not a crash
                result.errors[_error_name(exc)] += 1
                return
            result.counts[name] += 1
            result.source_ports.add(sport)

    tasks = [asyncio.create_task(attempt()) for _ in range(connections)]
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


async def _stream_lines(
    out: StreamResult, vip: str, port: int, interval: float, duration: float, timeout: float,
) -> None:
    """One connection, one line per interval; stops at the first error (a broken flow)."""
    start = time.monotonic()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(vip, port), timeout)
    try:
        out.greeting = (await asyncio.wait_for(reader.readline(), timeout)).decode().strip()
        seq = 0
        while time.monotonic() - start < duration:
            writer.write(f"line {seq}\n".encode())
            await asyncio.wait_for(writer.drain(), timeout)
            line = await asyncio.wait_for(reader.readline(), timeout)
            if not line:
                raise ConnectionResetError("closed by peer")
            out.names.append(line.decode(errors="replace").strip())
            seq += 1
            await asyncio.sleep(interval)
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
    try:
        await asyncio.wait_for(_stream_lines(out, vip, port, interval, duration, timeout), limit)
    except Exception as exc:  # reported in the JSON: the test decides what it means
        out.errors.append(f"{_error_name(exc)}: {exc}" if str(exc) else _error_name(exc))
    out.elapsed_s = time.monotonic() - start
    return out


# --------------------------------------------------------------------------- CLI


def _positive(kind: Callable[[str], Num], upper: float) -> Callable[[str], Num]:
    def parse(text: str) -> Num:
        value = kind(text)
        if not 0 < value <= upper:
            raise argparse.ArgumentTypeError(f"must be in (0, {upper}]")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpclb.labnode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("server", help="backend: answer with the backend's name")
    s.add_argument("--name", required=True)
    s.add_argument("--port", type=_positive(int, 65535), default=8080)
    s.add_argument("--bind", default="0.0.0.0", help="0.0.0.0 answers on the VIP too")
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
    c.add_argument("--json", action="store_true", help="JSON on one line (default: indented)")

    st = sub.add_parser("stream", help="one long-lived connection, one line per interval")
    st.add_argument("--vip", required=True)
    st.add_argument("--port", type=_positive(int, 65535), default=8080)
    st.add_argument("--interval-ms", type=_positive(float, 60_000), default=100.0)
    st.add_argument("--duration", type=_positive(float, 3600), default=5.0)
    st.add_argument("--timeout", type=_positive(float, 600), default=2.0)
    st.add_argument("--json", action="store_true")
    return p


def _print(obj: dict[str, Any], compact: bool) -> None:
    print(json.dumps(obj) if compact else json.dumps(obj, indent=2), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "server":
        asyncio.run(serve(args.name, args.port, args.udp, args.bind, args.idle_timeout))
        return 0
    if args.cmd == "client":
        res = asyncio.run(run_client(args.vip, args.port, args.connections, args.concurrency,
                                     args.timeout, args.deadline, args.udp))
        _print(res.to_json(), args.json)
        return 0 if res.to_json()["failures"] == 0 else 1
    out = asyncio.run(run_stream(args.vip, args.port, args.interval_ms / 1000, args.duration,
                                 args.timeout))
    _print(out.to_json(), args.json)
    return 0 if not out.errors else 1


if __name__ == "__main__":
    sys.exit(main())
