"""Network namespaces the exception-path tests share (test_dpdk_forwarder.py for
IPv4, test_exception_path6.py for IPv6): made fresh per test, deleted even when
the test fails, and a probe of what the kernel answers for a VIP."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


@contextmanager
def namespaces(prefix: str, count: int) -> Iterator[list[str]]:
    """`count` fresh namespaces named prefix-<random>, deleted on the way out."""
    names = [f"{prefix}-{uuid.uuid4().hex[:8]}" for _ in range(count)]
    made: list[str] = []
    try:
        for name in names:
            sh("ip", "netns", "add", name)
            made.append(name)
        yield names
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@contextmanager
def veth_netns(prefix: str) -> Iterator[str]:
    """One namespace with a veth pair d0/d1, both up (a veth end stands in for
    the TAP where a test needs one)."""
    with namespaces(prefix, 1) as (name,):
        sh("ip", "-n", name, "link", "add", "d0", "type", "veth", "peer", "name", "d1")
        for dev in ("d0", "d1"):
            sh("ip", "-n", name, "link", "set", dev, "up")
        yield name


@contextmanager
def appliance_and_client(prefix: str, app_addr: str, cli_addr: str, *addr_flags: str,
                         sysctls: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """An appliance namespace (app_addr on d0, lo up) and a client namespace
    (cli_addr on d1) joined by a veth pair; sysctls are set in both before the
    veth is made, addr_flags go with each address (nodad for IPv6)."""
    with namespaces(prefix, 2) as (app, cli):
        for name in (app, cli):
            if sysctls:
                sh("ip", "netns", "exec", name, "sysctl", "-qw", *sysctls)
        sh("ip", "-n", app, "link", "add", "d0", "type", "veth", "peer", "name", "d1",
           "netns", cli)
        for ns, dev, addr in ((app, "d0", app_addr), (cli, "d1", cli_addr)):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", dev, *addr_flags)
            sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", app, "link", "set", "lo", "up")
        yield app, cli


# From the client namespace: one UDP datagram and one TCP connect to VIP:9
# (nothing listens there), over the VIP's family; prints what came back.
PROBE_VIP = r"""
import socket, sys
vip = sys.argv[1]
family = socket.AF_INET6 if ":" in vip else socket.AF_INET
res = []
u = socket.socket(family, socket.SOCK_DGRAM)
u.settimeout(0.4)
u.connect((vip, 9))
try:
    u.send(b"x")
    u.recv(16)
    res.append("udp-answer")
except ConnectionRefusedError:
    res.append("udp-icmp")
except socket.timeout:
    try:
        u.send(b"x")  # a late ICMP error is reported on the next call
        res.append("udp-silent")
    except ConnectionRefusedError:
        res.append("udp-icmp")
t = socket.socket(family)
t.settimeout(0.4)
try:
    t.connect((vip, 9))
    res.append("tcp-open")
except ConnectionRefusedError:
    res.append("tcp-rst")
except OSError:
    res.append("tcp-silent")
print(" ".join(res))
"""


def probe_vip(cli: str, vip: str) -> str:
    """What the kernel answers from cli for a UDP datagram and a TCP connect to
    vip:9: 'udp-icmp tcp-rst' (the VIP held, nothing listening), 'udp-silent
    tcp-silent' (dropped without a word)."""
    return sh("ip", "netns", "exec", cli, sys.executable, "-c", PROBE_VIP, vip).strip()
