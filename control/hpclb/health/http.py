"""HTTP GET probe: a minimal HTTP/1.1 request over asyncio streams.

Only the status line is read (bounded), then the connection is dropped: the
status is the verdict, and a body could be arbitrarily large or slow.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable

from .deadlines import check_timeout
from .result import TIMEOUT, ProbeResult, local_cause
from .tcp import socket_family

#: Longest status line accepted ("HTTP/1.1 200 OK\r\n" plus a generous reason).
MAX_STATUS_LINE = 1024
_STATUS = re.compile(rb"^HTTP/\d\.\d (\d{3})(?:[ \r\n]|$)")
_SAFE = re.compile(r"^[\x21-\x7e]+$")  # visible ASCII: nothing that ends a header line


def default_statuses(status: int) -> bool:
    return 200 <= status <= 399


def host_header(address: str, port: int) -> str:
    """Host header for a backend reached by address (RFC 9110: brackets for IPv6,
    the port when it is not the scheme's default)."""
    host = f"[{address}]" if ":" in address else address
    return host if port == 80 else f"{host}:{port}"


def build_request(path: str, host: str) -> bytes:
    """The GET request; ValueError if path or host could inject header lines."""
    if not path.startswith("/") or not _SAFE.match(path):
        raise ValueError(f"HTTP probe path {path!r} must be '/...' in visible ASCII")
    if not _SAFE.match(host):
        raise ValueError(f"HTTP probe host {host!r} must be visible ASCII")
    return (f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: hpclb-probe\r\n"
            "Accept: */*\r\nConnection: close\r\n\r\n").encode("ascii")


def parse_status(line: bytes) -> int | None:
    m = _STATUS.match(line)
    return int(m.group(1)) if m else None


async def http_get(address: str, port: int, timeout: float, *, path: str = "/",
                   host: str | None = None,
                   accepts: Callable[[int], bool] = default_statuses) -> ProbeResult:
    """GET ``path`` from ``address:port`` (an IP literal); ok when the status is
    accepted. RTT = connect to status line. Never raises for what the server does."""
    socket_family(address)  # names are refused here too, not resolved
    check_timeout(timeout)
    request = build_request(path, host or host_header(address, port))
    start_ns = time.monotonic_ns()
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(address, port,
                                                           limit=MAX_STATUS_LINE)
            writer.write(request)
            await writer.drain()
            line = await reader.readline()
    except TimeoutError:
        return TIMEOUT
    except ConnectionRefusedError:
        return ProbeResult.failure("refused")
    except ValueError:  # StreamReader: line longer than the limit
        return ProbeResult.failure("http status line too long")
    except OSError as exc:
        # asyncio creates the socket inside open_connection: EMFILE and friends
        # come out here too, and are ours, not the server's.
        if (cause := local_cause(exc.errno)) is not None:
            return ProbeResult.local_error(f"http: {exc.strerror or exc}", cause)
        return ProbeResult.failure(exc.strerror or type(exc).__name__)
    finally:
        if writer is not None:
            # Abort, not close: no need to flush or wait for the peer's FIN.
            writer.transport.abort()
    rtt_ns = time.monotonic_ns() - start_ns
    if not line:
        return ProbeResult.failure("http: connection closed before a status line")
    status = parse_status(line)
    if status is None:
        return ProbeResult.failure("http: malformed status line")
    if not accepts(status):
        return ProbeResult.failure(f"http {status}")
    return ProbeResult.success(rtt_ns)
