"""HTTP and HTTPS GET probes: a minimal HTTP/1.1 request over asyncio streams.

Only the status line is read (bounded), then the connection is dropped: the
status is the verdict, and a body could be arbitrarily large or slow.

HTTPS is the same request over TLS (the stdlib ``ssl`` module, on the event
loop: asyncio runs the handshake). A handshake that fails, a certificate that
does not verify (untrusted, expired, another name) fail the probe, with the
reason saying which (``tls: certificate verify failed: ...``, ``tls handshake
failed: ...``): a backend serving a bad certificate is down for clients too.
Names are never resolved: the backend is reached by address, and ``server_name``
(SNI and the name checked against the certificate) is only a name.
"""

from __future__ import annotations

import asyncio
import re
import ssl
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


def host_header(address: str, port: int, default_port: int = 80) -> str:
    """Host header for a backend reached by address (RFC 9110: brackets for IPv6,
    the port when it is not the scheme's default, 80 or 443)."""
    host = f"[{address}]" if ":" in address else address
    return host if port == default_port else f"{host}:{port}"


def default_server_name(address: str, host: str | None) -> str:
    """The TLS server name when none is configured: the Host header's name
    (without its port or IPv6 brackets) if one is configured, else the backend's
    address (then checked against the certificate's IP addresses)."""
    if host is None:
        return address
    if host.startswith("["):
        return host[1:].partition("]")[0] or address
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() and name else host


def tls_context(verify: bool = True, ca_file: str | None = None) -> ssl.SSLContext:
    """The client context for HTTPS probes. ``verify``: the chain must lead to
    ``ca_file`` (PEM; the system's trust store when None) and name the server;
    else anything is accepted (encrypted, not authenticated). ValueError when the
    CA file cannot be read or holds no certificate."""
    if not verify:
        if ca_file is not None:
            raise ValueError("a CA file with verification off would be ignored")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False  # before verify_mode: the order ssl insists on
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as err:  # FileNotFoundError, "no certificate"...
        raise ValueError(f"https probe ca_file {ca_file}: "
                         f"{getattr(err, 'strerror', None) or err}") from None


def _tls_reason(err: ssl.SSLError) -> str:
    if isinstance(err, ssl.SSLCertVerificationError):
        return f"tls: certificate verify failed: {err.verify_message or err.reason}"
    return f"tls handshake failed: {err.reason or err.strerror or type(err).__name__}"


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
                   accepts: Callable[[int], bool] = default_statuses,
                   tls: ssl.SSLContext | None = None,
                   server_name: str | None = None) -> ProbeResult:
    """GET ``path`` from ``address:port`` (an IP literal, IPv4 or IPv6); ok when the
    status is accepted. With ``tls`` (see tls_context), over TLS: ``server_name``
    is sent as SNI and checked against the certificate (default: the address).
    RTT = connect to status line, the handshake included. Never raises for what
    the server does."""
    socket_family(address)  # names are refused here too, not resolved
    check_timeout(timeout)
    request = build_request(path, host or host_header(address, port,
                                                      80 if tls is None else 443))
    name = server_name or address
    start_ns = time.monotonic_ns()
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                address, port, limit=MAX_STATUS_LINE, ssl=tls,
                server_hostname=name if tls is not None else None)
            writer.write(request)
            await writer.drain()
            line = await reader.readline()
    except TimeoutError:
        return TIMEOUT
    except ConnectionRefusedError:
        return ProbeResult.failure("refused")
    except ssl.SSLError as exc:  # before ValueError: a verify error is both
        return ProbeResult.failure(_tls_reason(exc))
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
