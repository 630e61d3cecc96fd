"""HTTPS probes against a real local TLS server, on 127.0.0.1 and ::1.

The server's certificate is made for the test (self-signed, names
``backend.test``, 127.0.0.1 and ::1) with the ``cryptography`` package when it is
installed, else with ``openssl req``. Only results and reasons are asserted,
never speed.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpclb.config.probes import ProbeConfig
from hpclb.health import HealthChecker, http_get
from hpclb.health.http import default_server_name, tls_context

WAIT = 10.0
NAME = "backend.test"


@dataclass(frozen=True)
class Cert:
    cert: Path
    key: Path


def _make_cert(directory: Path) -> Cert:
    cert, key = directory / "server.pem", directory / "server.key"
    try:
        _with_cryptography(cert, key)
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("no certificate maker: neither the cryptography package nor "
                        "the openssl command is installed")
        subprocess.run(
            [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
             "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj",
             f"/CN={NAME}", "-addext", f"subjectAltName=DNS:{NAME},IP:127.0.0.1,IP:::1",
             "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True, timeout=60)
    return Cert(cert, key)


def _with_cryptography(cert: Path, key: Path) -> None:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    pkey = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, NAME)])
    now = datetime.datetime.now(datetime.UTC)
    sans = [x509.DNSName(NAME), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1"))]
    built = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
             .public_key(pkey.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(hours=1))
             .not_valid_after(now + datetime.timedelta(days=2))
             .add_extension(x509.SubjectAlternativeName(sans), critical=False)
             .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
             .sign(pkey, hashes.SHA256()))
    cert.write_bytes(built.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(pkey.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> Cert:
    return _make_cert(tmp_path_factory.mktemp("tls"))


class TlsHttp:
    """A one-line-answer HTTPS server on ``host``; ``answer`` is what it says."""

    def __init__(self, cert: Cert, host: str = "127.0.0.1") -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert.cert, cert.key)
        self.host = host
        self.answer = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> TlsHttp:
        self.server = await asyncio.start_server(self._serve, self.host, 0, ssl=self.ctx)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.requests.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(self.answer)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the probe hangs up at once, or a refused handshake
        finally:
            writer.transport.abort()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


@pytest.fixture
def has_ipv6() -> Iterator[None]:
    try:
        import socket
        s = socket.socket(socket.AF_INET6)
        s.bind(("::1", 0))
        s.close()
    except OSError as err:
        pytest.skip(f"no IPv6 loopback here ({err})")
    yield


def test_https_verified_ok_wrong_status_and_the_request(cert: Cert) -> None:
    async def main() -> None:
        srv = await TlsHttp(cert).start()
        ctx = tls_context(True, str(cert.cert))
        ok = await http_get("127.0.0.1", srv.port, WAIT, path="/healthz", tls=ctx,
                            server_name=NAME)
        assert ok.ok and ok.rtt_ms is not None, ok
        req = srv.requests[-1].decode()
        assert req.startswith("GET /healthz HTTP/1.1\r\n")
        assert f"\r\nHost: 127.0.0.1:{srv.port}\r\n" in req
        # Verified against the certificate's IP address when no name is given.
        assert (await http_get("127.0.0.1", srv.port, WAIT, tls=ctx)).ok
        srv.answer = b"HTTP/1.1 503 Service Unavailable\r\n\r\n"
        bad = await http_get("127.0.0.1", srv.port, WAIT, tls=ctx, server_name=NAME)
        assert (bad.ok, bad.local, bad.reason) == (False, False, "http 503")
        only_503 = await http_get("127.0.0.1", srv.port, WAIT, tls=ctx, server_name=NAME,
                                  accepts=lambda s: s == 503)
        assert only_503.ok
        await srv.stop()

    run(main())


def test_https_bad_certificate_fails_with_verify_passes_without(cert: Cert) -> None:
    async def main() -> None:
        srv = await TlsHttp(cert).start()
        # The system's trust store does not know our self-signed certificate.
        untrusted = await http_get("127.0.0.1", srv.port, WAIT, tls=tls_context(),
                                   server_name=NAME)
        assert not untrusted.ok and not untrusted.local
        assert untrusted.reason.startswith("tls: certificate verify failed: "), untrusted
        assert "self-signed" in untrusted.reason or "self signed" in untrusted.reason
        # Trusted, but another name than the certificate's.
        ctx = tls_context(True, str(cert.cert))
        wrong = await http_get("127.0.0.1", srv.port, WAIT, tls=ctx, server_name="other.test")
        assert wrong.reason.startswith("tls: certificate verify failed: "), wrong
        assert "mismatch" in wrong.reason
        # Verification off: anything goes (encrypted, not authenticated).
        off = await http_get("127.0.0.1", srv.port, WAIT, tls=tls_context(False),
                             server_name="other.test")
        assert off.ok, off
        await srv.stop()

    run(main())


def test_https_handshake_failure_is_a_named_failure() -> None:
    async def main() -> None:
        # A plain-text HTTP server where TLS is expected.
        async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(plain, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        r = await http_get("127.0.0.1", port, WAIT, tls=tls_context(False))
        assert not r.ok and not r.local
        assert r.reason.startswith("tls handshake failed: "), r
        server.close()
        await server.wait_closed()

    run(main())


def test_https_over_ipv6(cert: Cert, has_ipv6: None) -> None:
    async def main() -> None:
        srv = await TlsHttp(cert, "::1").start()
        ctx = tls_context(True, str(cert.cert))
        ok = await http_get("::1", srv.port, WAIT, tls=ctx)  # checked against IP ::1
        assert ok.ok, ok
        assert f"\r\nHost: [::1]:{srv.port}\r\n" in srv.requests[-1].decode()
        named = await http_get("::1", srv.port, WAIT, tls=ctx, server_name=NAME)
        assert named.ok, named
        await srv.stop()

    run(main())


def test_checker_https_up_then_down_on_a_bad_certificate(cert: Cert, has_ipv6: None) -> None:
    async def main() -> None:
        srv = await TlsHttp(cert, "::1").start()
        checker = HealthChecker()
        assert checker.transitions is not None
        base = ProbeConfig(kind="https", port=srv.port, ca_file=cert.cert, server_name=NAME,
                           interval_s=0.2, rise=1, fall=1, initial="down",
                           damping={"enabled": False})
        checker.add("web6", "::1", base)
        async with asyncio.timeout(WAIT):
            first = await checker.transitions.get()
        assert first.up and checker.status("web6").kind == "https"
        # The same backend, now checked against the system's trust store: down,
        # and the reason says why.
        checker.update("web6", "::1", base.model_copy(update={"ca_file": None}))
        async with asyncio.timeout(WAIT):
            second = await checker.transitions.get()
        assert not second.up and "certificate verify failed" in second.reason, second
        with pytest.raises(ValueError, match="ca_file"):
            checker.add("bad", "::1", base.model_copy(
                update={"ca_file": cert.cert.parent / "missing.pem"}))
        checker.close()
        await srv.stop()

    run(main())


def test_tls_context_and_default_server_name(tmp_path: Path) -> None:
    assert tls_context().verify_mode == ssl.CERT_REQUIRED
    off = tls_context(False)
    assert (off.verify_mode, off.check_hostname) == (ssl.CERT_NONE, False)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    for bad in (junk, tmp_path / "absent.pem"):
        with pytest.raises(ValueError, match="https probe ca_file"):
            tls_context(True, str(bad))
    with pytest.raises(ValueError, match="verification off"):
        tls_context(False, str(junk))
    assert default_server_name("10.0.0.1", None) == "10.0.0.1"
    assert default_server_name("10.0.0.1", "web.example:8443") == "web.example"
    assert default_server_name("10.0.0.1", "web.example") == "web.example"
    assert default_server_name("fd00::1", "[fd00::1]:8443") == "fd00::1"
